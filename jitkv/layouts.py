"""Paged caches of fixed-size token records (docs/design.md §5): the descriptor the DeepSeek-V4 and
indexer K cache layouts share (allocation, validation). The records' constants are jitkv/codes.py's."""

from __future__ import annotations

import torch

from . import checks


class PagedRecordLayout:
    """A paged cache of fixed-size token records: uint8 ``[num_blocks, block_stride]``, a block holding
    its ``block_size`` tokens' records (how they are arranged inside is the subclass's), then padding
    up to the block stride. Subclasses set ``name``, ``token_bytes`` and ``alignment`` (bytes the base
    pointer and the block stride must be multiples of)."""

    name = "paged record"
    cache_arg = "kv_cache"  # the ops' name for the cache argument, in error messages
    token_bytes = 1
    alignment = 16

    def block_stride(self, block_size: int) -> int:
        """The block stride ``allocate`` uses by default: ``block_size * token_bytes`` rounded up to the
        CUDA kernels' 16-byte vectors."""
        return -(-block_size * self.token_bytes // 16) * 16

    def allocate(
        self, num_blocks: int, block_size: int = 64, device="cuda", *, block_stride: int | None = None
    ) -> torch.Tensor:
        """A zeroed uint8 cache ``[num_blocks, block_stride]``; ``block_stride`` defaults to
        ``block_stride(block_size)``. Raises ValueError unless it is a multiple of ``alignment`` with
        ``block_size * token_bytes <= block_stride < (block_size + 1) * token_bytes``."""
        stride = self.block_stride(block_size) if block_stride is None else block_stride
        lo, hi = block_size * self.token_bytes, (block_size + 1) * self.token_bytes
        if not (isinstance(stride, int) and lo <= stride < hi and stride % self.alignment == 0):
            raise ValueError(
                f"{self.name}.allocate: block_stride: expected a multiple of {self.alignment} in "
                f"[{lo}, {hi}) for block_size {block_size}, got {block_stride!r}"
            )
        return torch.zeros(num_blocks, stride, dtype=torch.uint8, device=device)

    def validate(self, cache, block_size: int, op: str | None = None) -> None:
        """Raise TypeError/ValueError (naming ``op``, default the layout's name) unless ``cache`` is a
        cache of this layout for ``block_size``: uint8 ``[num_blocks, W]`` with ``block_size *
        token_bytes <= W < (block_size + 1) * token_bytes``, or a ``[num_blocks, block_size,
        token_bytes]`` view with packed tokens; block stride ``stride(0)`` >= ``block_size *
        token_bytes`` and, like the base pointer, a multiple of ``alignment``. The same rules as the
        families' C++ parsers."""
        op, arg, tb = op or self.name, self.cache_arg, self.token_bytes
        checks.tensor(op, arg, cache)
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise TypeError(f"{op}: block_size: expected an int, got {type(block_size).__name__}")
        if block_size < 1:
            raise ValueError(f"{op}: block_size: expected a positive int, got {block_size}")
        if cache.dtype != torch.uint8:
            raise TypeError(f"{op}: {arg}: expected dtype uint8, got {checks.dtype_name(cache.dtype)}")
        used = block_size * tb
        if cache.dim() == 2:
            if cache.shape[1] // tb != block_size:
                raise ValueError(
                    f"{op}: {arg}: blocks of {cache.shape[1]} bytes hold {cache.shape[1] // tb} tokens of {tb} "
                    f"bytes, but block_size is {block_size} (expected [num_blocks, W] with {used} <= W < {used + tb}), "
                    f"got shape {list(cache.shape)}"
                )
        elif cache.dim() == 3:
            if tuple(cache.shape[1:]) != (block_size, tb):
                raise ValueError(
                    f"{op}: {arg}: expected [num_blocks, {block_size}, {tb}] for block_size {block_size}, "
                    f"got {list(cache.shape)}"
                )
            if block_size > 1 and cache.stride(1) != tb:
                raise ValueError(
                    f"{op}: {arg}: expected stride(1) = {tb} (tokens packed in a block), got {cache.stride(1)}"
                )
        else:
            raise ValueError(
                f"{op}: {arg}: expected a 2-D [num_blocks, block_stride] or 3-D [num_blocks, block_size, "
                f"{tb}] tensor, got {list(cache.shape)}"
            )
        checks.last_dim_contiguous(op, arg, cache)
        stride = cache.stride(0)
        if cache.shape[0] > 1 and (stride < used or stride % self.alignment):  # one block: no stride
            raise ValueError(
                f"{op}: {arg}: expected stride(0) (the block stride in bytes) to be a multiple of "
                f"{self.alignment} and >= block_size * {tb} = {used}, got {stride}"
            )
        if cache.data_ptr() % self.alignment:
            raise ValueError(f"{op}: {arg}: expected a {self.alignment}-byte aligned data pointer")
