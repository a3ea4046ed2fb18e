"""Triton fallbacks of the DeepSeek-V3.2 indexer K cache ops (docs/design.md §5.1), bit-exact with the
CUDA kernels and the torch reference.

Writer: one program per BLOCK_T tokens; amax as an integer max of magnitude bits (NaN ignored), the
scale and x / scale as true fp32 divisions (``div_rn``), the e4m3 encoding in integer arithmetic
(``store_cache._fp8_bits``: round to nearest even, clamp to ±448, on the GPU and under TRITON_INTERPRET=1
alike), the scale's 4 bytes stored one by one. Gather: one program per BLOCK_T dst rows, a vectorized
binary search over cu_seq_lens, byte copies. Caches are flat uint8 views, so no alignment is assumed.
"""

import torch
import triton
import triton.language as tl

from ..codes import Indexer
from ..reference import indexer_scale_bytes
from .store_cache import _fp8_bits, _fp8_constants

_WRITE_BLOCK_T, _GATHER_BLOCK_T = 4, 16
_E4M3 = {name: v for name, v in _fp8_constants("fp8_e4m3").items() if name != "QUANT"}
_AMAX_MIN_BITS = int(torch.tensor(Indexer.AMAX_MIN, dtype=torch.float32).view(torch.int32))


@triton.jit
def _to_f32(h, F16: tl.constexpr):
    """bf16 / fp16 bits (int32 in [0, 65535]) -> fp32, exact."""
    if F16:
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return (h << 16).to(tl.float32, bitcast=True)


