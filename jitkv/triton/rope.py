"""Triton fallbacks of the rope family (docs/design.md §9), bit-exact with the torch reference.

One rotation kernel, one program per (token, head): it loads the head and, for the rotated dims, each
dim's partner (i +- rotary_dim / 2 for NeoX, i ^ 1 for GPT-J) as float32, norms both with the
fixed-order RMSNorm (squares folded by halves in groups of 8, then the group sums by halves, through
reshapes whose two-element sums are single additions; ``sqrt_rn`` and ``div_rn``: IEEE), rotates with
the token's cos/sin row, and stores into the destination: float32, bf16 (round to nearest even in
integer arithmetic, as the interpreter's own cast does not round), fp16, or fp8 by store_cache's
exact conversion. Launched with ``enable_fp_fusion=False``, so each product is rounded before the sum.
A position outside the table is clamped into it.

The queries are rotated straight into q (or q_out); K (or k_pe) is rotated into a scratch of n rows in
k's dtype ("auto", fp8_ds_mla) or float32 (the fp8 formats quantize the float32 result), which
store_cache's / set_mla_kv_buffer's Triton kernel then writes with V (or kv_c): two to four launches,
the fallback until the fused CUDA kernel lands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mla import set_mla_kv_buffer_triton
from .store_cache import _fp8_bits, _fp8_constants, store_cache_triton

# The rotation kernel's destination kinds.
_OUT_F32, _OUT_BF16, _OUT_F16, _OUT_FP8 = 0, 1, 2, 3
_OUT = {torch.float32: _OUT_F32, torch.bfloat16: _OUT_BF16, torch.float16: _OUT_F16}
_FP8_FORMAT = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_NO_FP8 = dict(MAX=0.0, MANT=3, BIAS=7, MIN_NORMAL_BITS=0, MAGIC=1.0, MAGIC_BITS=0)


@triton.jit
def _sum_of_squares(x, BLOCK_D: tl.constexpr, LOG2_GROUPS: tl.constexpr):
    """sum(x^2) over BLOCK_D lanes (a power of two >= 8; padding lanes 0) in docs/design.md §9's order."""
    GROUPS: tl.constexpr = BLOCK_D // 8
    s = tl.sum(tl.reshape(x * x, [GROUPS, 2, 4]), axis=1)  # s[j] + s[j + 4]
    s = tl.sum(tl.reshape(s, [GROUPS, 2, 2]), axis=1)  # then + [j + 2]
    g = tl.sum(s, axis=1)  # then [0] + [1]: one sum per group
    for _ in tl.static_range(LOG2_GROUPS):
        g = tl.sum(tl.reshape(g, [2, g.shape[0] // 2]), axis=0)  # g[j] + g[j + width / 2]
    return tl.sum(g, axis=0)


@triton.jit
def _bf16_bits(x):
    """float32 -> bf16 bits, round to nearest even (NaN stays NaN)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, (u >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


# Strides, the table's size and eps vary per call: no recompile per value.
@triton.jit(do_not_specialize=["s_tok", "s_head", "d_tok", "d_head", "cs_stride", "max_pos", "eps"])
def _rope_rows_kernel(
    src,
    dst,
    pos_ptr,
    cs_ptr,
    w_ptr,
    scale_ptr,
    s_tok,
    s_head,
    d_tok,
    d_head,
    cs_stride,
    max_pos,
    eps,
    D: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LOG2_GROUPS: tl.constexpr,
    NEOX: tl.constexpr,
    NORM: tl.constexpr,
    OUT: tl.constexpr,
    MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    MAGIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    in_head = d < D
    base = src + t * s_tok + h * s_head
    x = tl.load(base + d, mask=in_head, other=0.0).to(tl.float32)
    if ROT > 0:
        HALF: tl.constexpr = ROT // 2
        rotated = d < ROT
        if NEOX:
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            col = tl.where(d < HALF, d, d - HALF)
            lower = d < HALF
        else:
            partner = d ^ 1
            col = d // 2
            lower = (d % 2) == 0
        xp = tl.load(base + partner, mask=rotated, other=0.0).to(tl.float32)
    if NORM:
        total = _sum_of_squares(x, BLOCK_D, LOG2_GROUPS)
        mean = tl.math.div_rn(total, tl.full(total.shape, D, tl.float32))
        root = tl.sqrt_rn(mean + eps)
        r = tl.math.div_rn(tl.full(root.shape, 1.0, tl.float32), root)
        x = (x * r) * tl.load(w_ptr + d, mask=in_head, other=0.0).to(tl.float32)
        if ROT > 0:
            xp = (xp * r) * tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    if ROT > 0:
        p = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), max_pos - 1)
        row = cs_ptr + p * cs_stride
        c = tl.load(row + col, mask=rotated, other=0.0).to(tl.float32)
        s = tl.load(row + HALF + col, mask=rotated, other=0.0).to(tl.float32)
        xc = x * c
        ps = xp * s
        x = tl.where(rotated, tl.where(lower, xc - ps, xc + ps), x)
    out = dst + t * d_tok + h * d_head + d
    if OUT == 3:
        scale = tl.load(scale_ptr) + tl.zeros_like(x)
        tl.store(
            out, _fp8_bits(tl.math.div_rn(x, scale), MAX, MANT, BIAS, MIN_NORMAL_BITS, MAGIC, MAGIC_BITS), mask=in_head
        )
    elif OUT == 1:
        tl.store(out, _bf16_bits(x), mask=in_head)
    elif OUT == 2:
        tl.store(out, x.to(tl.float16), mask=in_head)
    else:
        tl.store(out, x, mask=in_head)


def _rows(t):
    """(tensor, token stride, head stride, heads) of a [n', H, W] or 2-D [n', W] (one head) tensor."""
    return (t, t.stride(0), t.stride(1), t.shape[1]) if t.dim() == 3 else (t, t.stride(0), 0, 1)


def _rotate(n, src, dst, positions, cos_sin_cache, *, rot, is_neox, weight=None, eps=0.0, scale=None):
    """dst[:n] = rope(norm(src[:n])) as docs/design.md §9 (rot 0: no rotation, the values converted or
    quantized); src, dst [n', H, W] or [n', W] views of the same width, scale a float32 tensor for an fp8
    dst."""
    src, s_tok, s_head, heads = _rows(src)
    width = src.shape[-1]
    out = _OUT.get(dst.dtype, _OUT_FP8)
    consts = _fp8_constants(_FP8_FORMAT[dst.dtype]) if out == _OUT_FP8 else dict(_NO_FP8)
    consts.pop("QUANT", None)
    store = {_OUT_BF16: torch.int16, _OUT_FP8: torch.uint8}.get(out, dst.dtype)
    dst, d_tok, d_head, _ = _rows(dst.view(store))
    block = max(8, triton.next_power_of_2(width))
    _rope_rows_kernel[(n, heads)](
        src,
        dst,
        positions,
        cos_sin_cache,
        weight if weight is not None else src,
        scale if scale is not None else src,
        s_tok,
        s_head,
        d_tok,
        d_head,
        cos_sin_cache.stride(0),
        cos_sin_cache.shape[0],
        eps,
        D=width,
        ROT=rot,
        BLOCK_D=block,
        LOG2_GROUPS=(block // 8).bit_length() - 1,
        NEOX=is_neox,
        NORM=weight is not None,
        OUT=out,
        num_warps=max(1, min(4, block // 128)),
        enable_fp_fusion=False,
        **consts,
    )


def _scale_tensor(scale, device):
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.full((1,), scale, dtype=torch.float32, device=device)


def rope_store_cache_triton(
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    is_neox,
    rotary_dim,
    q_norm_weight,
    k_norm_weight,
    eps,
    q_out,
    q_scale,
    k_out,
    kv_cache_dtype,
    k_scale,
    v_scale,
    loc_map,
    skip_slot,
) -> None:
    """The checked arguments of rope_store_cache, in its order (ops/rope.py ``check``): q [n', Hq, D],
    k [n', Hk, D], v [n', Hk, Dv], caches [num_blocks, block_size, Hk, D(v)], rotary_dim resolved."""
    n = slot_mapping.numel()
    if n == 0:
        return
    kw = dict(rot=rotary_dim, is_neox=is_neox, eps=eps)
    _rotate(
        n,
        q,
        q if q_out is None else q_out,
        positions,
        cos_sin_cache,
        weight=q_norm_weight,
        scale=_scale_tensor(q_scale, q.device),
        **kw,
    )
    scratch = torch.empty(
        n, *k.shape[1:], dtype=k.dtype if kv_cache_dtype == "auto" else torch.float32, device=k.device
    )
    _rotate(n, k, scratch, positions, cos_sin_cache, weight=k_norm_weight, **kw)
    if k_out is not None:
        _rotate(n, k, k_out, positions, cos_sin_cache, weight=k_norm_weight, **kw)
    # Float scales as device fills, not host copies: graph-capturable.
    store_cache_triton(
        scratch,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        kv_cache_dtype,
        _scale_tensor(k_scale, k.device),
        _scale_tensor(v_scale, k.device),
        loc_map,
        skip_slot,
    )


def rope_set_mla_kv_buffer_triton(
    kv_buffer,
    loc,
    kv_c,
    k_pe,
    positions,
    cos_sin_cache,
    is_neox,
    q_pe,
    q_nope,
    q_out,
    q_scale,
    k_pe_out,
    kv_cache_dtype,
    scale,
    skip_slot,
) -> None:
    """The checked arguments of rope_set_mla_kv_buffer, in its order (ops/rope.py ``check_mla``):
    kv_buffer [S, W], kv_c [n', nope], k_pe and k_pe_out [n', R], q_pe [n', H, R], q_nope [n', H, nope_q],
    q_out [n', H, nope_q + R]."""
    n = loc.numel()
    if n == 0:
        return
    r = k_pe.shape[-1]
    kw = dict(rot=r, is_neox=is_neox)
    if q_pe is not None and q_out is None:
        _rotate(n, q_pe, q_pe, positions, cos_sin_cache, **kw)
    elif q_pe is not None:
        q_scale = _scale_tensor(q_scale, q_pe.device)
        nope = q_nope.shape[-1]
        _rotate(n, q_nope, q_out[..., :nope], positions, cos_sin_cache, rot=0, is_neox=is_neox, scale=q_scale)
        _rotate(n, q_pe, q_out[..., nope:], positions, cos_sin_cache, scale=q_scale, **kw)
    rounded = kv_cache_dtype in ("auto", "fp8_ds_mla")
    scratch = torch.empty(n, r, dtype=k_pe.dtype if rounded else torch.float32, device=k_pe.device)
    _rotate(n, k_pe, scratch, positions, cos_sin_cache, **kw)
    if k_pe_out is not None:
        _rotate(n, k_pe, k_pe_out, positions, cos_sin_cache, **kw)
    set_mla_kv_buffer_triton(kv_buffer, loc, kv_c, scratch, kv_cache_dtype, scale, skip_slot)
