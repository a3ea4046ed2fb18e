"""Triton fallbacks of the DeepSeek-V4 FP8 K cache ops (docs/design.md §5), bit-exact with the CUDA kernels.

The fp8 and bf16 conversions are done in integer arithmetic on the raw bits (round to nearest even,
saturating e4m3 at ±448), so the result does not depend on the GPU's fp8 support or on the interpreter.
Writer: one program per BLOCK_T tokens, one 64-dim group at a time. Gather: one program per
(request, BLOCK_T positions). The cache is the uint8 [num_blocks, block_stride] view; no autotuning.
"""

import torch
import triton
import triton.language as tl

from ..codes import Dsv4

# The record (jitkv/codes.py) as the kernels' constexpr arguments: e4m3 dims, bf16 dims, scale
# groups, bytes of data and of scales per token.
_RECORD = {
    "NOPE": Dsv4.NOPE,
    "ROPE": Dsv4.ROPE,
    "GROUP": Dsv4.GROUP,
    "GROUPS": Dsv4.NOPE // Dsv4.GROUP,
    "DATA_BYTES": Dsv4.DATA_BYTES,
    "SCALE_BYTES": Dsv4.SCALE_BYTES,
}
_WRITE_BLOCK_T, _WRITE_WARPS = 8, 4
_GATHER_BLOCK_T, _GATHER_WARPS = 16, 4


@triton.jit
def _e4m3_encode(y_bits):
    """fp32 bits -> e4m3fn byte: RNE, |y| saturated to 448 (NaN handled by the caller)."""
    a = tl.minimum(y_bits & 0x7FFFFFFF, 0x43E00000)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    ea = a >> 23
    m = (a & 0x7FFFFF) | tl.where(ea > 0, 0x800000, 0)
    s = tl.minimum(141 - tl.maximum(ea, 1), 31)
    denormal = (m + (1 << (s - 1)) - 1 + ((m >> s) & 1)) >> s
    return tl.where(a >= 0x3C800000, normal, denormal) | ((y_bits >> 24) & 0x80)


