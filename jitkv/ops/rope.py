"""rope: the attention prologue in one op: RoPE on q and k (optionally after a per-head RMSNorm), FP8
quantization, and the K/V (or MLA row) cache write (docs/design.md §2, §3, §4, §9)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import checks, reference
from ..codes import FP8_MAX, KV_FORMATS, NO_SLOT, SRC_DTYPES, DsMla, KvFormat, RopeNorm, RopeQ, SrcDtype
from ..jit import JitSpec, cuda_arch
from ._op import BackendUnavailable, Op, jit_function, scale_args
from ._samples import rand, slots
from .mla import check_rows, row_view, set_mla_kv_buffer
from .store_cache import check_kv, store_cache

__all__ = ["rope_set_mla_kv_buffer", "rope_store_cache"]

OP = "rope_store_cache"
MLA_OP = "rope_set_mla_kv_buffer"
TABLE_ENTRY = "rope_store_cache_table"  # a page-table build's only entry point (paged_runner)
MLA_TABLE_ENTRY = "rope_set_mla_kv_buffer_table"  # the same for rope_set_mla_kv_buffer (mla_paged_runner)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NORM_GROUP = 8  # the fixed-order RMSNorm sums squares in groups of 8 dims (docs/design.md §9)


def rope_store_cache(
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    *,
    is_neox,
    rotary_dim=None,
    q_norm_weight=None,
    k_norm_weight=None,
    eps=1e-6,
    q_out=None,
    q_scale=None,
    k_out=None,
    kv_cache_dtype="auto",
    k_scale=None,
    v_scale=None,
    loc_map=None,
    skip_slot=None,
    backend=None,
):
    """RoPE on q and k (after a per-head RMSNorm when weights are given), and K/V written into their
    caches as ``store_cache`` writes them: the MHA/GQA attention prologue in one call.

    For each of the first n = ``slot_mapping.numel()`` tokens t, at position p = ``positions[t]``,
    every head x of q and of k becomes (docs/design.md §9, all in float32)::

        y = x                                   (no norm weight)
        y = (x * r) * w,  r = 1 / sqrt(mean(x^2) + eps)   (q_norm_weight / k_norm_weight w, Qwen3's QK-norm)
        NeoX (h = rotary_dim / 2):  out[i] = y[i] c[i] - y[i+h] s[i],   out[i+h] = y[i+h] c[i] + y[i] s[i]
        GPT-J:                      out[2i] = y[2i] c[i] - y[2i+1] s[i], out[2i+1] = y[2i+1] c[i] + y[2i] s[i]
        out[d] = y[d] for d >= rotary_dim   (partial rotary)

    with c[i] = cos_sin_cache[p, i], s[i] = cos_sin_cache[p, rotary_dim/2 + i]; each product rounded
    before the sum (no fused multiply-add), the squares summed in a fixed order, so every backend writes
    the same bytes. Rotated q goes back into q (or into ``q_out``), rotated k into k_cache (and
    ``k_out``), v into v_cache, each rounded once to its destination's dtype (bf16/fp16 round to nearest
    even) or quantized from the float32 result (fp8: RNE(clamp(out / scale, ±max))).

    Args:
        q: ``[n', Hq, D]`` or ``[n', Hq*D]``; k ``[n', Hk, D]`` or ``[n', Hk*D]``; v ``[n', Hk, Dv]`` or
            ``[n', Hk*Dv]``; n' >= n (extra rows never read or written). bf16, fp16 or fp32, one dtype.
            Any token and head strides (views of a packed qkv tensor), last dim contiguous. At least one
            of q, k or k_cache must have a head dim.
        k_cache, v_cache: as ``store_cache``: flat ``[num_slots, Hk, D]`` / ``[num_slots, Hk*D]``, or
            paged ``[num_blocks, block_size, Hk, D]`` (HND as the permuted view); written in place.
        slot_mapping: ``[n]`` int32/int64. The KV-write contract (docs/design.md §3): slot < 0 or
            == ``skip_slot`` is padding (its K/V are not written; its q and k_out are), ``loc_map``
            translates slots first.
        positions: ``[>= n]`` int32/int64, the token positions (rows of cos_sin_cache).
        cos_sin_cache: ``[max_pos, rotary_dim]``, cos half then sin half; float32 or q's dtype; any
            row stride, last dim contiguous.
        is_neox: True for NeoX halves (Llama, Qwen), False for GPT-J pairs (interleaved).
        rotary_dim: even, <= D; None: ``cos_sin_cache.shape[1]``. Dims >= rotary_dim pass through.
        q_norm_weight, k_norm_weight: ``[D]`` in q's dtype or float32: per-head RMSNorm before RoPE
            (Qwen3), with ``eps``; D must then be a multiple of 8. None: no norm.
        q_out: None (q rotated in place), or ``[n', Hq, D]`` (``[n', Hq*D]`` too) in q's dtype, or
            float8_e4m3fn / float8_e5m2 with ``q_scale`` (fp8 attention); q is then never written.
        q_scale: an fp8 q_out's scale: a finite float > 0 or a 1-element float32 tensor (read on the
            device).
        k_out: optional ``[n', Hk, D]`` (or ``[n', Hk*D]``) in k's dtype, may be k itself: also receives
            rotated k. k is not written otherwise.
        kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot: as ``store_cache`` (per-tensor or
            per-head scales).
        backend: "jit", "triton", "torch" or None (auto; also ``JITKV_BACKEND``).

    Raises:
        TypeError: a wrong dtype (q, k, v, the caches, cos_sin_cache, a norm weight, q_out, k_out), a
        non-tensor argument, is_neox not a bool, rotary_dim / skip_slot not an int, eps or a scale not
        a number. ValueError: shapes or devices that disagree (head dims of q, k, v and the caches, a
        cos_sin_cache that is not ``[max_pos, rotary_dim]``, a norm weight that is not ``[D]``, a q_out
        or k_out of the wrong shape), rotary_dim odd or > D, a norm weight with D not a multiple of 8,
        an fp8 q_out without q_scale (or a q_scale without one), destinations that share memory, and
        store_cache's errors. IndexError: a position outside [0, max_pos) or a slot out of range: CPU
        always, CUDA under JITKV_DEBUG=1 (otherwise CUDA clamps the position into the table and skips
        the slot); nothing is written then.

    Algorithm: torch's composition is RoPE (and QK-norm) in one or two kernels, then store_cache; here
    one pass per token: CPU (C++) checks every position and slot serially first, then per token and
    head loads a head into float32 (AVX-512 or AVX2), norms it in the fixed order, rotates it with the
    token's cos/sin row, and stores q (or q_out), k_out and the cache row in one go; OpenMP above a
    payload threshold, cache rows by streaming stores where store_cache would stream them. CUDA (JIT):
    one launch, a thread per 16 source bytes of a head, the head's lanes one shuffle group
    (docs/design.md §9); Triton (one program per token and head) as its fallback. The RMSNorm of Qwen3
    (HF Qwen3RMSNorm) and the RoPE of Llama / GPT-NeoX / GPT-J (HF apply_rotary_pos_emb), vLLM's and
    sglang's cos_sin_cache layout.
    """
    ROPE_STORE_CACHE.run(
        (
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
        ),
        backend,
    )


def rope_set_mla_kv_buffer(
    kv_buffer,
    loc,
    kv_c,
    k_pe,
    positions,
    cos_sin_cache,
    *,
    is_neox,
    q_pe=None,
    q_nope=None,
    q_out=None,
    q_scale=None,
    k_pe_out=None,
    kv_cache_dtype="auto",
    scale=None,
    skip_slot=None,
    backend=None,
):
    """RoPE on MLA's shared key k_pe (and the queries' q_pe), and the row ``[kv_c | rope(k_pe)]`` written
    as ``set_mla_kv_buffer`` writes it: the MLA attention prologue in one call.

    For each of the first n = ``loc.numel()`` tokens, at ``positions[t]``: rope(x) as
    ``rope_store_cache`` (no norm, rotary_dim = k_pe's width R, float32, products rounded before the
    sum), then ``kv_buffer[loc[t]] = [kv_c[t] | rope(k_pe[t])]`` in ``kv_cache_dtype``'s format; q_pe
    rotated in place, or ``q_out[t] = [q_nope[t] | rope(q_pe[t])]``.

    Args:
        kv_buffer, loc, kv_cache_dtype, scale, skip_slot: as ``set_mla_kv_buffer`` ("auto": one float
            dtype everywhere, bf16/fp16/fp32; "fp8"/"fp8_e4m3"/"fp8_e5m2" from bf16/fp16 with
            ``scale``, rope(k_pe) quantized from float32; "fp8_ds_mla": 512 + 64, the record of kv_c and
            rope(k_pe) rounded to k_pe's dtype). Padding rows (loc < 0, == skip_slot) are not written.
        kv_c: ``[n', nope]`` (or ``[n', 1, nope]``), any row stride, last dim contiguous.
        k_pe: ``[n', R]`` (or ``[n', 1, R]``), R even, kv_c's dtype.
        positions: ``[>= n]`` int32/int64.
        cos_sin_cache: ``[max_pos, R]``, cos half then sin half; float32 or k_pe's dtype.
        is_neox: NeoX halves (True) or GPT-J pairs (False; DeepSeek's interleaved rope).
        q_pe: optional ``[n', H, R]`` in k_pe's dtype, rotated in place (every row < n) unless q_out.
        q_nope: ``[n', H, nope_q]``, required with q_out (and only then).
        q_out: optional ``[n', H, nope_q + R]``: ``[q_nope | rope(q_pe)]`` in q_pe's dtype, or
            float8_e4m3fn / float8_e5m2 with ``q_scale`` (both parts quantized, q_nope from its values);
            q_pe is then not written.
        q_scale: an fp8 q_out's scale (float or 1-element float32 tensor).
        k_pe_out: optional ``[n', R]`` (or ``[n', 1, R]``) in k_pe's dtype, may be k_pe itself: receives
            rope(k_pe) for every row < n.
        backend: "jit", "triton", "torch" or None.

    Raises:
        TypeError / ValueError naming the argument as ``set_mla_kv_buffer`` and ``rope_store_cache``
        (a cos_sin_cache not ``[max_pos, R]``, R odd, q_out without q_pe and q_nope, q_nope without
        q_out, head counts or widths that disagree, an fp8 q_out without q_scale). IndexError: a
        position outside [0, max_pos) or a loc out of range (CPU; CUDA under JITKV_DEBUG=1), before
        anything is written.

    Algorithm: one pass per token, as ``rope_store_cache``: the row's kv_c copied or quantized, k_pe
    rotated in float32 and stored (fp8_ds_mla: the record of set_mla_kv_buffer), the query heads
    rotated (and q_nope copied or quantized) into q_out. DeepSeek's MLA (vLLM's
    concat_and_cache_mla_rope_fused, FlashInfer's rope_quantize_fp8_append_paged_kv_cache).
    """
    ROPE_SET_MLA_KV_BUFFER.run(
        (
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
        ),
        backend,
    )


# ---------------------------------------------------------------------------------------- checks


def check(
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
):
    """The arguments as the reference, Triton and the CPU binding take them: q, q_out ``[n', Hq, D]``,
    k, k_out ``[n', Hk, D]``, v ``[n', Hk, Dv]``, caches ``[num_blocks, block_size, Hk, D]``, rotary_dim
    resolved, eps a float, parsed scales (None where unused)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        checks.tensor(OP, name, t)
    for name, t in (
        ("q_norm_weight", q_norm_weight),
        ("k_norm_weight", k_norm_weight),
        ("q_out", q_out),
        ("k_out", k_out),
    ):
        checks.optional_tensor(OP, name, t)
    _flag(OP, "is_neox", is_neox)
    eps = _eps(OP, eps)
    checks.tensor(OP, "k_cache", k_cache)
    dev = k_cache.device
    checks.dtype(OP, "q", q, FLOAT_DTYPES)
    checks.same_dtype(OP, "k", k, q.dtype, "q")
    d = _head_dim(q, k, k_cache)
    q3, k3 = _heads(OP, "q", q, d), _heads(OP, "k", k, d)
    v3 = _heads(OP, "v", v, _v_head_dim(v, k3.shape[1]))
    kv = check_kv(OP, k3, v3, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot)
    k3, v3, kc, vc, _, _, k_scale, v_scale, _, _ = kv
    n = slot_mapping.numel()
    for name, t in (("q", q3), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        checks.same_device(OP, name, t, dev, "k_cache")
    checks.rows_at_least(OP, "q", q3, n, "slot_mapping")
    checks.last_dim_contiguous(OP, "q", q3)
    rot = _rotary(OP, rotary_dim, cos_sin_cache, d, q.dtype)
    _positions(OP, positions, n, dev, "k_cache")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        _norm_weight(name, w, d, q.dtype, dev)
    q_out, q_scale = _q_out(OP, q_out, q_scale, list(q3.shape[1:]), q.dtype, n, dev, "k_cache")
    k_out = _k_out(k_out, k3, n, dev)
    for name, t in (("q_out", q_out), ("k_out", k_out)):
        for cache_name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t is not None:
                checks.disjoint(OP, name, t, cache_name, cache)
    if q_out is None:
        checks.written(OP, "q", q3)
    return (
        q3,
        k3,
        v3,
        kc,
        vc,
        slot_mapping,
        positions,
        cos_sin_cache,
        is_neox,
        rot,
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
    )


def _flag(op, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name}: expected a bool, got {type(value).__name__}")


def _eps(op, eps):
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"{op}: eps: expected a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps: expected a finite float >= 0, got {eps!r}")
    return float(eps)


def _head_dim(q, k, k_cache):
    """D from the first of q, k (3-D) and k_cache (3-D flat or 4-D paged) that has a head dim."""
    for t, dims in ((q, (3,)), (k, (3,)), (k_cache, (3, 4))):
        if t.dim() in dims:
            return t.shape[-1]
    raise ValueError(
        f"{OP}: q: cannot tell the head dim from [tokens, heads * head_dim] q, k and k_cache; pass q "
        f"or k as [tokens, heads, head_dim], got shape {list(q.shape)}"
    )


def _v_head_dim(v, heads):
    if v.dim() == 3 or v.dim() != 2 or v.shape[1] % heads:
        return v.shape[-1]  # a 3-D v, or one the shape checks refuse
    return v.shape[1] // heads


def _heads(op, name, t, d):
    """[n', H, D] view of a [n', H, D] or [n', H*D] tensor with head dim d."""
    if t.dim() == 3:
        if t.shape[2] != d:
            raise ValueError(f"{op}: {name}: expected head_dim {d}, got shape {list(t.shape)}")
        return t
    if t.dim() != 2 or d == 0 or t.shape[1] % d:
        raise ValueError(
            f"{op}: {name}: expected shape [tokens, heads, {d}] or [tokens, heads * {d}], got {list(t.shape)}"
        )
    checks.last_dim_contiguous(op, name, t)
    return t.view(t.shape[0], t.shape[1] // d, d)


def _rotary(op, rotary_dim, cos_sin_cache, width, src_dtype):
    """rotary_dim resolved (even, <= width) and cos_sin_cache checked against it."""
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"{op}: cos_sin_cache: expected shape [max_pos, rotary_dim], got {list(cos_sin_cache.shape)}")
    rot = cos_sin_cache.shape[1] if rotary_dim is None else checks.integer(op, "rotary_dim", rotary_dim)
    if rot <= 0 or rot % 2 or rot > width:
        raise ValueError(f"{op}: rotary_dim: expected an even number in [2, {width}] (head_dim), got {rot}")
    if cos_sin_cache.shape[1] != rot:
        raise ValueError(
            f"{op}: cos_sin_cache: expected [max_pos, rotary_dim] = [max_pos, {rot}] (cos half then sin "
            f"half), got {list(cos_sin_cache.shape)}"
        )
    checks.dtype(op, "cos_sin_cache", cos_sin_cache, tuple(dict.fromkeys((torch.float32, src_dtype))))
    checks.last_dim_contiguous(op, "cos_sin_cache", cos_sin_cache)
    return rot


def _positions(op, positions, n, dev, dest_name):
    checks.index(op, "positions", positions, dev, dest_name)
    if positions.numel() < n:
        raise ValueError(f"{op}: positions: expected at least {n} entries (one per token), got {positions.numel()}")


def _norm_weight(name, w, d, src_dtype, dev):
    if w is None:
        return
    checks.dtype(OP, name, w, tuple(dict.fromkeys((src_dtype, torch.float32))))
    if w.dim() != 1 or w.shape[0] != d:
        raise ValueError(f"{OP}: {name}: expected shape [head_dim] = [{d}], got {list(w.shape)}")
    if d % NORM_GROUP:
        raise ValueError(
            f"{OP}: {name}: the fixed-order RMSNorm sums groups of {NORM_GROUP} dims; head_dim {d} is not "
            f"a multiple of {NORM_GROUP}"
        )
    checks.last_dim_contiguous(OP, name, w)
    checks.same_device(OP, name, w, dev, "k_cache")


def _q_out(op, q_out, q_scale, want, dtype, n, dev, dest_name, q_name="q"):
    """(q_out as [n', H, W] or None, q_scale parsed); want = [H, W], dtype the queries'."""
    if q_out is None:
        if q_scale is not None:
            raise ValueError(f"{op}: q_scale: only an fp8 q_out takes a scale; q_out is None")
        return None, None
    allowed = tuple(dict.fromkeys((dtype, torch.float8_e4m3fn, torch.float8_e5m2)))
    checks.dtype(op, "q_out", q_out, allowed, f" ({q_name}'s dtype, or fp8 with q_scale)")
    q_out3 = q_out if q_out.dim() != 2 or q_out.shape[1] != want[0] * want[1] else q_out.view(q_out.shape[0], *want)
    if q_out3.dim() != 3 or list(q_out3.shape[1:]) != want:
        raise ValueError(f"{op}: q_out: expected shape [tokens, {want[0]}, {want[1]}], got {list(q_out.shape)}")
    checks.rows_at_least(op, "q_out", q_out3, n, "the tokens")
    checks.last_dim_contiguous(op, "q_out", q_out3)
    checks.same_device(op, "q_out", q_out3, dev, dest_name)
    checks.written(op, "q_out", q_out3)
    if q_out.dtype in FP8_MAX:
        return q_out3, checks.scale(op, "q_scale", q_scale, dev, dest_name)
    if q_scale is not None:
        raise ValueError(f"{op}: q_scale: only an fp8 q_out takes a scale; q_out is {checks.dtype_name(q_out.dtype)}")
    return q_out3, None


def _k_out(k_out, k3, n, dev):
    if k_out is None:
        return None
    checks.same_dtype(OP, "k_out", k_out, k3.dtype, "k")
    out = _heads(OP, "k_out", k_out, k3.shape[2])
    if out.shape[1] != k3.shape[1]:
        raise ValueError(f"{OP}: k_out: expected {k3.shape[1]} heads like k, got shape {list(k_out.shape)}")
    checks.rows_at_least(OP, "k_out", out, n, "slot_mapping")
    checks.last_dim_contiguous(OP, "k_out", out)
    checks.same_device(OP, "k_out", out, dev, "k_cache")
    checks.written(OP, "k_out", out)
    return out


def debug_check(
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
):
    """JITKV_DEBUG=1 on CUDA: device scales' values, every position (a CUDA kernel clamps one outside
    the table into it), then every slot's range, on the host."""
    scales = [("q_scale", q_scale)]
    if kv_cache_dtype != "auto":
        scales += [("k_scale", k_scale), ("v_scale", v_scale)]
    for name, s in scales:
        if isinstance(s, torch.Tensor):
            checks.scale_tensor_value(OP, name, s)
    reference.check_positions(positions, slot_mapping.numel(), cos_sin_cache.shape[0], op=OP)
    reference.check_slots(
        slot_mapping, k_cache.shape[0] * k_cache.shape[1], skip_slot=skip_slot, loc_map=loc_map, op=OP
    )


def check_mla(
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
):
    """The arguments as the reference, Triton and the CPU binding take them: kv_buffer, kv_c, k_pe and
    k_pe_out as 2-D rows, q_pe ``[n', H, R]``, q_nope ``[n', H, nope_q]``, q_out ``[n', H, nope_q + R]``,
    parsed scales."""
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        checks.tensor(MLA_OP, name, t)
    for name, t in (("q_pe", q_pe), ("q_nope", q_nope), ("q_out", q_out), ("k_pe_out", k_pe_out)):
        checks.optional_tensor(MLA_OP, name, t)
    _flag(MLA_OP, "is_neox", is_neox)
    rows = check_rows(MLA_OP, kv_buffer, loc, kv_c, k_pe, kv_cache_dtype, scale, skip_slot, names=("kv_c", "k_pe"))
    buf, _, nope, rope, _, scale, _ = rows
    checks.dtype(MLA_OP, "kv_c", nope, FLOAT_DTYPES)
    dev, n = kv_buffer.device, loc.numel()
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        checks.same_device(MLA_OP, name, t, dev, "kv_buffer")
    r = rope.shape[1]
    if r % 2:
        raise ValueError(f"{MLA_OP}: k_pe: expected an even width (RoPE rotates pairs of dims), got {r}")
    _rotary(MLA_OP, r, cos_sin_cache, r, rope.dtype)
    _positions(MLA_OP, positions, n, dev, "kv_buffer")
    q_pe, q_nope, q_out, q_scale = _mla_queries(q_pe, q_nope, q_out, q_scale, rope, n, dev)
    if k_pe_out is not None:
        checks.same_dtype(MLA_OP, "k_pe_out", k_pe_out, rope.dtype, "k_pe")
        k_pe_out = row_view(MLA_OP, "k_pe_out", k_pe_out, "rope")
        if k_pe_out.shape[1] != r:
            raise ValueError(f"{MLA_OP}: k_pe_out: expected rows of {r} values like k_pe, got {list(k_pe_out.shape)}")
        checks.rows_at_least(MLA_OP, "k_pe_out", k_pe_out, n, "loc")
        checks.same_device(MLA_OP, "k_pe_out", k_pe_out, dev, "kv_buffer")
        checks.written(MLA_OP, "k_pe_out", k_pe_out)
    for name, t in (("q_out", q_out), ("k_pe_out", k_pe_out), ("q_pe", q_pe if q_out is None else None)):
        if t is not None:
            checks.disjoint(MLA_OP, name, t, "kv_buffer", buf)
    return (
        buf,
        loc,
        nope,
        rope,
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
    )


def _mla_queries(q_pe, q_nope, q_out, q_scale, rope, n, dev):
    """q_pe [n', H, R], q_nope [n', H, nope_q], q_out [n', H, nope_q + R] checked against each other."""
    if q_out is not None and (q_pe is None or q_nope is None):
        missing = "q_pe" if q_pe is None else "q_nope"
        raise ValueError(f"{MLA_OP}: {missing}: q_out = [q_nope | rope(q_pe)] needs both q_nope and q_pe, got None")
    if q_nope is not None and q_out is None:
        raise ValueError(f"{MLA_OP}: q_nope: only copied into q_out; expected q_out with it, got None")
    if q_pe is None:
        if q_scale is not None:
            raise ValueError(f"{MLA_OP}: q_scale: only an fp8 q_out takes a scale; q_out is None")
        return None, None, None, None
    checks.same_dtype(MLA_OP, "q_pe", q_pe, rope.dtype, "k_pe")
    if q_pe.dim() != 3 or q_pe.shape[2] != rope.shape[1]:
        raise ValueError(
            f"{MLA_OP}: q_pe: expected shape [tokens, heads, {rope.shape[1]}] (k_pe's width), got {list(q_pe.shape)}"
        )
    checks.rows_at_least(MLA_OP, "q_pe", q_pe, n, "loc")
    checks.last_dim_contiguous(MLA_OP, "q_pe", q_pe)
    checks.same_device(MLA_OP, "q_pe", q_pe, dev, "kv_buffer")
    if q_out is None:
        checks.written(MLA_OP, "q_pe", q_pe)
        _q_out(MLA_OP, None, q_scale, None, q_pe.dtype, n, dev, "kv_buffer")  # raises for a q_scale
        return q_pe, None, None, None
    checks.same_dtype(MLA_OP, "q_nope", q_nope, rope.dtype, "k_pe")
    if q_nope.dim() != 3 or q_nope.shape[1] != q_pe.shape[1]:
        raise ValueError(
            f"{MLA_OP}: q_nope: expected shape [tokens, {q_pe.shape[1]}, nope] (q_pe's heads), got {list(q_nope.shape)}"
        )
    checks.rows_at_least(MLA_OP, "q_nope", q_nope, n, "loc")
    checks.last_dim_contiguous(MLA_OP, "q_nope", q_nope)
    checks.same_device(MLA_OP, "q_nope", q_nope, dev, "kv_buffer")
    want = [q_pe.shape[1], q_nope.shape[2] + q_pe.shape[2]]
    q_out, q_scale = _q_out(MLA_OP, q_out, q_scale, want, q_pe.dtype, n, dev, "kv_buffer", q_name="q_pe")
    return q_pe, q_nope, q_out, q_scale


def debug_check_mla(
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
):
    """JITKV_DEBUG=1 on CUDA: device scales, positions, then every loc's range, on the host."""
    for name, s in (("q_scale", q_scale), ("scale", scale)):
        if isinstance(s, torch.Tensor):
            checks.scale_tensor_value(MLA_OP, name, s)
    reference.check_positions(positions, loc.numel(), cos_sin_cache.shape[0], op=MLA_OP)
    reference.check_slots(loc, kv_buffer.shape[0], skip_slot=skip_slot, name="loc", op=MLA_OP)


# -------------------------------------------------------------------------------------- variants


class Variant(NamedTuple):
    """The CUDA build a rope_store_cache call selects: q/k head dim, v head dim, rotary dim, NeoX or
    GPT-J, which norms run, the source dtype, the cos_sin_cache and norm weights' dtypes (F32 or the
    source's; NONE: no norm), what happens to q (RopeQ) and the cache format."""

    head_dim: int
    v_head_dim: int
    rotary_dim: int
    is_neox: bool
    q_norm: bool
    k_norm: bool
    src_dtype: SrcDtype
    cos_sin_dtype: SrcDtype
    norm_dtype: SrcDtype
    q_mode: RopeQ
    kv_format: KvFormat
    aligned: bool = True  # False: a call whose views the CUDA kernel refused (rope_store_cache_cuda.cu)
    page_table: bool = False  # True: slots from FlashInfer's page table, read in the kernel (paged_runner)


# Enum members the variant reads on every CUDA call, as module globals: a member read through its
# class costs 50-100 ns on Python 3.11 (a global 8 ns; docs/performance.md "variant reads").
_NO_SRC, _Q_NONE, _Q_IN_PLACE, _Q_COPY = SrcDtype.NONE, RopeQ.NONE, RopeQ.IN_PLACE, RopeQ.COPY
_Q_FP8 = {torch.float8_e4m3fn: RopeQ.E4M3, torch.float8_e5m2: RopeQ.E5M2}  # q_out dtype -> its RopeQ


def _q_mode(q_out) -> RopeQ:
    if q_out is None:
        return _Q_IN_PLACE
    return _Q_FP8.get(q_out.dtype, _Q_COPY)


def variant(
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
) -> tuple:
    """The fields of the CUDA Variant, read on every CUDA call; arguments the checks refuse raise here."""
    try:
        d = _head_dim(q, k, k_cache)
        heads = k.shape[1] if k.dim() == 3 else k.shape[1] // d
        dv = v.shape[-1] if v.dim() == 3 else v.shape[1] // heads
        weight = q_norm_weight if q_norm_weight is not None else k_norm_weight
        return (
            d,
            dv,
            cos_sin_cache.shape[1] if rotary_dim is None else rotary_dim,
            is_neox,
            q_norm_weight is not None,
            k_norm_weight is not None,
            SRC_DTYPES[q.dtype],
            SRC_DTYPES[cos_sin_cache.dtype],
            _NO_SRC if weight is None else SRC_DTYPES[weight.dtype],
            _q_mode(q_out),
            KV_FORMATS[kv_cache_dtype],
            True,
            False,
        )
    except (AttributeError, IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
        check(
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
        )
        raise


class MlaVariant(NamedTuple):
    """The CUDA build a rope_set_mla_kv_buffer call selects: nope and rope widths, NeoX or GPT-J, the
    source and cos_sin_cache dtypes, what happens to q (RopeQ; NONE without q_pe) and the format."""

    nope_dim: int
    rope_dim: int
    is_neox: bool
    src_dtype: SrcDtype
    cos_sin_dtype: SrcDtype
    q_mode: RopeQ
    kv_format: KvFormat
    aligned: bool = True  # False: a call whose views the CUDA kernel refused
    page_table: bool = False  # True: slots from FlashInfer's page table, read in the kernel (mla_paged_runner)


def variant_mla(
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
) -> tuple:
    """The fields of the CUDA MlaVariant, read on every CUDA call; refused arguments raise here."""
    try:
        return (
            kv_c.shape[-1],
            k_pe.shape[-1],
            is_neox,
            SRC_DTYPES[k_pe.dtype],
            SRC_DTYPES[cos_sin_cache.dtype],
            _Q_NONE if q_pe is None else _q_mode(q_out),
            KV_FORMATS[kv_cache_dtype],
            True,
            False,
        )
    except (AttributeError, IndexError, KeyError, TypeError):
        check_mla(
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
        )
        raise


# ------------------------------------------------------------------------------------------- jit


def cpu_spec() -> JitSpec:
    """Both ops' CPU module. -ffp-contract=off: RoPE's products are rounded before the sum
    (docs/design.md §9), so no multiply-add may be contracted."""
    return JitSpec("rope_cpu", ("rope/rope_cpu.cpp",), cflags=("-ffp-contract=off",), exports=(OP, MLA_OP))


def cuda_spec(arch: str, v: Variant, *, pdl: bool = True) -> JitSpec:
    """rope_store_cache's CUDA module for a Variant (rope/rope_store_cache_cuda.cu): NeoX or GPT-J and the
    cos/sin dtype are read per call, so variants that differ only there share a module."""
    return JitSpec(
        "rope_store_cache_cuda",
        ("rope/rope_store_cache_cuda.cu",),
        args=(
            ("head_dim", v.head_dim),
            ("v_head_dim", v.v_head_dim),
            ("rotary_dim", v.rotary_dim),
            ("src_dtype", int(v.src_dtype)),
            ("q_mode", int(v.q_mode)),
            ("kv_dtype", int(v.kv_format)),
            ("norms", RopeNorm.Q * v.q_norm | RopeNorm.K * v.k_norm),
            ("norm_dtype", int(v.norm_dtype)),
            ("page_table", int(v.page_table)),
            ("pdl", int(pdl)),
        ),
        target=arch,
        exports=(TABLE_ENTRY,) if v.page_table else (OP,),
    )


def cuda_mla_spec(arch: str, v: MlaVariant, *, pdl: bool = True) -> JitSpec:
    """rope_set_mla_kv_buffer's CUDA module for an MlaVariant (rope/rope_set_mla_kv_buffer_cuda.cu); NeoX
    or GPT-J and the cos/sin dtype are read per call."""
    return JitSpec(
        "rope_set_mla_kv_buffer_cuda",
        ("rope/rope_set_mla_kv_buffer_cuda.cu",),
        args=(
            ("nope", v.nope_dim),
            ("rope", v.rope_dim),
            ("src_dtype", int(v.src_dtype)),
            ("q_mode", int(v.q_mode)),
            ("kv_dtype", int(v.kv_format)),
            ("page_table", int(v.page_table)),
            ("pdl", int(pdl)),
        ),
        target=arch,
        exports=(MLA_TABLE_ENTRY,) if v.page_table else (MLA_OP,),
    )


LANE_BYTES = 16  # a CUDA lane holds 16 source bytes; a head's lanes are one group of at most a warp


def _lane_refusal(head_dim: int, rotary_dim: int, is_neox: bool, src_dtype: SrcDtype, other_dim: int):
    per_lane = LANE_BYTES // (4 if src_dtype == SrcDtype.F32 else 2)
    if head_dim % per_lane or other_dim % per_lane or not 0 < head_dim // per_lane <= 32:
        return f"widths {head_dim}/{other_dim} are not 1-32 lanes of {per_lane} values"
    if rotary_dim % per_lane or (is_neox and rotary_dim // 2 % per_lane):
        return f"rotary_dim {rotary_dim} does not rotate whole lanes of {per_lane} values"
    return None


def cuda_refusal(v: Variant):
    """Why rope_store_cache's CUDA kernel cannot take a variant (None: it can): heads of 1-32 lanes of
    16 source bytes, rotated dims in whole lanes, NeoX halves of whole lanes (the partner lane holds the
    other half), views it can address (Variant.aligned). Decided before building; the op runs Triton for
    the rest."""
    if not v.aligned:
        return "the call's views are not aligned to the kernel's 16-byte lanes"
    if (v.q_norm or v.k_norm) and v.head_dim % NORM_GROUP:
        return f"the norm sums groups of {NORM_GROUP} dims; head_dim is {v.head_dim}"
    if (v.q_norm or v.k_norm) and v.norm_dtype not in (SrcDtype.F32, v.src_dtype):
        return "norm weights are float32 or of the sources' dtype"
    return _lane_refusal(v.head_dim, v.rotary_dim, v.is_neox, v.src_dtype, v.v_head_dim)


def cuda_mla_refusal(v: MlaVariant):
    """As cuda_refusal, for rope_set_mla_kv_buffer: k_pe in 1-32 lanes, kv_c in whole lanes, fp8_ds_mla
    rows of 512 + 64 16-bit values."""
    if not v.aligned:
        return "the call's views are not aligned to the kernel's 16-byte lanes"
    if v.kv_format == KvFormat.DS_MLA and (v.nope_dim, v.rope_dim, v.src_dtype) not in (
        (DsMla.NOPE, DsMla.ROPE, SrcDtype.BF16),
        (DsMla.NOPE, DsMla.ROPE, SrcDtype.F16),
    ):
        return "fp8_ds_mla rows are 512 + 64 bf16 or fp16 values"
    return _lane_refusal(v.rope_dim, v.rope_dim, v.is_neox, v.src_dtype, v.nope_dim)


# Prebuilt CUDA modules: head_dim 128 bf16 (Llama-3 without norms, Qwen3 with both and bf16 weights; NeoX or
# GPT-J) with q in place and bf16 caches or an e4m3 q_out and e4m3 caches, and the page-table build of the
# Llama e4m3 one (FlashInfer's fused shim: jitkv.compat.flashinfer); DeepSeek MLA 512 + 64 bf16, e4m3 and
# fp8_ds_mla rows, and the page-table build of e4m3 rows with an e4m3 q_out (the same shim's MLA form).
CUDA_PREBUILD = tuple(
    Variant(128, 128, 128, True, norm, norm, SrcDtype.BF16, SrcDtype.F32, w, q_mode, kv)
    for norm, w in ((False, SrcDtype.NONE), (True, SrcDtype.BF16))
    for q_mode, kv in ((RopeQ.IN_PLACE, KvFormat.COPY), (RopeQ.E4M3, KvFormat.E4M3))
) + (
    Variant(
        128,
        128,
        128,
        True,
        False,
        False,
        SrcDtype.BF16,
        SrcDtype.F32,
        SrcDtype.NONE,
        RopeQ.E4M3,
        KvFormat.E4M3,
        page_table=True,
    ),
)
CUDA_MLA_PREBUILD = tuple(
    MlaVariant(512, 64, False, SrcDtype.BF16, SrcDtype.F32, RopeQ.IN_PLACE, kv)
    for kv in (KvFormat.COPY, KvFormat.E4M3, KvFormat.DS_MLA)
) + (MlaVariant(512, 64, False, SrcDtype.BF16, SrcDtype.F32, RopeQ.E4M3, KvFormat.E4M3, page_table=True),)


def specs(target: str) -> list[JitSpec]:
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target, v) for v in CUDA_PREBUILD] + [cuda_mla_spec(target, v) for v in CUDA_MLA_PREBUILD]


def _q_dest(q3, q_out):
    """(the tensor q is written to, its RopeQ code)."""
    return (q3, int(_Q_IN_PLACE)) if q_out is None else (q_out, int(_q_mode(q_out)))


def _as_heads(t, d):
    """A [n', H*d] view as [n', H, d] (3-D passes; a view torch cannot make raises RuntimeError, and
    the op then runs its check)."""
    return t if t is None or t.dim() != 2 else t.view(t.shape[0], -1, d)


def _jit(device, variant):
    """The CPU module, or the CUDA module of this variant (BackendUnavailable for one the kernel cannot
    take). The runner hands the binding [n', H, D] views; the binding checks the rest and the op's
    check names what it refuses."""
    if device.type == "cuda":
        spec, retry = _taken_cuda_spec(device, variant), tuple(variant._replace(aligned=False))
    else:
        spec, retry = cpu_spec(), None
    fn, info = jit_function(spec, OP)
    return ROPE_STORE_CACHE.with_debug_checks(device, _runner(fn, retry)), info


def _runner(fn, refused):
    """run(*op args, table=()): calls the binding ``fn`` with [n', H, D] views, q's destination and mode
    and the scales as tensor or value, then ``table`` (paged_runner's: the page table's four entries);
    returns ``refused`` where the binding declined the call (codes.Status), else None."""

    def run(
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
        table=(),
    ):
        _flag(OP, "is_neox", is_neox)  # tvm-ffi would take 0 / 1 for a bool
        d = _head_dim(q, k, k_cache)
        q3, k3 = _as_heads(q, d), _as_heads(k, d)
        v3 = _as_heads(v, _v_head_dim(v, k3.shape[1]))
        q_dst, q_mode = _q_dest(q3, _as_heads(q_out, d))
        qs, qs_value = scale_args(OP, "q_scale", q_scale)
        ks, ks_value = scale_args(OP, "k_scale", k_scale)
        vs, vs_value = scale_args(OP, "v_scale", v_scale)
        status = fn(
            q3,
            k3,
            v3,
            k_cache,
            v_cache,
            slot_mapping,
            positions,
            cos_sin_cache,
            is_neox,
            cos_sin_cache.shape[1] if rotary_dim is None else rotary_dim,
            q_norm_weight,
            k_norm_weight,
            eps,
            q_dst,
            q_mode,
            qs,
            qs_value,
            _as_heads(k_out, d),
            loc_map,
            NO_SLOT if skip_slot is None else skip_slot,
            _kv_format(OP, kv_cache_dtype),
            ks,
            vs,
            ks_value,
            vs_value,
            *table,
        )
        return refused if status else None

    return run


def paged_runner(device, v: Variant):
    """A runner of rope_store_cache's CUDA build that reads FlashInfer's page table itself
    (jitkv/page_table.h): run(*op args, table=(positions, kv_indices, kv_indptr, page_size)) with the
    table's batch_indices as slot_mapping, no loc_map and no skip_slot (ValueError); True where the kernel
    declined the call (views it cannot address, a page_size that is not the caches' block size: nothing
    written), else None. Raises BackendUnavailable for a variant the kernel cannot take; a build's JitUnavailable
    or CaptureBuildError propagates."""
    return _runner(jit_function(_taken_cuda_spec(device, v._replace(page_table=True)), TABLE_ENTRY)[0], True)


def _taken_cuda_spec(device, v: Variant) -> JitSpec:
    """cuda_spec of v on device's arch; BackendUnavailable for a variant the kernel cannot take."""
    why = cuda_refusal(v)
    if why:
        raise BackendUnavailable(f"the CUDA kernel cannot take this call: {why}")
    return cuda_spec(cuda_arch(device), v)


def _kv_format(op, kv_cache_dtype) -> int:
    """The KvFormat code of kv_cache_dtype (ValueError naming the choices for any other value)."""
    fmt = KV_FORMATS.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if fmt is None:
        checks.choice(op, "kv_cache_dtype", kv_cache_dtype, tuple(KV_FORMATS))
    return int(fmt)


def _jit_mla(device, variant):
    """As _jit, for rope_set_mla_kv_buffer."""
    if device.type == "cuda":
        spec, retry = _taken_cuda_mla_spec(device, variant), tuple(variant._replace(aligned=False))
    else:
        spec, retry = cpu_spec(), None
    fn, info = jit_function(spec, MLA_OP)
    return ROPE_SET_MLA_KV_BUFFER.with_debug_checks(device, _mla_runner(fn, retry)), info


def _mla_runner(fn, refused):
    """As _runner, for rope_set_mla_kv_buffer: run(*op args, table=()) calls the binding ``fn`` with q's
    mode and the scales as tensor or value, then ``table`` (mla_paged_runner's: the page table's four
    entries and kpe_rows); returns ``refused`` where the binding declined the call, else None."""

    def run(
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
        table=(),
    ):
        _flag(MLA_OP, "is_neox", is_neox)
        q_mode = int(_Q_NONE) if q_pe is None else int(_q_mode(q_out))
        if q_out is not None and q_out.dim() == 2 and q_pe is not None and q_nope is not None:
            q_out = q_out.view(q_out.shape[0], q_pe.shape[1], -1)
        qs, qs_value = scale_args(MLA_OP, "q_scale", q_scale)
        s, s_value = scale_args(MLA_OP, "scale", scale)
        status = fn(
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
            q_mode,
            qs,
            qs_value,
            k_pe_out,
            NO_SLOT if skip_slot is None else skip_slot,
            _kv_format(MLA_OP, kv_cache_dtype),
            s,
            s_value,
            *table,
        )
        return refused if status else None

    return run


def mla_paged_runner(device, v: MlaVariant):
    """As paged_runner, for rope_set_mla_kv_buffer: run(*op args, table=(positions, kv_indices, kv_indptr,
    page_size, kpe_rows)) with the table's batch_indices as loc and no skip_slot (ValueError); kv_buffer's
    rows are the pages' rows, page after page (any page_size); kpe_rows None, or ``[rows, >= rope]`` of
    kv_buffer's dtype and row count: the rows' rope parts (FlashInfer's separate kpe cache; kv_buffer's
    rows then hold kv_c only). True where the kernel declined the call (views it
    cannot address: nothing written), else None. Raises BackendUnavailable for a variant the kernel
    cannot take; a build's JitUnavailable or CaptureBuildError propagates."""
    spec = _taken_cuda_mla_spec(device, v._replace(page_table=True))
    return _mla_runner(jit_function(spec, MLA_TABLE_ENTRY)[0], True)


def _taken_cuda_mla_spec(device, v: MlaVariant) -> JitSpec:
    """cuda_mla_spec of v on device's arch; BackendUnavailable for a variant the kernel cannot take."""
    why = cuda_mla_refusal(v)
    if why:
        raise BackendUnavailable(f"the CUDA kernel cannot take this call: {why}")
    return cuda_mla_spec(cuda_arch(device), v)


# ------------------------------------------------------------------------------ sample and bench


def cos_sin_table(max_pos, rotary_dim, base=10000.0, dtype=torch.float32, device="cpu"):
    """[max_pos, rotary_dim] cos half then sin half of the standard RoPE frequencies (the engines'
    layout), for samples, tests and the benchmark."""
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(dtype).to(device)


def sample(device, gen=None) -> dict:
    """Qwen3-style: QK-norm, NeoX, bf16 -> an e4m3 q_out and e4m3 caches (per-head K scales), k_out."""
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    n, hq, hk, d = 8, 4, 2, 64
    return dict(
        q=rand((n, hq, d), bf16, device, gen),
        k=rand((n, hk, d), bf16, device, gen),
        v=rand((n, hk, d), bf16, device, gen),
        k_cache=rand((32, hk, d), e4m3, device, gen),
        v_cache=rand((32, hk, d), e4m3, device, gen),
        slot_mapping=slots(32, n, torch.int32, device, gen),
        positions=torch.randint(0, 64, (n,), generator=gen).to(device),
        cos_sin_cache=cos_sin_table(64, d, device=device),
        is_neox=True,
        q_norm_weight=rand((d,), bf16, device, gen),
        k_norm_weight=rand((d,), bf16, device, gen),
        q_out=rand((n, hq, d), e4m3, device, gen),
        q_scale=torch.tensor([0.25], device=device),
        k_out=rand((n, hk, d), bf16, device, gen),
        kv_cache_dtype="fp8_e4m3",
        k_scale=torch.tensor([0.5, 2.0], device=device),
        v_scale=1.5,
    )


def sample_mla(device, gen=None) -> dict:
    """DeepSeek-style 512 + 64, GPT-J rope, bf16 into an fp8_ds_mla buffer, q_out = [q_nope | rope(q_pe)]."""
    bf16, n, h = torch.bfloat16, 8, 4
    return dict(
        kv_buffer=rand((64, 656), torch.uint8, device, gen),
        loc=slots(64, n, torch.int64, device, gen),
        kv_c=rand((n, 512), bf16, device, gen),
        k_pe=rand((n, 64), bf16, device, gen),
        positions=torch.randint(0, 64, (n,), dtype=torch.int32, generator=gen).to(device),
        cos_sin_cache=cos_sin_table(64, 64, device=device),
        is_neox=False,
        q_pe=rand((n, h, 64), bf16, device, gen),
        q_nope=rand((n, h, 512), bf16, device, gen),
        q_out=rand((n, h, 576), bf16, device, gen),
        k_pe_out=rand((n, 64), bf16, device, gen),
        kv_cache_dtype="fp8_ds_mla",
    )


# The unfused baselines: what an engine runs without this op, in torch (vLLM's RotaryEmbedding
# forward_native: the table's rows cast to the model dtype, the halves or pairs rotated in it; HF's
# Qwen3RMSNorm: float32 variance, rsqrt, weight in the model dtype), then jitkv's own cache writer.


def torch_rope(x, positions, cos_sin_cache, is_neox):
    """x [n, H, R] rotated in its own dtype (a new tensor)."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    a, b = x.chunk(2, dim=-1) if is_neox else (x[..., ::2], x[..., 1::2])
    out = (a * cos - b * sin, b * cos + a * sin)
    return torch.cat(out, dim=-1) if is_neox else torch.stack(out, dim=-1).flatten(-2)


def torch_rms_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _mha_unfused(a):
    """torch (QK-norm,) RoPE on q and k, q written to q_out, then jitkv.store_cache."""
    q, k = a["q"], a["k"]
    if a.get("q_norm_weight") is not None:
        q, k = torch_rms_norm(q, a["q_norm_weight"], 1e-6), torch_rms_norm(k, a["k_norm_weight"], 1e-6)
    q_rot = torch_rope(q, a["positions"], a["cos_sin_cache"], True)
    k_rot = torch_rope(k, a["positions"], a["cos_sin_cache"], True)
    a["q_out"].copy_(q_rot)
    scales = {name: a[name] for name in ("kv_cache_dtype", "k_scale", "v_scale") if name in a}
    store_cache(k_rot, a["v"], a["k_cache"], a["v_cache"], a["slot_mapping"], **scales)


def _mla_unfused(a):
    """torch RoPE on q_pe (written back) and k_pe, then jitkv.set_mla_kv_buffer."""
    a["q_pe"].copy_(torch_rope(a["q_pe"], a["positions"], a["cos_sin_cache"], False))
    k_rot = torch_rope(a["k_pe"].unsqueeze(1), a["positions"], a["cos_sin_cache"], False)[:, 0]
    set_mla_kv_buffer(
        a["kv_buffer"], a["loc"], a["kv_c"], k_rot, kv_cache_dtype=a["kv_cache_dtype"], scale=a.get("scale")
    )


# (case, Hq or H, Hk, head dim, QK-norm): the models of the benchmark.
MHA_MODELS = (("Llama-3-8B", 32, 8, 128, False), ("Qwen3-8B QK-norm", 32, 8, 128, True))
MLA_HEADS = 128  # DeepSeek-V3: 128 query heads over one 512 + 64 latent row


def _mha_args(hq, hk, d, norm, n, num_slots, kv, device="cpu", slot_mapping=None, caches=None):
    bf16 = torch.bfloat16
    # Qwen3 (norm): q, k and v as views of one packed qkv projection, as engines pass them.
    qkv = rand((n, (hq + 2 * hk) * d), bf16, device) if norm else None
    q, k, v = (
        qkv.split([hq * d, hk * d, hk * d], dim=1) if norm else (rand((n, h, d), bf16, device) for h in (hq, hk, hk))
    )
    if norm:
        q, k, v = q.view(n, hq, d), k.view(n, hk, d), v.view(n, hk, d)
    a = dict(
        q=q,
        k=k,
        v=v,
        slot_mapping=slots(num_slots, n, device=device) if slot_mapping is None else slot_mapping,
        positions=torch.randint(0, 4096, (n,), device=device),
        cos_sin_cache=cos_sin_table(4096, d, device=device),
        is_neox=True,
    )
    # Rotated q into q_out, so that every timed call sees the same q (normed in place again and again, its
    # values would drift into subnormals, which cost a CPU far more than normal floats).
    a["q_out"] = torch.empty_like(a["q"])
    cache_dtype = bf16 if kv == "auto" else torch.float8_e4m3fn
    a["k_cache"], a["v_cache"] = caches or (rand((num_slots, hk, d), cache_dtype, device) for _ in "kv")
    if norm:
        a.update(q_norm_weight=rand((d,), bf16, device), k_norm_weight=rand((d,), bf16, device))
    if kv != "auto":  # device scales: a Python float would reach store_cache's Triton kernel as a host copy,
        # which CUDA-graph capture refuses
        a.update(
            kv_cache_dtype=kv, k_scale=torch.tensor([0.5], device=device), v_scale=torch.tensor([0.25], device=device)
        )
    return a


def _mla_args(n, num_slots, kv, device="cpu", buf=None):
    bf16 = torch.bfloat16
    width = 656 if kv == "fp8_ds_mla" else 576
    a = dict(
        kv_buffer=buf if buf is not None else rand((num_slots, width), bf16 if kv == "auto" else torch.uint8, device),
        loc=slots(num_slots, n, device=device),
        kv_c=rand((n, 512), bf16, device),
        k_pe=rand((n, 64), bf16, device),
        positions=torch.randint(0, 4096, (n,), device=device),
        cos_sin_cache=cos_sin_table(4096, 64, device=device),
        is_neox=False,
        q_pe=rand((n, MLA_HEADS, 64), bf16, device),
        kv_cache_dtype=kv,
    )
    if kv == "fp8_e4m3":
        a["scale"] = torch.tensor([0.5], device=device)
    return a


def _mha_bytes(a) -> int:
    """q read and q_out written, k and v read, their cache rows written."""
    q, k, v, kc = a["q"], a["k"], a["v"], a["k_cache"]
    return q.numel() * 4 + (k.numel() + v.numel()) * (2 + kc.element_size())


def _kv_bytes(a) -> int:
    """k and v read, their cache rows written: what the write alone moves."""
    return (a["k"].numel() + a["v"].numel()) * (2 + a["k_cache"].element_size())


def _mla_bytes(a) -> int:
    n = a["loc"].numel()
    return a["q_pe"].numel() * 4 + n * (576 * 2 + a["kv_buffer"].shape[1] * a["kv_buffer"].element_size())


def _bench_cpu(h, num_slots=1 << 16, mla_slots=1 << 18) -> list:
    """Llama-3-8B and Qwen3-8B (QK-norm) K/V into bf16 and e4m3 caches of 2^16 slots (256 / 128 MB for K
    and V), DeepSeek MLA into bf16 and fp8_ds_mla rows of a 2^18-row buffer (302 / 172 MB), far past
    an LLC, each call writing slots no recent call wrote (``h.fresh_slots``): torch's unfused
    composition (the baseline) against the fused op."""
    rows = []
    for case, hq, hk, d, norm in MHA_MODELS:
        for kv in ("auto", "fp8_e4m3"):
            cache_dtype = torch.bfloat16 if kv == "auto" else torch.float8_e4m3fn
            caches = tuple(rand((num_slots, hk, d), cache_dtype) for _ in "kv")
            for n in h.sizes((1, 133, 4096)):
                a = _mha_args(hq, hk, d, norm, n, num_slots, kv, caches=caches)
                fresh = h.fresh_slots(num_slots, n)
                rows += h.rows(
                    OP,
                    f"{case} bf16 -> {'bf16' if kv == 'auto' else 'e4m3'}",
                    n,
                    _mha_bytes(a),
                    [
                        ("torch unfused + jitkv store_cache", _fresh(_mha_unfused, a, "slot_mapping", fresh)),
                        ("jitkv jit", _fresh(lambda a: rope_store_cache(**a), a, "slot_mapping", fresh)),
                    ],
                )
            caches = None  # free them before the next case allocates
    for kv in ("auto", "fp8_ds_mla"):
        buf = rand((mla_slots, 656 if kv == "fp8_ds_mla" else 576), torch.bfloat16 if kv == "auto" else torch.uint8)
        for n in h.sizes((1, 133, 1024)):
            a = _mla_args(n, mla_slots, kv, buf=buf)
            fresh = h.fresh_slots(mla_slots, n)
            rows += h.rows(
                MLA_OP,
                f"DeepSeek H{MLA_HEADS} 512+64 bf16 -> {kv}",
                n,
                _mla_bytes(a),
                [
                    ("torch unfused + jitkv set_mla_kv_buffer", _fresh(_mla_unfused, a, "loc", fresh)),
                    ("jitkv jit", _fresh(lambda a: rope_set_mla_kv_buffer(**a), a, "loc", fresh)),
                ],
            )
        buf = None
    return rows


def _fresh(fn, a, key, slots_fn):
    """A call of fn(a) with a[key] set to the next fresh slots first (the CPU benchmark's cases)."""

    def call():
        a[key] = slots_fn()
        fn(a)

    return call


ROPE_NS = (1, 8, 32, 128, 512, 2048, 16384)
ROPE_CEILING_NS = (128, 512)  # where the rows also get a graph-timed contiguous copy of the op's bytes
# Where the rows get the fused-prologue floor: the latency sizes. From n = 512 the floor kernel's own shape
# (one 16-byte piece per thread) costs more than the op, so it bounds nothing there; the contiguous copy
# does. Re-measure: add 512 here and run --op rope_store_cache.
ROPE_FLOOR_NS = (1, 8, 32, 128)


def _bench_gpu(h, ns=ROPE_NS) -> list:
    """The CPU cases on CUDA under graph replay, per layer its own caches (2^16 slots) and sources: the
    unfused composition (torch RoPE, then jitkv's writer), jitkv's writer alone (no RoPE), then the op
    on its CUDA kernel and on Triton; "x floor" is over the fused-prologue floor of the same run (n = 1).
    Beside rope_store_cache at ROPE_FLOOR_NS the fused-prologue floor at that n (its bytes, RoPE's
    dependent load, k and v at their slots: benchmark.gpu.rope_rows_floor), and at ROPE_CEILING_NS a contiguous
    copy of the bytes the op moves (read = write = half), under graph replay like the rows."""
    from ..benchmark.gpu import rope_rows_floor

    rows, slots_per_layer = [], 1 << 16
    for case, hq, hk, d, norm in MHA_MODELS:
        for kv in ("auto", "fp8_e4m3"):
            cache_dtype = torch.bfloat16 if kv == "auto" else torch.float8_e4m3fn
            caches = [tuple(rand((slots_per_layer, hk, d), cache_dtype, "cuda") for _ in "kv") for _ in range(h.layers)]
            for n in h.sizes(ns):
                args = [
                    _mha_args(hq, hk, d, norm, n, slots_per_layer, kv, "cuda", caches=caches[i])
                    for i in range(h.layers)
                ]
                cases = [
                    ("torch unfused + jitkv store_cache", lambda i: _mha_unfused(args[i])),
                    ("jitkv store_cache alone (no RoPE)", lambda i: _write_only(args[i]), _kv_bytes(args[0])),
                ]
                cases += [
                    (f"jitkv {b}", lambda i, b=b: rope_store_cache(**args[i], backend=b))
                    for b in ROPE_STORE_CACHE.order["cuda"]
                    if b != "torch"
                ]
                if n in ROPE_FLOOR_NS:
                    cases += rope_rows_floor(args)
                if n in ROPE_CEILING_NS:
                    cases += h.contiguous_copies(_mha_bytes(args[0]))
                rows += h.rows(
                    OP,
                    f"{case} bf16 -> {'bf16' if kv == 'auto' else 'e4m3'}",
                    n,
                    _mha_bytes(args[0]),
                    cases,
                    floor="rope",
                )
                args = None  # free them before the next size allocates (closures read the names)
            caches = None  # free them before the next size allocates (closures read the names)
    for kv in ("auto", "fp8_e4m3"):
        width, dtype = (576, torch.bfloat16) if kv == "auto" else (576, torch.uint8)
        bufs = [rand((slots_per_layer, width), dtype, "cuda") for _ in range(h.layers)]
        for n in h.sizes(ns):
            args = [_mla_args(n, slots_per_layer, kv, "cuda", buf=bufs[i]) for i in range(h.layers)]
            cases = [("torch unfused + jitkv set_mla_kv_buffer", lambda i: _mla_unfused(args[i]))]
            cases += [
                (f"jitkv {b}", lambda i, b=b: rope_set_mla_kv_buffer(**args[i], backend=b))
                for b in ROPE_SET_MLA_KV_BUFFER.order["cuda"]
                if b != "torch"
            ]
            if n in ROPE_CEILING_NS:
                cases += h.contiguous_copies(_mla_bytes(args[0]))
            rows += h.rows(
                MLA_OP, f"DeepSeek H{MLA_HEADS} 512+64 bf16 -> {kv}", n, _mla_bytes(args[0]), cases, floor="rope"
            )
            args = None  # free them before the next size allocates (closures read the names)
        bufs = None  # free them before the next size allocates (closures read the names)
    return rows


def _write_only(a):
    """jitkv.store_cache of the unrotated k and v: the write the fused op adds RoPE to."""
    scales = {name: a[name] for name in ("kv_cache_dtype", "k_scale", "v_scale") if name in a}
    store_cache(a["k"], a["v"], a["k_cache"], a["v_cache"], a["slot_mapping"], **scales)


ROPE_STORE_CACHE = Op(
    rope_store_cache,
    schema=(
        "(Tensor(a!) q, Tensor k, Tensor v, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, "
        "Tensor positions, Tensor cos_sin_cache, *, bool is_neox, int? rotary_dim=None, Tensor? q_norm_weight=None, "
        "Tensor? k_norm_weight=None, float eps=1e-06, Tensor(d!)? q_out=None, Scale? q_scale=None, "
        'Tensor(e!)? k_out=None, str kv_cache_dtype="auto", Scale? k_scale=None, Scale? v_scale=None, '
        "Tensor? loc_map=None, int? skip_slot=None)"
    ),
    home="k_cache",
    check=check,
    debug_check=debug_check,
    variant=variant,
    variant_type=Variant,
    specs=specs,
    reference=reference.rope_store_cache,
    triton="rope_store_cache_triton",
    sample=sample,
    bench_cpu=_bench_cpu,
    bench_gpu=_bench_gpu,
)  # the benchmark cases of both ops
ROPE_STORE_CACHE.backend("jit")(_jit)

ROPE_SET_MLA_KV_BUFFER = Op(
    rope_set_mla_kv_buffer,
    schema=(
        "(Tensor(a!) kv_buffer, Tensor loc, Tensor kv_c, Tensor k_pe, Tensor positions, Tensor cos_sin_cache, *, "
        "bool is_neox, Tensor(b!)? q_pe=None, Tensor? q_nope=None, Tensor(c!)? q_out=None, Scale? q_scale=None, "
        'Tensor(d!)? k_pe_out=None, str kv_cache_dtype="auto", Scale? scale=None, int? skip_slot=None)'
    ),
    home="kv_buffer",
    check=check_mla,
    debug_check=debug_check_mla,
    variant=variant_mla,
    variant_type=MlaVariant,
    specs=specs,
    reference=reference.rope_set_mla_kv_buffer,
    triton="rope_set_mla_kv_buffer_triton",
    sample=sample_mla,
)
ROPE_SET_MLA_KV_BUFFER.backend("jit")(_jit_mla)
