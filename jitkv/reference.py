"""Pure-torch reference of every jitkv op (docs/design.md §2-§5).

Used by the tests as ground truth and as the last-resort ``torch`` backend. Arguments are assumed
valid (the op wrappers validate first). Copies go through same-width integer views so they are
bitwise and work for float8 dtypes, which torch cannot index-put on every device.

No op reads a device tensor on the host, so on CUDA each is safe under CUDA-graph capture: writers
scatter every row, skipped rows repeating a kept row's write (see ``_plan``). Writers take
``strict``: out-of-range slots raise IndexError before anything is written (default on CPU and under
JITKV_DEBUG=1; that check syncs, see ``check_slots``), else they are skipped.
"""

from __future__ import annotations

import os

import torch

from .layouts import (  # noqa: F401  (re-exported: the tests and the Python backends read them here)
    DSV4_DATA_BYTES,
    DSV4_GROUP,
    DSV4_HEAD_DIM,
    DSV4_NOPE,
    DSV4_ROPE,
    DSV4_SCALE_BYTES,
    DSV4_TOKEN_BYTES,
    FP8_DTYPES,
    FP8_MAX,
)


def default_strict(index) -> bool:
    """Whether out-of-range slots raise (CPU, or JITKV_DEBUG=1) or are skipped (CUDA)."""
    return index.device.type == "cpu" or os.environ.get("JITKV_DEBUG", "0") not in ("", "0")


def check_slots(index, num_slots, *, skip_slot=None, loc_map=None, name="slot_mapping", op="jitkv"):
    """Raise IndexError naming the first position whose slot (or loc_map entry) is out of range.

    It reads the slots on the host, which synchronizes a CUDA device: while the current stream is
    capturing a CUDA graph it raises RuntimeError before any CUDA work instead (a sync would
    invalidate the capture)."""
    _refuse_capture(index, name, op)
    _raise_first(_slots(index, num_slots, skip_slot, loc_map, name)[2])


def _refuse_capture(index, name, op):
    if index.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op}: JITKV_DEBUG=1 checks {name} on the host, which CUDA-graph capture does not allow; "
            "capture without JITKV_DEBUG"
        )


def _slots(index, num_slots, skip_slot, loc_map, name):
    """The padding rules of docs/design.md §3 on the index's device, without a host sync.

    Returns (keep [n] bool, slot [n] int64, checks): checks are (out of range [n] bool, value [n],
    message) in the order a strict caller reports them; out-of-range rows are not kept."""
    s = index.long()
    keep = s >= 0
    if skip_slot is not None:
        keep &= s != skip_slot
    checks = []
    if loc_map is not None:
        lm = loc_map.long()
        oob = keep & (s >= lm.numel())
        checks.append((oob, s, f"{name}: position {{i}} has slot {{v}}, out of range for loc_map of size {lm.numel()}"))
        keep &= ~oob
        s = lm.index_select(0, s.clamp(0, lm.numel() - 1)) if lm.numel() else s
        keep &= s >= 0
        where = f"loc_map: {name} position {{i}} maps to {{v}}"
    else:
        where = f"{name}: position {{i}} has slot {{v}}"
    oob = keep & (s >= num_slots)
    checks.append((oob, s, f"{where}, out of range for a cache of {num_slots} slots"))
    return keep & ~oob, s, checks


def _raise_first(checks):
    for oob, values, message in checks:
        if bool(oob.any()):
            i = int(oob.nonzero()[0, 0])
            raise IndexError(message.format(i=i, v=int(values[i])))


