"""Triton fallback of gather_mla_cache (reference.gather_mla_cache gives the rule), bit-exact with the CUDA kernel.

One program per BLOCK_T consecutive output rows. Each row finds its request by a binary search over
cu_seq_lens (SEARCH_STEPS halvings, a build constant from num_reqs: graph-safe), then its position,
block-table entry and cache entry exactly as the CUDA kernel's entry_offset; a row no request covers
is masked off, an invalid position or block gives a zero row. "auto" copies same-width integers
(bitwise, any dtype); the fp8 formats read the cache as bytes and decode in integer arithmetic
(jitkv.triton.dsv4's e4m3 decoder and bf16 rounding: NaN as 0x7FFF), so the result does not depend
on the GPU's fp8 support or on the interpreter. fp8_ds_mla reads a row's nope bytes as
[tiles, DS_TILE] next to its [tiles, 1] fp32 scales (assembled from bytes: any cache alignment).
"""

import torch
import triton
import triton.language as tl

from ..codes import KV_FORMATS, DsMla, KvFormat
from .dsv4 import _bf16_bits, _e4m3_decode

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_COPY = tl.constexpr(int(KvFormat.COPY))
_E5M2 = tl.constexpr(int(KvFormat.E5M2))
_DS_MLA = tl.constexpr(int(KvFormat.DS_MLA))
_BLOCK_T, _WARPS = 16, 4