@triton.jit
def _e4m3_decode(b):
    """e4m3fn byte (int32) -> fp32."""
    e = (b >> 3) & 15
    m = b & 7
    sign = (b & 0x80) << 24
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    denormal = m.to(tl.float32) * 0.001953125
    denormal = (denormal.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, denormal, normal)
    nan = (v.to(tl.int32, bitcast=True) | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, nan, v)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bits (int32 in [0, 65535]): RNE, NaN -> 0x7FFF."""
    u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)
    return tl.where(x != x, 0x7FFF, r)


@triton.jit
def _quant_insert_kernel(
    k_ptr,
    k_stride,
    cache_u8,
    cache_i16,
    slot_ptr,
    n,
    num_slots,
    block_size,
    block_stride,
    BLOCK_T: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < n, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)  # skipped before the row is loaded
    blk = tl.where(ok, slot // block_size, 0)
    row = tl.where(ok, slot % block_size, 0)
    base = blk * block_stride
    data = base + row * DATA_BYTES
    scale_at = base + block_size * DATA_BYTES + row * SCALE_BYTES
    src = t.to(tl.int64) * k_stride
    d = tl.arange(0, GROUP)
    dr = tl.arange(0, ROPE)
    ok2 = ok[:, None]
    for g in tl.static_range(GROUPS):
        x = tl.load(k_ptr + src[:, None] + (g * GROUP + d)[None, :], mask=ok2, other=0).to(tl.int32) & 0xFFFF
        mag = x & 0x7FFF
        amax = tl.max(mag, axis=1)  # integer max: NaN > inf > finite
        mb = tl.maximum(amax << 16, 0x38D1B717)  # max(amax, 1e-4) as float bits
        be = mb >> 23
        e = be - 135 + ((mb & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.where(be == 255, 128, e)
        inv = tl.where(e == 128, 0x00200000, (127 - e) << 23).to(tl.float32, bitcast=True)
        y = (x << 16).to(tl.float32, bitcast=True) * inv[:, None]
        q = _e4m3_encode(y.to(tl.int32, bitcast=True))
        q = tl.where(mag > 0x7F80, 0x7F | ((x >> 8) & 0x80), q)  # NaN keeps its sign
        tl.store(cache_u8 + data[:, None] + (g * GROUP + d)[None, :], q.to(tl.uint8), mask=ok2)
        tl.store(cache_u8 + scale_at + g, (e + 127).to(tl.uint8), mask=ok)
    tl.store(cache_u8 + scale_at + GROUPS, tl.zeros_like(row).to(tl.uint8), mask=ok)
    rope = tl.load(k_ptr + src[:, None] + (NOPE + dr)[None, :], mask=ok2, other=0)
    tl.store(cache_i16 + (data // 2 + NOPE // 2)[:, None] + dr[None, :], rope, mask=ok2)


@triton.jit
def _gather_kernel(
    out_ptr,
    out_s0,
    out_s1,
    n_rows,
    offset,
    cache_u8,
    cache_i16,
    block_stride,
    num_blocks,
    seq_ptr,
    gl_ptr,
    bt_ptr,
    bt_stride,
    max_blocks,
    block_size,
    HAS_GL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    r = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    seq = tl.load(seq_ptr + r).to(tl.int64)
    if HAS_GL:
        gl = tl.load(gl_ptr + r).to(tl.int64)
    else:
        gl = seq
    write = (i < gl) & (i < n_rows)
    pos = seq - gl + i
    blk = tl.where(pos >= 0, pos // block_size, 0)
    valid = write & (pos >= 0) & (blk < max_blocks)
    phys = tl.load(bt_ptr + r.to(tl.int64) * bt_stride + blk, mask=valid, other=-1).to(tl.int64)
    valid = valid & (phys >= 0) & (phys < num_blocks)
    row = tl.where(valid, pos - blk * block_size, 0)
    base = tl.where(valid, phys, 0) * block_stride
    data = base + row * DATA_BYTES
    scale_at = base + block_size * DATA_BYTES + row * SCALE_BYTES
    dst = r.to(tl.int64) * out_s0 + (offset + i.to(tl.int64)) * out_s1
    d = tl.arange(0, GROUP)
    dr = tl.arange(0, ROPE)
    v2, w2 = valid[:, None], write[:, None]
    for g in tl.static_range(GROUPS):
        q = tl.load(cache_u8 + data[:, None] + (g * GROUP + d)[None, :], mask=v2, other=0).to(tl.int32)
        sb = tl.load(cache_u8 + scale_at + g, mask=valid, other=0).to(tl.int32)
        scale = tl.where(sb == 0, 0x00400000, sb << 23).to(tl.float32, bitcast=True)
        val = _bf16_bits(_e4m3_decode(q) * scale[:, None])
        tl.store(out_ptr + dst[:, None] + (g * GROUP + d)[None, :], val.to(tl.int16), mask=w2)
    rope = tl.load(cache_i16 + (data // 2 + NOPE // 2)[:, None] + dr[None, :], mask=v2, other=0)
    tl.store(out_ptr + dst[:, None] + (NOPE + dr)[None, :], rope, mask=w2)


def _cache_views(k_cache):
    """uint8 and int16 views of the cache as [num_blocks, block_stride] (a 3-D view of one included)."""
    if k_cache.dim() == 3:
        stride = k_cache.stride(0)
        k_cache = k_cache.as_strided((k_cache.shape[0], stride), (stride, 1))
    return k_cache, k_cache.view(torch.int16)


def quantize_and_insert_k_cache_triton(k, k_cache, slot_mapping, block_size):
    """k bf16 [n', 512]; k_cache uint8 of DSV4_K_CACHE layout; slot_mapping int32/int64 [n]."""
    n = slot_mapping.numel()
    if n == 0:
        return
    cache_u8, cache_i16 = _cache_views(k_cache)
    grid = (triton.cdiv(n, _WRITE_BLOCK_T),)
    _quant_insert_kernel[grid](
        k.view(torch.int16),
        k.stride(0),
        cache_u8,
        cache_i16,
        slot_mapping.reshape(-1),
        n,
        cache_u8.shape[0] * block_size,
        block_size,
        cache_u8.stride(0),
        BLOCK_T=_WRITE_BLOCK_T,
        num_warps=_WRITE_WARPS,
        **_RECORD,
    )


def dequantize_and_gather_k_cache_triton(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset=0):
    """out bf16 [R, M, 512]; rows offset + i for the last gather_lens[r] (None: seq_lens[r]) tokens."""
    num_reqs, n_rows = out.shape[0], out.shape[1] - offset
    if num_reqs == 0 or n_rows <= 0:
        return
    cache_u8, cache_i16 = _cache_views(k_cache)
    grid = (num_reqs, triton.cdiv(n_rows, _GATHER_BLOCK_T))
    has_gl = gather_lens is not None
    _gather_kernel[grid](
        out.view(torch.int16),
        out.stride(0),
        out.stride(1),
        n_rows,
        offset,
        cache_u8,
        cache_i16,
        cache_u8.stride(0),
        cache_u8.shape[0],
        seq_lens,
        gather_lens if has_gl else seq_lens,
        block_table,
        block_table.stride(0),
        block_table.shape[1],
        block_size,
        HAS_GL=has_gl,
        BLOCK_T=_GATHER_BLOCK_T,
        num_warps=_GATHER_WARPS,
        **_RECORD,
    )