def _plan(index, num_slots, *, op, skip_slot=None, loc_map=None, strict=None, name="slot_mapping"):
    """Where each of the n rows goes, for a scatter with no host sync (graph-safe on CUDA).

    Returns None when nothing can be written (n == 0 or an empty cache), else (dest [n], src [n],
    any_kept 0-d bool): row i writes source row src[i] to slot dest[i]. Of rows that share a slot,
    the last one wins (``_last_per_slot``); every other row repeats the write of the first winner
    (same src, same dest), so each slot receives one row's bytes and nothing outside the written
    slots changes. With no row to write, every row targets slot 0 and the writer puts slot 0's own
    bytes back (``torch.where(any_kept, new, old)``): no byte changes. ``strict`` (default:
    ``default_strict``) raises first, as ``check_slots``."""
    strict = default_strict(index) if strict is None else strict
    if strict:
        _refuse_capture(index, name, op)
    keep, slot, checks = _slots(index, num_slots, skip_slot, loc_map, name)
    if strict:
        _raise_first(checks)
    n = index.numel()
    if n == 0 or num_slots == 0:
        return None
    keep = _last_per_slot(keep, slot)
    first = keep.to(torch.uint8).argmax().view(1)  # the first winner; 0 when no row is written
    any_kept = keep.index_select(0, first)
    dest = torch.where(keep, slot, torch.where(any_kept, slot.index_select(0, first), 0))
    src = torch.where(keep, torch.arange(n, device=index.device), first)
    return dest, src, any_kept.view(())


def _last_per_slot(keep, slot):
    """``keep`` narrowed to the last kept row of each slot (a stable sort, no host sync): scatters of
    several values (K and V, DSv4 data and scales) then never mix rows, and any index_put_ that
    races per element still writes one row's bytes."""
    key = torch.where(keep, slot, -1)
    sorted_key, order = torch.sort(key, stable=True)
    last = torch.ones_like(keep)
    last[:-1] = sorted_key[1:] != sorted_key[:-1]
    return keep & torch.empty_like(keep).index_put_((order,), last)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    """Same-width integer view: copies through it are bitwise (float8 included)."""
    return t.view(_BITS[t.element_size()])


def set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, *, skip_slot=None, strict=None):
    """kv_buffer[loc[i], :nope] = k_nope[i]; kv_buffer[loc[i], nope:nope+rope] = k_rope[i]."""
    nope = _bits(cache_k_nope.select(1, 0) if cache_k_nope.dim() == 3 else cache_k_nope)
    rope = _bits(cache_k_rope.select(1, 0) if cache_k_rope.dim() == 3 else cache_k_rope)
    buf = _bits(kv_buffer.select(1, 0) if kv_buffer.dim() == 3 else kv_buffer)[:, : nope.shape[1] + rope.shape[1]]
    plan = _plan(loc, buf.shape[0], op="set_mla_kv_buffer", skip_slot=skip_slot, strict=strict, name="loc")
    if plan is None:
        return
    dest, src, any_kept = plan
    new = torch.cat([nope.index_select(0, src), rope.index_select(0, src)], dim=1)
    buf.index_put_((dest,), torch.where(any_kept, new, buf[0]))


