"""Record layouts and fp8 codes: the one place they are defined (docs/design.md §4, §5).

Python backends (the torch reference, Triton) import them; the C++/CUDA kernels receive them as build
arguments (``JitSpec`` args, ``-DJITKV_<NAME>``), so a layout change reaches every backend and every
cache key at once.
"""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# kv_cache_dtype names accepted by the writers, and the fp8 dtype each stores.
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Codes of the cache formats in kernels' build arguments: 0 is a plain copy.
FP8_CODES = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
DS_MLA_CODE = 3  # the fp8_ds_mla record (below) among those codes

# DeepSeek-V4 FP8 K cache record (docs/design.md §5): per token 448 dims as e4m3, 64 dims as bf16,
# then 8 bytes of UE8M0 scales (7 groups of 64 dims + one zero byte); a block holds all its tokens'
# data, then all their scales.
DSV4_HEAD_DIM = 512
DSV4_NOPE = 448  # dims stored as e4m3, one UE8M0 scale per 64
DSV4_ROPE = 64  # dims stored as bf16
DSV4_DATA_BYTES = DSV4_NOPE + 2 * DSV4_ROPE  # 576
DSV4_SCALE_BYTES = 8  # 7 used + 1 zero byte
DSV4_TOKEN_BYTES = DSV4_DATA_BYTES + DSV4_SCALE_BYTES  # 584
DSV4_GROUP = 64

# vLLM's "fp8_ds_mla" MLA record (DeepSeek-V3.2 sparse MLA), 656 bytes per token: the 512 nope values
# as e4m3 in 4 tiles of 128, each tile's fp32 scale (amax / 448), then the 64 rope values as bf16:
# [512 B e4m3 | 16 B fp32 scales | 128 B bf16].
DS_MLA_NOPE = 512
DS_MLA_ROPE = 64
DS_MLA_TILE = 128
DS_MLA_TILES = DS_MLA_NOPE // DS_MLA_TILE  # 4
DS_MLA_SCALE_OFFSET = DS_MLA_NOPE  # 512
DS_MLA_ROPE_OFFSET = DS_MLA_SCALE_OFFSET + 4 * DS_MLA_TILES  # 528
DS_MLA_RECORD_BYTES = DS_MLA_ROPE_OFFSET + 2 * DS_MLA_ROPE  # 656

# DeepSeek-V3.2 sparse-attention indexer K cache (vLLM's indexer_k_quant_and_cache /
# cp_gather_indexer_k_quant_cache, sglang's NSA index_k pool), 132 bytes per token: the 128-dim key
# as e4m3 and one fp32 scale per token (one quant block of 128 values). A block holds all its tokens'
# values, then all their scales: [block_size * 128 B e4m3 | block_size * 4 B fp32].
INDEXER_HEAD_DIM = 128  # e4m3 bytes per token
INDEXER_QUANT_BLOCK = 128  # values per scale: one scale per token
INDEXER_SCALE_BYTES = 4  # one fp32 scale
INDEXER_TOKEN_BYTES = INDEXER_HEAD_DIM + INDEXER_SCALE_BYTES  # 132
INDEXER_FP8_MAX = 448.0  # e4m3: scale = max(amax, INDEXER_AMAX_MIN) / 448
INDEXER_AMAX_MIN = 1e-4


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

    def allocate(self, num_blocks: int, block_size: int = 64, device="cuda", *, block_stride: int | None = None) -> torch.Tensor:
        """A zeroed uint8 cache ``[num_blocks, block_stride]``; ``block_stride`` defaults to
        ``block_stride(block_size)``. Raises ValueError unless it is a multiple of ``alignment`` with
        ``block_size * token_bytes <= block_stride < (block_size + 1) * token_bytes``."""
        stride = self.block_stride(block_size) if block_stride is None else block_stride
        lo, hi = block_size * self.token_bytes, (block_size + 1) * self.token_bytes
        if not (isinstance(stride, int) and lo <= stride < hi and stride % self.alignment == 0):
            raise ValueError(f"{self.name}.allocate: block_stride: expected a multiple of {self.alignment} in "
                             f"[{lo}, {hi}) for block_size {block_size}, got {block_stride!r}")
        return torch.zeros(num_blocks, stride, dtype=torch.uint8, device=device)

    def validate(self, cache, block_size: int, op: str | None = None) -> None:
        """Raise TypeError/ValueError (naming ``op``, default the layout's name) unless ``cache`` is a
        cache of this layout for ``block_size``: uint8 ``[num_blocks, W]`` with ``block_size *
        token_bytes <= W < (block_size + 1) * token_bytes``, or a ``[num_blocks, block_size,
        token_bytes]`` view with packed tokens; block stride ``stride(0)`` >= ``block_size *
        token_bytes`` and, like the base pointer, a multiple of ``alignment``. The same rules as the
        families' C++ parsers."""
        from .ops import _validate  # noqa: PLC0415  (ops imports this module)

        op, arg, tb = op or self.name, self.cache_arg, self.token_bytes
        _validate.tensor(op, arg, cache)
        if not (cache.is_cpu or cache.is_cuda):
            raise _validate.unsupported_device(op, arg, cache)
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise TypeError(f"{op}: block_size: expected an int, got {type(block_size).__name__}")
        if block_size < 1:
            raise ValueError(f"{op}: block_size: expected a positive int, got {block_size}")
        if cache.dtype != torch.uint8:
            raise TypeError(f"{op}: {arg}: expected dtype uint8, got {cache.dtype}")
        used = block_size * tb
        if cache.dim() == 2:
            if cache.shape[1] // tb != block_size:
                raise ValueError(
                    f"{op}: {arg}: blocks of {cache.shape[1]} bytes hold {cache.shape[1] // tb} tokens of {tb} "
                    f"bytes, but block_size is {block_size} (expected [num_blocks, W] with {used} <= W < {used + tb}), "
                    f"got shape {list(cache.shape)}")
        elif cache.dim() == 3:
            if tuple(cache.shape[1:]) != (block_size, tb):
                raise ValueError(f"{op}: {arg}: expected [num_blocks, {block_size}, {tb}] for block_size {block_size}, "
                                 f"got {list(cache.shape)}")
            if block_size > 1 and cache.stride(1) != tb:
                raise ValueError(f"{op}: {arg}: expected stride(1) = {tb} (tokens packed in a block), got "
                                 f"{cache.stride(1)}")
        else:
            raise ValueError(f"{op}: {arg}: expected a 2-D [num_blocks, block_stride] or 3-D [num_blocks, block_size, "
                             f"{tb}] tensor, got {list(cache.shape)}")
        _validate.last_dim_contiguous(op, arg, cache)
        stride = cache.stride(0)
        if cache.shape[0] > 1 and (stride < used or stride % self.alignment):  # one block: no stride
            raise ValueError(f"{op}: {arg}: expected stride(0) (the block stride in bytes) to be a multiple of "
                             f"{self.alignment} and >= block_size * {tb} = {used}, got {stride}")
        if cache.data_ptr() % self.alignment:
            raise ValueError(f"{op}: {arg}: expected a {self.alignment}-byte aligned data pointer")
