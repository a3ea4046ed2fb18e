"""sglang's KV-cache writers on jitkv: ``store_cache``, ``set_mla_kv_buffer`` and the fused RoPE + KV store
``apply_rope_with_cos_sin_cache_inplace`` (with ``FusedSetKVBufferArg``); and HiCache's transfers between
the device and host pools, ``transfer_hicache_one_layer`` / ``transfer_hicache_all_layer`` and their
``_mla`` forms (``sglang.jit_kernel.hicache``).

Same names, signatures (tuning keywords included) and results as sglang's JIT kernels
``sglang.jit_kernel.kvcache.store_cache``, ``sglang.jit_kernel.set_mla_kv_buffer.set_mla_kv_buffer`` and
``sglang.jit_kernel.rope`` (as read in sglang's main branch in 2026 and in 0.5.10.post1), together with how
its memory pools call them.

sglang's slot conventions differ from jitkv's (docs/design.md §3), and these shims follow sglang:

- Slot 0 is an ordinary row. sglang's pools allocate one extra row and send padded or dummy tokens
  there, so it must be written, not skipped (jitkv's ``skip_slot`` stays off).
- There is no padding value. A negative slot is out of range: sglang's ``store_cache`` fails with a
  device assert (earlier versions wrote out of bounds) and its MLA kernel writes out of bounds. Here
  a negative slot raises IndexError on CPU, and on CUDA under ``JITKV_DEBUG=1`` (a host check, before
  anything is written); without it the CUDA kernels skip the row, since a device assert would take
  down the whole CUDA context and a device-side check costs extra launches on every call.
- A slot at or past the cache's rows (or ``size_limit``) raises IndexError on CPU before anything is
  written; CUDA skips the row, or raises on the host under ``JITKV_DEBUG=1``.

Errors otherwise come from jitkv's ops and name their arguments (k, v, k_cache, v_cache,
slot_mapping; kv_buffer, loc, k_nope, k_rope).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.compiler import is_compiling

from .. import checks, reference
from .. import rope_store_cache as _rope_store_cache
from .. import set_mla_kv_buffer as _set_mla_kv_buffer
from .. import store_cache as _store_cache
from .. import transfer_pages as _transfer_pages

__all__ = [
    "FusedSetKVBufferArg",
    "apply_rope_with_cos_sin_cache_inplace",
    "set_mla_kv_buffer",
    "store_cache",
    "transfer_hicache_all_layer",
    "transfer_hicache_all_layer_mla",
    "transfer_hicache_one_layer",
    "transfer_hicache_one_layer_mla",
]


def store_cache(k, v, k_cache, v_cache, indices, *, row_bytes=0, num_split=0, size_limit=0):
    """Copy K and V rows into their caches: ``k_cache[indices[i]] = k[i]``, ``v_cache[indices[i]] = v[i]``.

    Args:
        k, v: ``[batch, H*D]`` as sglang passes them (``[batch, H, D]`` works too), batch >= n =
            ``indices.numel()``; any row stride, last dim contiguous. One dtype for all four tensors:
            bf16, fp16, fp32, or a 1-byte type (uint8, float8_e4m3fn, float8_e5m2).
        k_cache, v_cache: ``[num_rows, H*D]`` (or ``[num_rows, H, D]``); written in place.
        indices: ``[n]`` int32 or int64 row per token; row 0 is written like any other (sglang's
            reserved padding row). A strided 1-D index is accepted, as sglang does (made contiguous
            first).
        row_bytes: bytes per row as sglang's kernel is specialised for; 0 (default) or exactly the
            row size of k.
        num_split: sglang's warps-per-row knob; accepted and ignored (jitkv picks its own launch).
        size_limit: rows ``[0, size_limit)`` are valid (sglang's pools pass real slots + the padding
            row); 0 (default) means all rows of k_cache.

    FP8 caches: sglang's MHA pool quantizes before calling this (``x.div_(scale)`` in the source
    dtype, then ``.to(float8)``, unclamped) and passes byte views, so this is a bitwise copy for every
    dtype, as sglang's kernel is. jitkv's own quantize-on-write
    (``jitkv.store_cache(kv_cache_dtype="fp8_e4m3", ...)``) divides in fp32 and saturates instead, so
    its bytes can differ from sglang's pool.

    Raises:
        ValueError: row_bytes that is neither 0 nor the row size of k; and the TypeError/ValueError
            of ``jitkv.store_cache`` (dtype, shape, device, layout).
        IndexError: a negative index or one >= size_limit (or the row count), on CPU, and on CUDA
            with ``JITKV_DEBUG=1``; nothing is written then (see the module docstring).
    """
    _check_row_bytes(k, row_bytes)
    indices = _slots(indices, "indices", "store_cache")
    k_cache, v_cache = _first_rows(k_cache, size_limit), _first_rows(v_cache, size_limit)
    _store_cache(k, v, k_cache, v_cache, indices)


def set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, k_split=0, num_warps=0, items_per_warp=0):
    """Write MLA rows: ``kv_buffer[loc[i], :nope] = cache_k_nope[i]``, ``[nope:nope+rope] = cache_k_rope[i]``.

    Args:
        kv_buffer: ``[num_rows, W]`` or ``[num_rows, 1, W]`` (trailing dims are viewed as one row, as
            sglang does), W >= nope + rope; columns past nope + rope are untouched. Written in place.
        loc: ``[n]`` int32 or int64; row 0 is written like any other (sglang's padding row). A
            strided 1-D index is made contiguous first.
        cache_k_nope: ``[n', nope]`` or ``[n', 1, nope]``, cache_k_rope: ``[n', rope]`` or
            ``[n', 1, rope]``, n' >= n; any row stride, last dim contiguous. One dtype everywhere:
            bf16, fp16, fp32, or a 1-byte type. sglang's MLA pool casts fp8 rows with ``.to(float8)``
            (no scale) and passes uint8 views before this call; this is a bitwise copy.
        k_split, num_warps, items_per_warp: sglang's launch knobs; accepted and ignored.

    Raises:
        ValueError: trailing dims that cannot be viewed as one row; and the TypeError/ValueError of
            ``jitkv.set_mla_kv_buffer``.
        IndexError: a negative loc or one >= num_rows, on CPU, and on CUDA with ``JITKV_DEBUG=1``;
            nothing is written then (sglang's kernel does not check).
    """
    loc = _slots(loc, "loc", "set_mla_kv_buffer")
    kv_buffer = _as_rows(kv_buffer, "kv_buffer")
    _set_mla_kv_buffer(kv_buffer, loc, _as_rows(cache_k_nope, "cache_k_nope"), _as_rows(cache_k_rope, "cache_k_rope"))


@dataclass
class FusedSetKVBufferArg:
    """What ``apply_rope_with_cos_sin_cache_inplace`` also stores, as sglang passes it: ``value``
    ``[nnz, Hk*D]`` (or ``[nnz, Hk, D]``), ``k_buffer`` / ``v_buffer`` ``[cache_size, Hk*D]`` (or
    ``[cache_size, Hk, D]``), ``cache_loc`` ``[nnz]`` the row of each token."""

    value: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    cache_loc: torch.Tensor


def apply_rope_with_cos_sin_cache_inplace(q, k, cos_sin_cache, positions, *, is_neox, rope_dim=0, fused_args=None):
    """RoPE on q and k in place, and with ``fused_args`` the rotated k and v stored at ``cache_loc``.

    ``q[t], k[t]`` rotated at ``positions[t]`` over their first ``rope_dim`` dims (0: the table's width);
    with ``fused_args``: ``k_buffer[cache_loc[t]] = rotated k[t]``, ``v_buffer[cache_loc[t]] = value[t]``.

    Args:
        q: ``[nnz, Hq, D]``; k ``[nnz, Hk, D]``: bf16, fp16 or fp32, rotated in place (every row).
        cos_sin_cache: ``[max_pos, rope_dim]``, cos half then sin half (sglang passes float32).
        positions: ``[nnz]`` int32 or int64.
        is_neox: NeoX halves (True) or GPT-J pairs (False).
        rope_dim: the rotated dims (even, <= D); 0 means ``cos_sin_cache.shape[-1]``.
        fused_args: None (RoPE only), or a ``FusedSetKVBufferArg``; the buffers take k's dtype (sglang's
            fused store writes bf16 caches). Row 0 is written like any other (sglang's padding row).

    Results equal sglang's on what both compute: jitkv rotates in float32 with one rounding per store and
    no fused multiply-add (docs/design.md §9), where sglang's kernel may contract ``x * cos - y * sin``
    into an FMA, so a value can differ in its last bit. Without ``fused_args`` jitkv runs the same op
    with every token marked padding (a view of one kept -1 tensor: no fill kernel per call) and two
    one-row scratch caches (nothing of them is written).

    Raises:
        the TypeError / ValueError of ``jitkv.rope_store_cache`` (named as its arguments: value is ``v``,
        k_buffer / v_buffer are ``k_cache`` / ``v_cache``, cache_loc is ``slot_mapping``). IndexError: a
        negative cache_loc (sglang has no padding value) or one past the buffers, and a position past the
        table, on CPU, and on CUDA with ``JITKV_DEBUG=1``; nothing is written then.
    """
    kw = dict(is_neox=is_neox, rotary_dim=rope_dim or None, k_out=k)
    if fused_args is None:
        checks.tensor("rope_store_cache", "positions", positions)  # the padding slots take its device
        scratch = [k.new_empty(1, *k.shape[1:]) if isinstance(k, torch.Tensor) else None for _ in "kv"]
        _rope_store_cache(q, k, k, *scratch, _padding_slots(len(q), positions), positions, cos_sin_cache, **kw)
        return
    loc = _slots(fused_args.cache_loc, "cache_loc", "apply_rope_with_cos_sin_cache_inplace")
    _rope_store_cache(
        q, k, fused_args.value, fused_args.k_buffer, fused_args.v_buffer, loc, positions, cos_sin_cache, **kw
    )


_PADDING: dict = {}  # (device, dtype) -> a 1-D tensor of -1 slots that RoPE-only calls take views of
_RETIRED: list = []  # padding tensors a larger one replaced: a kernel queued on another stream may read them


def _padding_slots(n, like):
    """n padding slots (-1) of like's dtype on its device: a view of one tensor kept per device and dtype,
    so that a RoPE-only call launches no fill kernel of its own. Made (a fill) outside CUDA-graph capture
    and torch.compile only: inside a capture the fill is recorded, not run, so that call fills a tensor of
    its own, and so does a traced one."""
    key = (like.device, like.dtype)
    pad = _PADDING.get(key)
    if pad is not None and pad.numel() >= n:
        return pad[:n]
    if is_compiling() or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return torch.full((n,), -1, dtype=like.dtype, device=like.device)
    if pad is not None:
        _RETIRED.append(pad)
    pad = _PADDING[key] = torch.full((max(n, 1024),), -1, dtype=like.dtype, device=like.device)
    return pad[:n]


def _check_row_bytes(k, row_bytes):
    """sglang's kernel is built for ``row_bytes`` and refuses rows of another size."""
    if not row_bytes or not isinstance(k, torch.Tensor) or k.dim() < 2:
        return
    actual = math.prod(k.shape[1:]) * k.element_size()
    if row_bytes != actual:
        raise ValueError(f"store_cache: row_bytes: expected 0 or the row size of k ({actual} bytes), got {row_bytes}")


def _first_rows(cache, size_limit):
    """The cache's rows below ``size_limit`` (a view): jitkv then treats higher slots as out of range."""
    if size_limit > 0 and isinstance(cache, torch.Tensor) and cache.dim() >= 1:
        return cache[:size_limit]
    return cache


def _slots(index, name, op):
    """``index`` as jitkv takes it: contiguous, and with no negative slot (sglang has no padding value)."""
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
        return index  # jitkv raises the TypeError/ValueError
    if not index.is_contiguous():
        index = index.contiguous()
    _refuse_negative(index, name, op)
    return index


def _refuse_negative(index, name, op):
    """IndexError at the first negative slot, where jitkv checks slots on the host (CPU, or
    JITKV_DEBUG=1). Not while a CUDA graph is captured: the host read would invalidate the capture
    (jitkv's own debug check refuses capture with its error)."""
    if is_compiling() or not reference.default_strict(index):
        return
    if index.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    negative = (index < 0).nonzero()
    if negative.numel():
        i = int(negative[0, 0])
        raise IndexError(
            f"{op}: {name}: position {i} has slot {int(index[i])}; sglang has no padding slot value, "
            "a negative slot is out of range"
        )


def _as_rows(t, name):
    """``[rows, ...]`` as the ``[rows, row]`` view sglang's MLA wrapper makes (never a copy)."""
    if not isinstance(t, torch.Tensor) or t.dim() <= 2:
        return t
    try:
        return t.view(t.shape[0], math.prod(t.shape[1:]))
    except RuntimeError:
        raise ValueError(
            f"set_mla_kv_buffer: {name}: trailing dims of shape {list(t.shape)} (strides {t.stride()}) cannot be "
            "viewed as one row"
        ) from None


# ---------------------------------------------------------------------------------------- HiCache
# sglang.jit_kernel.hicache (names and argument order as in sglang's main branch, 2026): tokens
# ("items") between the device KV pool and the pinned host pool. One item is element_dim values
# (element_size bytes) of one layer; item indices_src[i] goes to item indices_dst[i]. unroll and
# block_quota tune sglang's kernel (its loop unrolling, how many SMs it may take) and are accepted and
# ignored: jitkv picks its own copy path.


def transfer_hicache_one_layer(
    k_cache_dst,
    v_cache_dst,
    indices_dst,
    k_cache_src,
    v_cache_src,
    indices_src,
    *,
    element_dim=None,
    unroll=None,
    block_quota=None,
):
    """One layer's K and V items, as sglang's ``transfer_hicache_one_layer``:
    ``k_cache_dst.view(-1, element_dim)[indices_dst[i]] = k_cache_src.view(-1, element_dim)[indices_src[i]]``,
    and the same for V.

    Args:
        k_cache_dst, v_cache_dst, k_cache_src, v_cache_src: one layer's caches, contiguous (sglang
            views them as ``[-1, element_dim]``), one dtype; a CPU side pinned.
        indices_dst, indices_src: ``[N]`` int32/int64 item (token) indices on the GPU cache's device.
        element_dim: values per item (default: ``k_cache_dst.size(-1)``).
        unroll, block_quota: sglang's kernel tuning, ignored.

    As the other shims of this module: there is no padding value, a negative index is out of range
    (IndexError on CPU and under ``JITKV_DEBUG=1``; skipped on CUDA otherwise), as is one past the cache.

    Raises: the errors of ``jitkv.transfer_pages`` (naming src / dst for the caches), IndexError as above.
    """
    del unroll, block_quota  # sglang's kernel tuning
    op = "transfer_hicache_one_layer"
    dim = element_dim or k_cache_dst.size(-1)
    pools = [_items(t, dim) for t in (k_cache_src, v_cache_src, k_cache_dst, v_cache_dst)]
    src_idx, dst_idx = _slots(indices_src, "indices_src", op), _slots(indices_dst, "indices_dst", op)
    _transfer_pages(tuple(pools[:2]), tuple(pools[2:]), src_idx, dst_idx)


def transfer_hicache_one_layer_mla(
    cache_dst, indices_dst, cache_src, indices_src, *, element_dim=None, unroll=None, block_quota=None
):
    """``transfer_hicache_one_layer`` for one MLA cache per layer (no V), as sglang's
    ``transfer_hicache_one_layer_mla``; the same arguments and rules."""
    del unroll, block_quota  # sglang's kernel tuning
    op = "transfer_hicache_one_layer_mla"
    dim = element_dim or cache_dst.size(-1)
    src_idx, dst_idx = _slots(indices_src, "indices_src", op), _slots(indices_dst, "indices_dst", op)
    _transfer_pages(_items(cache_src, dim), _items(cache_dst, dim), src_idx, dst_idx)


def transfer_hicache_all_layer(
    k_ptr_dst,
    v_ptr_dst,
    indices_dst,
    k_ptr_src,
    v_ptr_src,
    indices_src,
    *,
    kv_cache_src_stride_bytes,
    kv_cache_dst_stride_bytes,
    element_size=None,
    unroll=None,
    block_quota=None,
):
    """Every layer's K and V items, as sglang's ``transfer_hicache_all_layer``: for each layer l, item
    ``indices_src[i]`` of the src pool to item ``indices_dst[i]`` of the dst pool.

    sglang passes per-layer base-pointer tables (``k_ptr_*``: uint64 ``[num_layers]``) and addresses
    item j of layer l at ``ptr[l] + j * stride_bytes``. Raw addresses cannot be checked, so here each
    ``*_ptr_*`` argument is the pool itself: ``[num_layers, num_items, *item]`` with a dense item
    (a layer-first pool as is; a page-first host pool ``[num_items, num_layers, *item]`` as its
    ``transpose(0, 1)``), whose dim-1 stride in bytes must equal the ``*_stride_bytes`` argument and
    whose item must be ``element_size`` bytes (when given). A pointer table raises TypeError.

    Args:
        k_ptr_dst, v_ptr_dst, k_ptr_src, v_ptr_src: the pools (above); a CPU side pinned.
        indices_dst, indices_src: ``[N]`` int32/int64 item indices on the GPU pool's device.
        kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes: bytes between consecutive items of one
            layer (checked against the pools).
        element_size: bytes of one item (default: the src stride, sglang's contiguous case; checked).
        unroll, block_quota: sglang's kernel tuning, ignored.

    Index rules as ``transfer_hicache_one_layer``.

    Raises:
        TypeError: a pointer table in place of a pool. ValueError: a stride or element_size that is
        not the pools'; the errors of ``jitkv.transfer_pages``. IndexError as above.
    """
    del unroll, block_quota  # sglang's kernel tuning
    op = "transfer_hicache_all_layer"
    named = (("k_ptr_src", k_ptr_src), ("v_ptr_src", v_ptr_src), ("k_ptr_dst", k_ptr_dst), ("v_ptr_dst", v_ptr_dst))
    strides = {"src": ("kv_cache_src_stride_bytes", kv_cache_src_stride_bytes)}
    strides["dst"] = ("kv_cache_dst_stride_bytes", kv_cache_dst_stride_bytes)
    pools = [_layer_pool(op, name, t, *strides[name[-3:]], element_size) for name, t in named]
    src_idx, dst_idx = _slots(indices_src, "indices_src", op), _slots(indices_dst, "indices_dst", op)
    _transfer_pages(tuple(pools[:2]), tuple(pools[2:]), src_idx, dst_idx)


def transfer_hicache_all_layer_mla(
    ptr_dst,
    indices_dst,
    ptr_src,
    indices_src,
    *,
    cache_src_stride_bytes,
    cache_dst_stride_bytes,
    element_size=None,
    unroll=None,
    block_quota=None,
):
    """``transfer_hicache_all_layer`` for one MLA pool (no V), as sglang's
    ``transfer_hicache_all_layer_mla``; pools in place of pointer tables, the same rules."""
    del unroll, block_quota  # sglang's kernel tuning
    op = "transfer_hicache_all_layer_mla"
    src = _layer_pool(op, "ptr_src", ptr_src, "cache_src_stride_bytes", cache_src_stride_bytes, element_size)
    dst = _layer_pool(op, "ptr_dst", ptr_dst, "cache_dst_stride_bytes", cache_dst_stride_bytes, element_size)
    src_idx, dst_idx = _slots(indices_src, "indices_src", op), _slots(indices_dst, "indices_dst", op)
    _transfer_pages(src, dst, src_idx, dst_idx)


def _items(cache, element_dim):
    """One layer's cache as a pool of one layer whose pages are items: ``[1, -1, element_dim]``, a view
    (sglang's ``view(-1, element_dim)``)."""
    if not isinstance(cache, torch.Tensor):
        return cache  # transfer_pages raises the TypeError
    return cache.view(1, -1, element_dim)


def _layer_pool(op, name, pool, stride_name, stride_bytes, element_size):
    """A pool in place of sglang's pointer table, checked against the stride and item size given."""
    if not isinstance(pool, torch.Tensor):
        return pool  # transfer_pages raises the TypeError
    if pool.dim() < 2:
        raise TypeError(
            f"{op}: {name}: per-layer pointer tables are not supported; pass the pool [num_layers, num_items, "
            f"...] (a page-first pool as its transpose(0, 1)), got shape {list(pool.shape)}"
        )
    es = pool.element_size()
    if pool.stride(1) * es != stride_bytes:
        raise ValueError(
            f"{op}: {stride_name}: expected {pool.stride(1) * es} (the item stride of {name}), got {stride_bytes}"
        )
    item = pool[0, 0].numel() * es
    if element_size is not None and element_size != item:
        raise ValueError(f"{op}: element_size: expected {item} (the item bytes of {name}), got {element_size}")
    return pool
