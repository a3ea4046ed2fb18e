"""Triton fallback of store_cache (same contract as the CUDA kernel, docs/design.md §3/§4).

One program per (token, block of heads): it reads the slot, skips padding (< 0), ``skip_slot``, slots
outside ``loc_map`` or mapped below 0, and slots >= num_slots, then moves a [heads, head_dim] tile of K
and of V with masked loads/stores, 64-bit offsets and runtime strides. "auto" copies bit patterns
(integer views); fp8 divides in fp32 (``div_rn``: a true division), clamps to +-max keeping NaN and
encodes round-to-nearest-even with integer arithmetic, so the bytes equal
``(x.float() / scale).clamp(-max, max).to(float8)`` on the GPU and under TRITON_INTERPRET=1 alike
(the interpreter's own fp8 cast does not round to nearest even). NaN keeps the sign the division gives
it, as torch does: 0x7F on GPUs (their division returns a positive NaN), 0x7F/0xFF on CPUs. Per-head
scales (PER_HEAD): head h divides by scale[h * stride] (stride 0: one scale for the side).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (max, mantissa bits, exponent bias, smallest normal exponent, smallest subnormal exponent)
_FP8 = {
    "fp8_e4m3": (448.0, 3, 7, -6, -9),
    "fp8_e5m2": (57344.0, 2, 15, -14, -16),
}
_COPY_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_TILE = 4096  # elements of one side per program


@triton.jit
def _fp8_bits(
    x,
    MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
):
    """fp32 -> fp8 byte: clamp to +-MAX (NaN stays NaN), round to nearest even."""
    x = tl.where(x > MAX, MAX, tl.where(x < -MAX, -MAX, x))
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Subnormal results: adding MAGIC (whose fp32 ulp is the fp8 subnormal step) rounds |x| to that
    # step with the hardware's round-to-nearest-even; the low bits then count steps.
    sub = (a.to(tl.float32, bitcast=True) + MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS
    # Normal results: rebias the exponent and round the mantissa to MANT bits, ties to even.
    SHIFT: tl.constexpr = 23 - MANT
    nrm = (a + ((BIAS - 127) << 23) + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT
    res = tl.where(a < MIN_NORMAL_BITS, sub, nrm)
    res = tl.where(a > 0x7F800000, 0x7F, res)
    return (res | sign).to(tl.uint8)


@triton.jit
def _store_side(
    src,
    dst,
    scale_ptr,
    scale_stride,
    token,
    slot,
    ok,
    h,
    H,
    D,
    s_tok,
    s_head,
    block_size,
    c_blk,
    c_tok,
    c_head,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    PER_HEAD: tl.constexpr,
    MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
):
    blk = slot // block_size
    dst_row = blk * c_blk + (slot - blk * block_size) * c_tok
    d = tl.arange(0, BLOCK_D)
    heads = tl.where(ok, H, 0)  # a skipped row masks every head (scalar bool masks trip the interpreter)
    mask = (h[:, None] < heads) & (d[None, :] < D)
    h64 = h.to(tl.int64)[:, None]
    x = tl.load(src + token * s_tok + h64 * s_head + d[None, :], mask=mask)
    if QUANT:
        if PER_HEAD:
            scale = tl.load(scale_ptr + h64 * scale_stride, mask=h[:, None] < H, other=1.0)
        else:
            scale = tl.load(scale_ptr)
        q = tl.math.div_rn(x.to(tl.float32), scale)
        x = _fp8_bits(q, MAX, MANT, BIAS, MIN_NORMAL_BITS, MAGIC, MAGIC_BITS)
    tl.store(dst + dst_row + h64 * c_head + d[None, :], x, mask=mask)


# Scalars that only bound masks or compare with slots: no recompile per value.
@triton.jit(
    do_not_specialize=[
        "loc_map_size",
        "skip_slot",
        "num_slots",
        "H",
        "kc_bs",
        "vc_bs",
        "k_scale_stride",
        "v_scale_stride",
    ]
)
def _store_cache_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slots,
    loc_map,
    k_scale,
    v_scale,
    k_scale_stride,
    v_scale_stride,
    loc_map_size,
    skip_slot,
    num_slots,
    H,
    DK,
    DV,
    k_s_tok,
    k_s_head,
    v_s_tok,
    v_s_head,
    kc_bs,
    vc_bs,
    kc_s_blk,
    kc_s_tok,
    kc_s_head,
    vc_s_blk,
    vc_s_tok,
    vc_s_head,
    HAS_LOC_MAP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
    PER_HEAD: tl.constexpr,
    MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + token).to(tl.int64)
    ok = (slot >= 0) & (slot != skip_slot)
    if HAS_LOC_MAP:
        ok = ok & (slot < loc_map_size)
        slot = tl.load(loc_map + slot, mask=ok, other=-1).to(tl.int64)
        ok = ok & (slot >= 0)
    ok = ok & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _store_side(
        k,
        k_cache,
        k_scale,
        k_scale_stride,
        token,
        slot,
        ok,
        h,
        H,
        DK,
        k_s_tok,
        k_s_head,
        kc_bs,
        kc_s_blk,
        kc_s_tok,
        kc_s_head,
        BLOCK_DK,
        QUANT,
        PER_HEAD,
        MAX,
        MANT,
        BIAS,
        MIN_NORMAL_BITS,
        MAGIC,
        MAGIC_BITS,
    )
    _store_side(
        v,
        v_cache,
        v_scale,
        v_scale_stride,
        token,
        slot,
        ok,
        h,
        H,
        DV,
        v_s_tok,
        v_s_head,
        vc_bs,
        vc_s_blk,
        vc_s_tok,
        vc_s_head,
        BLOCK_DV,
        QUANT,
        PER_HEAD,
        MAX,
        MANT,
        BIAS,
        MIN_NORMAL_BITS,
        MAGIC,
        MAGIC_BITS,
    )


def _fp8_constants(kv_dtype: str) -> dict:
    fmax, mant, bias, min_normal_exp, min_sub_exp = _FP8[kv_dtype]
    magic_exp = min_sub_exp + 23  # fp32 ulp of 2**magic_exp == the fp8 subnormal step
    return dict(
        QUANT=True,
        MAX=fmax,
        MANT=mant,
        BIAS=bias,
        MIN_NORMAL_BITS=(127 + min_normal_exp) << 23,
        MAGIC=float(2.0**magic_exp),
        MAGIC_BITS=(127 + magic_exp) << 23,
    )


_COPY_CONSTANTS = dict(QUANT=False, PER_HEAD=False, MAX=0.0, MANT=3, BIAS=7, MIN_NORMAL_BITS=0, MAGIC=1.0, MAGIC_BITS=0)


def store_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale,
    v_scale,
    loc_map: torch.Tensor | None,
    skip_slot: int | None,
) -> None:
    """The checked arguments of store_cache, in its order (ops/store_cache.py ``check``): k [n', H, DK],
    v [n', H, DV] (any token/head strides, last dim contiguous); k_cache [nb, bs, H, DK], v_cache [nb,
    bs, H, DV] views with arbitrary strides; slot_mapping and loc_map 1-D int32/int64; kv_cache_dtype
    "auto", "fp8"/"fp8_e4m3" or "fp8_e5m2"; fp8 scales floats or float32 tensors of 1 or H elements.
    Writes K and V rows of the first slot_mapping.numel() tokens."""
    k_scale, v_scale = (
        s if isinstance(s, torch.Tensor) or s is None else torch.tensor([s], dtype=torch.float32, device=k.device)
        for s in (k_scale, v_scale)
    )
    _store_cache(
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        loc_map,
        -1 if skip_slot is None else skip_slot,
        kv_cache_dtype,
        k_scale,
        v_scale,
    )


def _store_cache(k, v, k_cache, v_cache, slot_mapping, loc_map, skip_slot: int, kv_dtype: str, k_scale, v_scale):
    n = slot_mapping.numel()
    if n == 0:
        return
    if kv_dtype == "fp8":
        kv_dtype = "fp8_e4m3"
    if kv_dtype == "auto":
        view = _COPY_VIEW[k.element_size()]
        k, v, k_cache, v_cache = (t.view(view) for t in (k, v, k_cache, v_cache))
        consts, k_scale, v_scale = _COPY_CONSTANTS, slot_mapping, slot_mapping  # scales unused
        k_stride = v_stride = 0
    else:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_stride, v_stride = (s.stride(0) if s.numel() > 1 else 0 for s in (k_scale, v_scale))
        consts = dict(_fp8_constants(kv_dtype), PER_HEAD=bool(k_stride or v_stride))
    nb, bs, H, DK = k_cache.shape
    DV = v_cache.shape[3]
    block_dk, block_dv = triton.next_power_of_2(DK), triton.next_power_of_2(DV)
    block_h = max(1, min(triton.next_power_of_2(H), _MAX_TILE // max(block_dk, block_dv)))
    has_loc_map = loc_map is not None
    grid = (n, triton.cdiv(H, block_h))
    _store_cache_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        loc_map if has_loc_map else slot_mapping,
        k_scale,
        v_scale,
        k_stride,
        v_stride,
        loc_map.numel() if has_loc_map else 0,
        skip_slot,
        nb * bs,
        H,
        DK,
        DV,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        bs,
        v_cache.shape[1],
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HAS_LOC_MAP=has_loc_map,
        BLOCK_H=block_h,
        BLOCK_DK=block_dk,
        BLOCK_DV=block_dv,
        num_warps=4,
        **consts,
    )
