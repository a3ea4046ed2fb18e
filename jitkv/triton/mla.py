"""Triton fallbacks of set_mla_kv_buffer: kv_buffer[loc[i], :nope | nope:nope+rope] = k_nope[i] | k_rope[i],
copied or quantized to FP8.

One program per row with BLOCK = next_power_of_2(nope + rope) lanes: lanes below `nope` load from
k_nope, the next `rope` lanes from k_rope (masked loads, so a row whose nope/rope boundary falls
inside a vector, e.g. 528 + 128 bytes, needs no special case), and one masked store writes the row.
A slot < 0, == skip_slot or >= num_slots masks every load and store off. Strides are runtime values
and addresses are 64-bit. Data is copied as same-width integers (bitwise; float8 included).

FP8 (same program shape): values divided in fp32 with ``div_rn`` (a true division) and encoded by
store_cache's integer round-to-nearest-even (``_fp8_bits``), so the bytes equal torch's
``(x.float() / scale).clamp(-max, max).to(float8)`` on the GPU and under TRITON_INTERPRET=1 alike.
fp8_ds_mla: the nope values as [tiles, TILE], amax per tile with NaN left out, scale = max(amax / 448,
FLT_MIN), the scales' and the rope's bytes stored one byte at a time (any alignment).
"""

import torch
import triton
import triton.language as tl

from ..codes import DsMla
from .store_cache import _fp8_bits, _fp8_constants

# Same-width integer views: a bitwise copy, and Triton never sees float8 pointers.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _set_mla_kv_buffer_kernel(
    kv_ptr,
    loc_ptr,
    nope_ptr,
    rope_ptr,
    kv_stride,
    nope_stride,
    rope_stride,
    num_slots,
    skip_slot,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + row).to(tl.int64)
    keep = (slot >= 0) & (slot != skip_slot) & (slot < num_slots)
    # A skipped row gets an empty row end, so every load and store below is masked off.
    end = tl.where(keep, NOPE + ROPE, 0)
    offs = tl.arange(0, BLOCK)
    in_nope = offs < NOPE
    nope = tl.load(nope_ptr + row * nope_stride + offs, mask=offs < tl.minimum(end, NOPE))
    rope = tl.load(rope_ptr + row * rope_stride + (offs - NOPE), mask=(offs >= NOPE) & (offs < end))
    tl.store(kv_ptr + slot * kv_stride + offs, tl.where(in_nope, nope, rope), mask=offs < end)


def set_mla_kv_buffer_triton(
    kv_buffer, loc, cache_k_nope, cache_k_rope, kv_cache_dtype="auto", scale=None, skip_slot=None
):
    """The checked arguments of set_mla_kv_buffer, in its order (ops/mla.py ``check``): the copy, or the
    fp8 writer (a Python-float scale becomes a 1-element tensor on the buffer's device)."""
    skip = -1 if skip_slot is None else skip_slot
    if kv_cache_dtype == "auto":
        _copy(kv_buffer, loc, cache_k_nope, cache_k_rope, skip)
        return
    if scale is not None and not isinstance(scale, torch.Tensor):
        scale = torch.full((1,), scale, dtype=torch.float32, device=kv_buffer.device)
    _fp8(kv_buffer, loc, cache_k_nope, cache_k_rope, skip, kv_cache_dtype, scale)