@triton.jit
def _e5m2_decode(b):
    """e5m2 byte (int32) -> fp32: the high byte of the fp16 of the same value."""
    e = (b >> 2) & 31
    m = b & 3
    sign = (b & 0x80) << 24
    normal = (sign | ((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
    denormal = ((m.to(tl.float32) * 0.0000152587890625).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    special = (sign | 0x7F800000 | (m << 21)).to(tl.float32, bitcast=True)  # inf, or NaN when m != 0
    return tl.where(e == 0, denormal, tl.where(e == 31, special, normal))


@triton.jit
def _entries(
    t,
    rows,
    cu_ptr,
    starts_ptr,
    bt_ptr,
    num_reqs,
    bt_stride,
    max_blocks,
    num_blocks,
    block_size,
    block_stride,
    token_stride,
    HAS_STARTS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """(write, valid, entry offset in cache elements) of output rows t (int64 [BLOCK_T, 1]). Everything
    stays 2-D: Triton 3.6 mis-assigns layouts to 1-D row values that later broadcast against columns
    (RemoveLayoutConversions fails on their select and cast)."""
    live = t < rows
    lo = tl.zeros_like(t)
    hi = tl.zeros_like(t) + num_reqs
    for _ in tl.static_range(SEARCH_STEPS):  # largest r < num_reqs with cu_seq_lens[r] <= t
        active = hi - lo > 1
        mid = (lo + hi) // 2
        right = active & (tl.load(cu_ptr + mid, mask=live & active, other=0).to(tl.int64) <= t)
        lo = tl.where(right, mid, lo)
        hi = tl.where(active & ~right, mid, hi)
    start = tl.load(cu_ptr + lo, mask=live, other=0).to(tl.int64)
    end = tl.load(cu_ptr + lo + 1, mask=live, other=0).to(tl.int64)
    write = live & (t >= start) & (t < end)
    pos = t - start
    if HAS_STARTS:
        pos += tl.load(starts_ptr + lo, mask=write, other=0).to(tl.int64)
    blk = tl.where(pos >= 0, pos // block_size, 0)
    valid = write & (pos >= 0) & (blk < max_blocks)
    phys = tl.load(bt_ptr + lo * bt_stride + blk, mask=valid, other=-1).to(tl.int64)
    valid = valid & (phys >= 0) & (phys < num_blocks)
    entry = tl.where(valid, phys * block_stride + (pos - blk * block_size) * token_stride, 0)
    return write, valid, entry


@triton.jit
def _gather_kernel(
    out_ptr,
    cache_ptr,
    bt_ptr,
    cu_ptr,
    starts_ptr,
    scale_ptr,
    scale_value,
    rows,
    num_reqs,
    out_stride,
    num_blocks,
    block_size,
    block_stride,
    token_stride,
    bt_stride,
    max_blocks,
    HAS_STARTS: tl.constexpr,
    HAS_SCALE_PTR: tl.constexpr,
    FORMAT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DS_NOPE: tl.constexpr,
    DS_TILE: tl.constexpr,
    DS_SCALE_AT: tl.constexpr,
    DS_ROPE_AT: tl.constexpr,
    DS_ROPE: tl.constexpr,
):
    t = (tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
    write, valid, entry = _entries(
        t,
        rows,
        cu_ptr,
        starts_ptr,
        bt_ptr,
        num_reqs,
        bt_stride,
        max_blocks,
        num_blocks,
        block_size,
        block_stride,
        token_stride,
        HAS_STARTS,
        SEARCH_STEPS,
    )
    dst = out_ptr + t * out_stride
    if FORMAT == _DS_MLA:  # fp8_ds_mla: bytes -> bf16 bits
        tiles: tl.constexpr = DS_NOPE // DS_TILE
        e3 = entry[:, :, None]
        v3 = valid[:, :, None]
        tile = tl.arange(0, tiles)[None, :, None]
        scale_bits = tl.zeros([BLOCK_T, tiles, 1], dtype=tl.int32)
        for k in tl.static_range(4):  # little-endian fp32
            b = tl.load(cache_ptr + e3 + DS_SCALE_AT + 4 * tile + k, mask=v3, other=0).to(tl.int32)
            scale_bits |= b << (8 * k)
        dims = tile * DS_TILE + tl.arange(0, DS_TILE)[None, None, :]
        q = tl.load(cache_ptr + e3 + dims, mask=v3, other=0).to(tl.int32)
        val = _bf16_bits(_e4m3_decode(q) * scale_bits.to(tl.float32, bitcast=True))
        tl.store(dst[:, :, None] + dims, tl.where(v3, val, 0).to(tl.int16), mask=write[:, :, None])
        r = tl.arange(0, DS_ROPE)[None, :]
        at = entry + DS_ROPE_AT + 2 * r
        lo = tl.load(cache_ptr + at, mask=valid, other=0).to(tl.int32)
        hi = tl.load(cache_ptr + at + 1, mask=valid, other=0).to(tl.int32)
        tl.store(dst + DS_NOPE + r, (lo | (hi << 8)).to(tl.int16), mask=write)
    else:
        d = tl.arange(0, BLOCK_D)[None, :]
        x = tl.load(cache_ptr + entry + d, mask=valid & (d < D), other=0)
        if FORMAT != _COPY:  # per-tensor fp8 -> bf16 bits
            if HAS_SCALE_PTR:
                scale = tl.load(scale_ptr)
            else:
                scale = scale_value
            b = x.to(tl.int32) & 0xFF
            if FORMAT == _E5M2:
                f = _e5m2_decode(b)
            else:
                f = _e4m3_decode(b)
            x = tl.where(valid, _bf16_bits(f * scale), 0).to(tl.int16)
        tl.store(dst + d, x, mask=write & (d < D))


def gather_mla_cache_triton(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale):
    """The checked arguments of gather_mla_cache, in its order (ops/mla_gather.py ``check``): out [T, D],
    kv_cache [num_blocks, block_size, W], block_table [>= R, max_blocks], cu_seq_lens [R + 1], seq_starts
    [>= R] or None; kv_cache_dtype a name of codes.KV_FORMATS; scale a float or 1-element float32 tensor
    (per-tensor fp8 formats only)."""
    fmt = int(KV_FORMATS[kv_cache_dtype])
    rows, num_reqs = out.shape[0], cu_seq_lens.numel() - 1
    if rows == 0 or num_reqs <= 0:
        return
    per_tensor = fmt not in (_COPY.value, _DS_MLA.value)
    cache = kv_cache.view(_BITS_DTYPE[kv_cache.element_size()] if fmt == _COPY.value else torch.uint8)
    dst = out.view(_BITS_DTYPE[out.element_size()])
    has_ptr = isinstance(scale, torch.Tensor)
    d = out.shape[1]
    _gather_kernel[(triton.cdiv(rows, _BLOCK_T),)](
        dst,
        cache,
        block_table,
        cu_seq_lens,
        seq_starts if seq_starts is not None else cu_seq_lens,
        scale if has_ptr else cu_seq_lens,
        float(scale) if per_tensor and not has_ptr else 1.0,
        rows,
        num_reqs,
        out.stride(0),
        cache.shape[0],
        cache.shape[1],
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        block_table.shape[1],
        HAS_STARTS=seq_starts is not None,
        HAS_SCALE_PTR=has_ptr,
        FORMAT=fmt,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        SEARCH_STEPS=(num_reqs - 1).bit_length(),
        BLOCK_T=_BLOCK_T,
        DS_NOPE=DsMla.NOPE,
        DS_TILE=DsMla.TILE,
        DS_SCALE_AT=DsMla.SCALE_OFFSET,
        DS_ROPE_AT=DsMla.ROPE_OFFSET,
        DS_ROPE=DsMla.ROPE,
        num_warps=_WARPS,
    )