@triton.jit
def _write_kernel(
    k_ptr,
    k_stride,
    cache,
    slot_ptr,
    n,
    num_slots,
    block_size,
    block_stride,
    F16: tl.constexpr,
    UE8M0: tl.constexpr,
    HEAD: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    FP8_MAX: tl.constexpr,
    AMAX_MIN_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < n, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)  # skipped before the row is loaded
    blk = tl.where(ok, slot // block_size, 0)
    row = tl.where(ok, slot % block_size, 0)
    d = tl.arange(0, HEAD)
    ok2 = ok[:, None]
    bits = tl.load(k_ptr + t.to(tl.int64)[:, None] * k_stride + d[None, :], mask=ok2, other=0).to(tl.int32) & 0xFFFF
    mag = bits & 0x7FFF
    if F16:
        mag = tl.where(mag > 0x7C00, 0, mag)  # NaN ignored
    else:
        mag = tl.where(mag > 0x7F80, 0, mag)
    amax = _to_f32(tl.max(mag, axis=1), F16)
    floor = tl.maximum(amax.to(tl.int32, bitcast=True), AMAX_MIN_BITS).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(floor, tl.full(floor.shape, FP8_MAX, tl.float32))
    if UE8M0:  # up to a power of two: exponent + 1 when the mantissa is not zero (scale > 0, <= inf)
        scale = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    q = tl.math.div_rn(_to_f32(bits, F16), scale[:, None])
    base = blk * block_stride
    tl.store(
        cache + (base + row * HEAD)[:, None] + d[None, :],
        _fp8_bits(q, MAX, MANT, BIAS, MIN_NORMAL_BITS, MAGIC, MAGIC_BITS),
        mask=ok2,
    )
    c = tl.arange(0, SCALE_BYTES)
    scale_bytes = (scale.to(tl.int32, bitcast=True)[:, None] >> (8 * c)[None, :]) & 0xFF  # little-endian
    tl.store(
        cache + (base + block_size * HEAD + row * SCALE_BYTES)[:, None] + c[None, :], scale_bytes.to(tl.uint8), mask=ok2
    )


@triton.jit
def _gather_kernel(
    cache,
    dst_k,
    dst_k_stride,
    dst_scale,
    dst_scale_stride,
    block_table,
    bt_stride,
    cu,
    batch,
    max_blocks,
    num_tokens,
    num_blocks,
    block_size,
    block_stride,
    HEAD: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    # Row values stay 2-D [BLOCK_T, 1]: Triton 3.6 fails to lay out 1-D row values that later broadcast
    # against columns (RemoveLayoutConversions on their select).
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    live = t < num_tokens
    # The request of t: the last b with cu[b] <= t (lo ends at the first entry > t).
    lo = tl.zeros_like(t)
    hi = tl.zeros_like(t) + batch + 1
    start = tl.zeros_like(t)
    for _ in tl.static_range(SEARCH_STEPS):  # constexpr: Triton 3.6's interpreter refuses a runtime trip count
        active = live & (lo < hi)
        mid = (lo + hi) // 2
        c = tl.load(cu + mid, mask=active, other=0).to(tl.int64)
        le = active & (c <= t)
        start = tl.where(le, c, start)
        lo = tl.where(le, mid + 1, lo)
        hi = tl.where(active & (c > t), mid, hi)
    write = live & (lo >= 1) & (lo <= batch)
    b = tl.where(write, lo - 1, 0)
    i = t - start
    j = tl.where(write, i // block_size, 0)
    valid = write & (j < max_blocks)
    phys = tl.load(block_table + b * bt_stride + j, mask=valid, other=-1).to(tl.int64)
    valid = valid & (phys >= 0) & (phys < num_blocks)
    base = tl.where(valid, phys, 0) * block_stride
    pos = tl.where(valid, i - j * block_size, 0)
    d = tl.arange(0, HEAD)[None, :]
    data = tl.load(cache + base + pos * HEAD + d, mask=valid, other=0)
    tl.store(dst_k + t * dst_k_stride + d, data, mask=write)
    c = tl.arange(0, SCALE_BYTES)[None, :]
    scale = tl.load(cache + base + block_size * HEAD + pos * SCALE_BYTES + c, mask=valid, other=0)
    tl.store(dst_scale + t * dst_scale_stride + c, scale, mask=write)


def _flat_bytes(kv_cache, block_size):
    """The uint8 view from the cache's first byte to the end of the last block's used bytes."""
    span = (kv_cache.shape[0] - 1) * kv_cache.stride(0) + block_size * Indexer.TOKEN_BYTES
    return kv_cache.as_strided((span,), (1,))


def indexer_k_quant_and_cache_triton(k, kv_cache, slot_mapping, block_size, scale_fmt):
    """k bf16/fp16 [n', 128]; kv_cache uint8, 2-D or 3-D, of INDEXER_K_CACHE layout; slot_mapping [n];
    scale_fmt None or "ue8m0"."""
    ue8m0 = scale_fmt == "ue8m0"
    n = slot_mapping.numel()
    if n == 0 or kv_cache.shape[0] == 0:
        return
    _write_kernel[(triton.cdiv(n, _WRITE_BLOCK_T),)](
        k.view(torch.int16),
        k.stride(0),
        _flat_bytes(kv_cache, block_size),
        slot_mapping,
        n,
        kv_cache.shape[0] * block_size,
        block_size,
        kv_cache.stride(0),
        F16=k.dtype == torch.float16,
        UE8M0=ue8m0,
        HEAD=Indexer.HEAD_DIM,
        SCALE_BYTES=Indexer.SCALE_BYTES,
        FP8_MAX=Indexer.FP8_MAX,
        AMAX_MIN_BITS=_AMAX_MIN_BITS,
        BLOCK_T=_WRITE_BLOCK_T,
        num_warps=4,
        **_E4M3,
    )


def gather_indexer_k_quant_cache_triton(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size):
    """dst_k uint8 / e4m3 [T, 128]; dst_scale float32 [T] / [T, 1] or uint8 [T, 4]."""
    dst_k, dst_scale_bytes = dst_k.view(torch.uint8), indexer_scale_bytes(dst_scale)
    num_tokens, batch = dst_k.shape[0], block_table.shape[0]
    if num_tokens == 0 or batch == 0:
        return
    if kv_cache.shape[0] == 0:
        cache = torch.zeros(1, dtype=torch.uint8, device=dst_k.device)  # never read: every block is invalid
    else:
        cache = _flat_bytes(kv_cache, block_size)
    _gather_kernel[(triton.cdiv(num_tokens, _GATHER_BLOCK_T),)](
        cache,
        dst_k,
        dst_k.stride(0),
        dst_scale_bytes,
        dst_scale_bytes.stride(0),
        block_table,
        block_table.stride(0),
        cu_seq_lens,
        batch,
        block_table.shape[1],
        num_tokens,
        kv_cache.shape[0],
        block_size,
        kv_cache.stride(0),
        HEAD=Indexer.HEAD_DIM,
        SCALE_BYTES=Indexer.SCALE_BYTES,
        BLOCK_T=_GATHER_BLOCK_T,
        SEARCH_STEPS=(batch + 1).bit_length(),
        num_warps=4,
    )