def _copy(kv_buffer, loc, k_nope, k_rope, skip_slot):
    """Row scatter on already-validated views: kv_buffer [S, W], loc [n] int32/int64,
    k_nope [n', nope], k_rope [n', rope] (n' >= n, last dims contiguous, one dtype)."""
    n = loc.numel()
    if n == 0:
        return
    bits = _BITS_DTYPE[kv_buffer.element_size()]
    nope, rope = k_nope.shape[-1], k_rope.shape[-1]
    block = triton.next_power_of_2(nope + rope)
    _set_mla_kv_buffer_kernel[(n,)](
        kv_buffer.view(bits),
        loc,
        k_nope.view(bits),
        k_rope.view(bits),
        kv_buffer.stride(0),
        k_nope.stride(0),
        k_rope.stride(0),
        kv_buffer.shape[0],
        skip_slot,
        NOPE=nope,
        ROPE=rope,
        BLOCK=block,
        num_warps=max(1, min(8, block // 256)),
    )


@triton.jit
def _set_mla_kv_buffer_fp8_kernel(
    kv_ptr,
    loc_ptr,
    nope_ptr,
    rope_ptr,
    scale_ptr,
    kv_stride,
    nope_stride,
    rope_stride,
    num_slots,
    skip_slot,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
    MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + row).to(tl.int64)
    keep = (slot >= 0) & (slot != skip_slot) & (slot < num_slots)
    end = tl.where(keep, NOPE + ROPE, 0)
    offs = tl.arange(0, BLOCK)
    in_nope = offs < NOPE
    nope = tl.load(nope_ptr + row * nope_stride + offs, mask=offs < tl.minimum(end, NOPE), other=0.0)
    rope = tl.load(rope_ptr + row * rope_stride + (offs - NOPE), mask=(offs >= NOPE) & (offs < end), other=0.0)
    x = tl.where(in_nope, nope, rope).to(tl.float32)
    q = tl.math.div_rn(x, tl.load(scale_ptr) + tl.zeros_like(x))
    bits = _fp8_bits(q, MAX, MANT, BIAS, MIN_NORMAL_BITS, MAGIC, MAGIC_BITS)
    tl.store(kv_ptr + slot * kv_stride + offs, bits, mask=offs < end)


@triton.jit
def _set_mla_kv_buffer_ds_mla_kernel(
    kv_ptr,
    loc_ptr,
    nope_ptr,
    rope_ptr,
    kv_stride,
    nope_stride,
    rope_stride,
    num_slots,
    skip_slot,
    TILES: tl.constexpr,
    TILE: tl.constexpr,
    SCALES: tl.constexpr,
    ROPE_AT: tl.constexpr,
    ROPE_BYTES: tl.constexpr,
    QUANT: tl.constexpr,
    MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + row).to(tl.int64)
    keep = (slot >= 0) & (slot != skip_slot) & (slot < num_slots)
    dst = kv_ptr + tl.where(keep, slot, 0) * kv_stride
    # A skipped row gets empty bounds, so every load and store below is masked off.
    tiles = tl.where(keep, TILES, 0)
    t = tl.arange(0, TILES)[:, None]
    e = tl.arange(0, TILE)[None, :]
    cols = t * TILE + e
    x = tl.load(nope_ptr + row * nope_stride + cols, mask=t < tiles, other=0.0).to(tl.float32)
    amax = tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.1754943508222875e-38)
    q = _fp8_bits(
        tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x)), MAX, MANT, BIAS, MIN_NORMAL_BITS, MAGIC, MAGIC_BITS
    )
    tl.store(dst + cols, q, mask=t < tiles)
    k = tl.arange(0, 4)[None, :]
    scale_bytes = (scale.to(tl.int32, bitcast=True)[:, None] >> (8 * k)) & 0xFF  # little-endian float32
    tl.store(dst + SCALES + 4 * t + k, scale_bytes.to(tl.uint8), mask=t < tiles)
    b = tl.arange(0, ROPE_BYTES)
    rope_end = tl.where(keep, ROPE_BYTES, 0)
    rope = tl.load(rope_ptr + row * rope_stride + b, mask=b < rope_end)
    tl.store(dst + ROPE_AT + b, rope, mask=b < rope_end)


def _fp8(kv_buffer, loc, k_nope, k_rope, skip_slot, kv_cache_dtype, scale):
    """Quantizing row scatter on already-validated views: kv_buffer [S, W] 1-byte, loc [n] int32/int64,
    k_nope [n', nope] and k_rope [n', rope] bf16/fp16 (n' >= n, last dims contiguous); kv_cache_dtype
    "fp8"/"fp8_e4m3"/"fp8_e5m2" with ``scale`` a 1-element float32 tensor, or "fp8_ds_mla" (nope 512, rope
    64, scale None)."""
    n = loc.numel()
    if n == 0:
        return
    kv = kv_buffer.view(torch.uint8)
    if kv_cache_dtype == "fp8_ds_mla":
        rope_bytes = k_rope.view(torch.uint8)  # the rope values' 16-bit patterns, copied
        _set_mla_kv_buffer_ds_mla_kernel[(n,)](
            kv,
            loc,
            k_nope,
            rope_bytes,
            kv.stride(0),
            k_nope.stride(0),
            rope_bytes.stride(0),
            kv.shape[0],
            skip_slot,
            TILES=DsMla.TILES,
            TILE=DsMla.TILE,
            SCALES=DsMla.SCALE_OFFSET,
            ROPE_AT=DsMla.ROPE_OFFSET,
            ROPE_BYTES=DsMla.BYTES - DsMla.ROPE_OFFSET,
            num_warps=4,
            **_fp8_constants("fp8_e4m3"),
        )
        return
    nope, rope = k_nope.shape[-1], k_rope.shape[-1]
    block = triton.next_power_of_2(nope + rope)
    _set_mla_kv_buffer_fp8_kernel[(n,)](
        kv,
        loc,
        k_nope,
        k_rope,
        scale,
        kv.stride(0),
        k_nope.stride(0),
        k_rope.stride(0),
        kv.shape[0],
        skip_slot,
        NOPE=nope,
        ROPE=rope,
        BLOCK=block,
        num_warps=max(1, min(8, block // 256)),
        **_fp8_constants("fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype),
    )