def quantize_fp8(x, fp8_dtype, scale):
    """stored = RNE(clamp(x / scale, ±max)) in fp32; scale a float (rounded to float32), a 1-element
    tensor, or ``[H]`` per-head scales for x of shape ``[..., H, D]`` (head h divided by scale[h])."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.full((), scale, dtype=torch.float32, device=x.device)  # a fill, not a host copy
    m = FP8_MAX[fp8_dtype]
    s = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)
    return (x.float() / s).clamp(-m, m).to(fp8_dtype)


def store_cache(
    k, v, k_cache, v_cache, slot_mapping, *, kv_cache_dtype="auto", k_scale=None, v_scale=None, loc_map=None,
    skip_slot=None, strict=None,
):
    """k_cache[slot'] = k[i], v_cache[slot'] = v[i] (quantized to fp8 when asked), docs/design.md §2-§4;
    k_scale / v_scale of ``[H]`` elements scale each head on its own (k, v as ``[n, H, D]`` or ``[n, H*D]``)."""
    num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
    plan = _plan(slot_mapping, num_slots, op="store_cache", skip_slot=skip_slot, loc_map=loc_map, strict=strict)
    if plan is None:
        return
    dest, src, any_kept = plan
    for rows, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        vals = rows.index_select(0, src)
        if kv_cache_dtype != "auto":
            if isinstance(scale, torch.Tensor) and scale.numel() > 1:  # per head: [n, H, D] rows
                vals = vals.reshape(vals.shape[0], scale.numel(), -1)
            vals = quantize_fp8(vals, FP8_DTYPES[kv_cache_dtype], scale)
        _write_rows(_bits(cache), dest, _bits(vals), any_kept)


def _write_rows(cache, dest, vals, any_kept):
    """cache[dest[i]] = vals[i] (flat, or paged [num_blocks, block_size, ...]); see ``_plan``."""
    if cache.dim() == 4:
        bs = cache.shape[1]
        index, old = (dest // bs, dest % bs), cache[0, 0]
    else:
        index, old = (dest,), cache[0]
    cache.index_put_(index, torch.where(any_kept, vals.reshape(-1, *old.shape), old))


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4 FP8 K cache (docs/design.md §5)
#
# Per group of 64 nope dims: amax = max |x| (NaN propagates); e = the smallest integer with
# 448 * 2^e >= max(amax, 1e-4), exactly via frexp: for m = f * 2^E (f in [0.5, 1)) and
# 448 = 0.875 * 2^9, e = E - 9 + (f > 0.875). A group whose amax is inf or NaN gets e = 128.
# Scale byte = e + 127 (UE8M0, clamped to [0, 255]; the 8th byte is 0). Stored = e4m3(clamp(x * 2^-e,
# ±448)) rounded to nearest even (x * 2^-e == x / 2^e exactly for finite groups); a NaN element is
# stored as 0x7F with its sign. Dequantized = bf16(float32(e4m3) * 2^(byte - 127)), exact; a NaN
# result is written as 0x7FFF (what the GPU conversion gives). Rope dims are bf16 bytes, bit-exact.


def dsv4_block_stride(block_size: int) -> int:
    """The default bytes per block: token data, then scales, rounded up to the kernels' 16-byte
    alignment (block_size * 584 for even block sizes: vLLM's allocation)."""
    return -(-block_size * DSV4_TOKEN_BYTES // 16) * 16


def _dsv4_rows(k_cache, block_size):
    """[num_blocks, block_size * 584] uint8 view of the bytes each block uses (2-D or 3-D cache)."""
    return k_cache.as_strided((k_cache.shape[0], block_size * DSV4_TOKEN_BYTES), (k_cache.stride(0), 1))


def _dsv4_columns(pos, block_size):
    """Byte columns, within a block row of ``_dsv4_rows``, of the data [m, 576] and the scales [m, 8]
    of tokens at positions ``pos`` [m, 1] of their blocks."""
    dev = pos.device
    data = pos * DSV4_DATA_BYTES + torch.arange(DSV4_DATA_BYTES, device=dev)
    scales = block_size * DSV4_DATA_BYTES + pos * DSV4_SCALE_BYTES + torch.arange(DSV4_SCALE_BYTES, device=dev)
    return data, scales


def dsv4_quantize_tokens(x):
    """x bf16 [m, 512] -> (data uint8 [m, 576], scales uint8 [m, 8])."""
    m = x.shape[0]
    groups = DSV4_NOPE // DSV4_GROUP
    nope = x[:, :DSV4_NOPE].reshape(m, groups, DSV4_GROUP)
    bits = nope.contiguous().view(torch.int16).to(torch.int32)
    amax = ((bits & 0x7FFF).amax(-1) << 16).view(torch.float32)  # bf16 magnitude, NaN propagates
    mant, exp = torch.frexp(torch.clamp(amax, min=1e-4))
    e = exp - 9 + (mant > 0.875).to(exp.dtype)
    e = torch.where(torch.isfinite(amax), e, torch.full_like(e, 128)).to(torch.int64)
    scale_bytes = (e + 127).clamp(0, 255).to(torch.uint8)
    inv = torch.pow(2.0, -e.to(torch.float64)).unsqueeze(-1)  # 2^-128 is a float32 denormal: exact
    q = (nope.to(torch.float64) * inv).to(torch.float32).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    nan_byte = (0x7F | ((bits >> 8) & 0x80)).to(torch.uint8)
    q = torch.where(torch.isnan(nope), nan_byte, q).reshape(m, DSV4_NOPE)
    data = torch.cat([q, x[:, DSV4_NOPE:].contiguous().view(torch.uint8)], dim=1)
    scales = torch.cat([scale_bytes, torch.zeros(m, 1, dtype=torch.uint8, device=x.device)], dim=1)
    return data, scales


def dsv4_dequantize_tokens(data, scales):
    """(data uint8 [m, 576], scales uint8 [m, 8]) -> bf16 [m, 512]."""
    m = data.shape[0]
    groups = DSV4_NOPE // DSV4_GROUP
    fp8 = data[:, :DSV4_NOPE].contiguous().view(torch.float8_e4m3fn).to(torch.float32).reshape(m, groups, DSV4_GROUP)
    b = scales[:, :groups].to(torch.int32)
    scale = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23).view(torch.float32)  # 2^(b - 127)
    val = (fp8 * scale.unsqueeze(-1)).to(torch.bfloat16).reshape(m, DSV4_NOPE)
    nan = torch.full((), 0x7FFF, dtype=torch.int16, device=data.device).view(torch.bfloat16)  # a fill, not a host copy
    val = torch.where(torch.isnan(val), nan, val)
    return torch.cat([val, data[:, DSV4_NOPE:].contiguous().view(torch.bfloat16)], dim=1)


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, *, block_size=64, strict=None):
    """Quantize k [n', 512] bf16 into the DSv4 FP8 K cache at slot_mapping (slot < 0 skipped)."""
    rows = _dsv4_rows(k_cache, block_size)
    plan = _plan(slot_mapping, rows.shape[0] * block_size, op="quantize_and_insert_k_cache", strict=strict)
    if plan is None:
        return
    dest, src, any_kept = plan
    data, scales = dsv4_quantize_tokens(k.index_select(0, src))
    blk = (dest // block_size).unsqueeze(1)
    data_cols, scale_cols = _dsv4_columns((dest % block_size).unsqueeze(1), block_size)
    for cols, new in ((data_cols, data), (scale_cols, scales)):  # slot 0 is at cols[0] when none is kept
        rows.index_put_((blk, cols), torch.where(any_kept, new, rows[0].index_select(0, cols[0])))


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset=0):
    """out[r, offset + i] = dequant(token seq_len - gather_len + i of request r), docs/design.md §5.

    Positions whose block-table entry is < 0, >= num_blocks or past the table yield zero rows; rows
    at or past out.shape[1] are not written. No host sync (graph-safe on CUDA)."""
    num_reqs, n_rows = out.shape[0], out.shape[1] - offset
    if num_reqs == 0 or n_rows <= 0:
        return
    dev = out.device
    rows = _dsv4_rows(k_cache, block_size)
    seq = seq_lens.to(torch.int64).unsqueeze(1)
    gl = (gather_lens if gather_lens is not None else seq_lens).to(torch.int64).unsqueeze(1)
    i = torch.arange(n_rows, device=dev).unsqueeze(0)
    write = i < gl  # [R, n_rows]
    pos = seq - gl + i
    blk = torch.div(pos, block_size, rounding_mode="floor")
    max_blocks = block_table.shape[1]
    valid = write & (pos >= 0) & (blk < max_blocks)
    if max_blocks > 0:
        phys = torch.gather(block_table.to(torch.int64), 1, blk.clamp(0, max_blocks - 1))
    else:
        phys = torch.full_like(blk, -1)
    valid &= (phys >= 0) & (phys < rows.shape[0])
    if rows.shape[0] == 0:  # an empty cache: every position reads as a zero row
        val = torch.zeros(num_reqs, n_rows, 512, dtype=torch.bfloat16, device=dev)
    else:
        phys = torch.where(valid, phys, torch.zeros_like(phys)).reshape(-1, 1)
        row = torch.where(valid, pos % block_size, torch.zeros_like(pos)).reshape(-1, 1)
        data_cols, scale_cols = _dsv4_columns(row, block_size)
        val = dsv4_dequantize_tokens(rows[phys, data_cols], rows[phys, scale_cols]).reshape(num_reqs, n_rows, 512)
        val = torch.where(valid.unsqueeze(-1), val, torch.zeros_like(val))
    dst = out[:, offset:]
    dst.copy_(torch.where(write.unsqueeze(-1), val, dst))
