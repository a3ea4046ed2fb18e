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

from .codes import FP8_DTYPES, FP8_MAX, KV_FORMATS, DsMla, Dsv4, Indexer


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


def set_mla_kv_buffer(
    kv_buffer, loc, cache_k_nope, cache_k_rope, *, kv_cache_dtype="auto", scale=None, skip_slot=None, strict=None
):
    """kv_buffer[loc[i], :nope] = k_nope[i]; kv_buffer[loc[i], nope:nope+rope] = k_rope[i], copied, or
    quantized for an fp8 kv_cache_dtype (``set_mla_kv_buffer_fp8``)."""
    if kv_cache_dtype != "auto":
        set_mla_kv_buffer_fp8(
            kv_buffer,
            loc,
            cache_k_nope,
            cache_k_rope,
            kv_cache_dtype=kv_cache_dtype,
            scale=scale,
            skip_slot=skip_slot,
            strict=strict,
        )
        return
    nope = _bits(cache_k_nope.select(1, 0) if cache_k_nope.dim() == 3 else cache_k_nope)
    rope = _bits(cache_k_rope.select(1, 0) if cache_k_rope.dim() == 3 else cache_k_rope)
    buf = _bits(kv_buffer.select(1, 0) if kv_buffer.dim() == 3 else kv_buffer)[:, : nope.shape[1] + rope.shape[1]]
    plan = _plan(loc, buf.shape[0], op="set_mla_kv_buffer", skip_slot=skip_slot, strict=strict, name="loc")
    if plan is None:
        return
    dest, src, any_kept = plan
    new = torch.cat([nope.index_select(0, src), rope.index_select(0, src)], dim=1)
    buf.index_put_((dest,), torch.where(any_kept, new, buf[0]))


def set_mla_kv_buffer_fp8(
    kv_buffer, loc, cache_k_nope, cache_k_rope, *, kv_cache_dtype, scale=None, skip_slot=None, strict=None
):
    """``set_mla_kv_buffer`` quantizing on write: "fp8"/"fp8_e4m3"/"fp8_e5m2" store
    ``quantize_fp8(row, scale)`` of the nope then the rope values (one byte each); "fp8_ds_mla" stores
    the 656-byte record of ``ds_mla_records``. kv_buffer is 1-byte ``[num_slots, W]`` or ``[num_slots, 1, W]``."""
    nope = cache_k_nope.select(1, 0) if cache_k_nope.dim() == 3 else cache_k_nope
    rope = cache_k_rope.select(1, 0) if cache_k_rope.dim() == 3 else cache_k_rope
    buf = (kv_buffer.select(1, 0) if kv_buffer.dim() == 3 else kv_buffer).view(torch.uint8)
    plan = _plan(loc, buf.shape[0], op="set_mla_kv_buffer", skip_slot=skip_slot, strict=strict, name="loc")
    if plan is None:
        return
    dest, src, any_kept = plan
    nope, rope = nope.index_select(0, src), rope.index_select(0, src)
    if kv_cache_dtype == "fp8_ds_mla":
        new = ds_mla_records(nope, rope)
    else:
        fp8 = FP8_DTYPES[KV_FORMATS[kv_cache_dtype]]
        new = torch.cat([quantize_fp8(nope, fp8, scale), quantize_fp8(rope, fp8, scale)], dim=1).view(torch.uint8)
    buf = buf[:, : new.shape[1]]
    buf.index_put_((dest,), torch.where(any_kept, new, buf[0]))


def ds_mla_records(nope, rope):
    """nope [m, 512], rope [m, 64] (bf16 or fp16) -> the fp8_ds_mla records, uint8 [m, 656].

    vLLM's concat_and_cache_ds_mla: per tile of 128 nope values, amax = the largest |x| (NaN
    ignored, inf kept), scale = max(amax / 448, FLT_MIN) with a true fp32 division, each value
    stored as e4m3(clamp(x / scale, ±448)) rounded to nearest even; then the 4 scales as fp32, then
    the rope values' 16-bit patterns unchanged (fp16 sources keep fp16 rope)."""
    m = nope.shape[0]
    x = nope.float().view(m, DsMla.TILES, DsMla.TILE)
    amax = torch.where(torch.isnan(x), 0.0, x.abs()).amax(-1)
    # A tensor divisor: torch turns division by a Python scalar on CUDA into a multiply by its reciprocal.
    scale = (amax / torch.full_like(amax, 448.0)).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).view(m, DsMla.NOPE)
    return torch.cat([q, scale.view(torch.uint8), rope.contiguous().view(torch.uint8)], dim=1)


def quantize_fp8(x, fp8_dtype, scale):
    """stored = RNE(clamp(x / scale, ±max)) in fp32; scale a float (rounded to float32), a 1-element
    tensor, or ``[H]`` per-head scales for x of shape ``[..., H, D]`` (head h divided by scale[h])."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.full((), scale, dtype=torch.float32, device=x.device)  # a fill, not a host copy
    m = FP8_MAX[fp8_dtype]
    s = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)
    return (x.float() / s).clamp(-m, m).to(fp8_dtype)


def store_cache(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    kv_cache_dtype="auto",
    k_scale=None,
    v_scale=None,
    loc_map=None,
    skip_slot=None,
    strict=None,
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
            vals = quantize_fp8(vals, FP8_DTYPES[KV_FORMATS[kv_cache_dtype]], scale)
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


def _dsv4_rows(k_cache, block_size):
    """[num_blocks, block_size * 584] uint8 view of the bytes each block uses (2-D or 3-D cache)."""
    return k_cache.as_strided((k_cache.shape[0], block_size * Dsv4.TOKEN_BYTES), (k_cache.stride(0), 1))


def _dsv4_columns(pos, block_size):
    """Byte columns, within a block row of ``_dsv4_rows``, of the data [m, 576] and the scales [m, 8]
    of tokens at positions ``pos`` [m, 1] of their blocks."""
    dev = pos.device
    data = pos * Dsv4.DATA_BYTES + torch.arange(Dsv4.DATA_BYTES, device=dev)
    scales = block_size * Dsv4.DATA_BYTES + pos * Dsv4.SCALE_BYTES + torch.arange(Dsv4.SCALE_BYTES, device=dev)
    return data, scales


def dsv4_quantize_tokens(x):
    """x bf16 [m, 512] -> (data uint8 [m, 576], scales uint8 [m, 8])."""
    m = x.shape[0]
    groups = Dsv4.NOPE // Dsv4.GROUP
    nope = x[:, : Dsv4.NOPE].reshape(m, groups, Dsv4.GROUP)
    bits = nope.contiguous().view(torch.int16).to(torch.int32)
    amax = ((bits & 0x7FFF).amax(-1) << 16).view(torch.float32)  # bf16 magnitude, NaN propagates
    mant, exp = torch.frexp(torch.clamp(amax, min=1e-4))
    e = exp - 9 + (mant > 0.875).to(exp.dtype)
    e = torch.where(torch.isfinite(amax), e, torch.full_like(e, 128)).to(torch.int64)
    scale_bytes = (e + 127).clamp(0, 255).to(torch.uint8)
    inv = torch.pow(2.0, -e.to(torch.float64)).unsqueeze(-1)  # 2^-128 is a float32 denormal: exact
    q = (nope.to(torch.float64) * inv).to(torch.float32).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    nan_byte = (0x7F | ((bits >> 8) & 0x80)).to(torch.uint8)
    q = torch.where(torch.isnan(nope), nan_byte, q).reshape(m, Dsv4.NOPE)
    data = torch.cat([q, x[:, Dsv4.NOPE :].contiguous().view(torch.uint8)], dim=1)
    scales = torch.cat([scale_bytes, torch.zeros(m, 1, dtype=torch.uint8, device=x.device)], dim=1)
    return data, scales


def dsv4_dequantize_tokens(data, scales):
    """(data uint8 [m, 576], scales uint8 [m, 8]) -> bf16 [m, 512]."""
    m = data.shape[0]
    groups = Dsv4.NOPE // Dsv4.GROUP
    fp8 = data[:, : Dsv4.NOPE].contiguous().view(torch.float8_e4m3fn).to(torch.float32).reshape(m, groups, Dsv4.GROUP)
    b = scales[:, :groups].to(torch.int32)
    scale = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23).view(torch.float32)  # 2^(b - 127)
    val = (fp8 * scale.unsqueeze(-1)).to(torch.bfloat16).reshape(m, Dsv4.NOPE)
    nan = torch.full((), 0x7FFF, dtype=torch.int16, device=data.device).view(torch.bfloat16)  # a fill, not a host copy
    val = torch.where(torch.isnan(val), nan, val)
    return torch.cat([val, data[:, Dsv4.NOPE :].contiguous().view(torch.bfloat16)], dim=1)


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


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3.2 indexer K cache (docs/design.md §5.1)
#
# Per token: amax = max |x| over the 128 dims, NaN elements ignored (vLLM's fmaxf reduction); scale =
# max(amax, 1e-4) / 448 as a true fp32 division; with scale_fmt "ue8m0" rounded up to a power of two
# exactly (the float's exponent, plus one when its mantissa is not zero). Stored = e4m3(clamp(x /
# scale, ±448)) rounded to nearest even, and the fp32 scale's 4 bytes. The gather copies bytes.


def _indexer_rows(kv_cache, block_size):
    """[num_blocks, block_size * 132] uint8 view of the bytes each block uses (2-D or 3-D cache)."""
    return kv_cache.as_strided((kv_cache.shape[0], block_size * Indexer.TOKEN_BYTES), (kv_cache.stride(0), 1))


def _indexer_columns(pos, block_size):
    """Byte columns, within a block row of ``_indexer_rows``, of the values [m, 128] and the scale
    [m, 4] of tokens at positions ``pos`` [m, 1] of their blocks."""
    dev = pos.device
    data = pos * Indexer.HEAD_DIM + torch.arange(Indexer.HEAD_DIM, device=dev)
    scale = block_size * Indexer.HEAD_DIM + pos * Indexer.SCALE_BYTES + torch.arange(Indexer.SCALE_BYTES, device=dev)
    return data, scale


def indexer_quantize_tokens(x, ue8m0=False):
    """x bf16/fp16 [m, 128] -> (e4m3 bytes uint8 [m, 128], fp32 scale bytes uint8 [m, 4])."""
    xf = x.float()
    mag = xf.abs()
    amax = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag).amax(-1)
    # A 0-dim device tensor, not a Python float: CUDA divides by a CPU scalar as a * (1 / b).
    scale = amax.clamp(min=Indexer.AMAX_MIN) / torch.full((), Indexer.FP8_MAX, device=x.device)
    if ue8m0:  # scale > 0, at most inf: no carry into the sign bit
        scale = ((scale.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    q = (xf / scale.unsqueeze(1)).clamp(-Indexer.FP8_MAX, Indexer.FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale.view(torch.uint8).view(-1, Indexer.SCALE_BYTES)


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, *, block_size, scale_fmt=None, strict=None):
    """Quantize k [n', 128] into the indexer K cache at slot_mapping (slot < 0 skipped)."""
    rows = _indexer_rows(kv_cache, block_size)
    plan = _plan(slot_mapping, rows.shape[0] * block_size, op="indexer_k_quant_and_cache", strict=strict)
    if plan is None:
        return
    dest, src, any_kept = plan
    data, scale = indexer_quantize_tokens(k.index_select(0, src), scale_fmt == "ue8m0")
    blk = (dest // block_size).unsqueeze(1)
    data_cols, scale_cols = _indexer_columns((dest % block_size).unsqueeze(1), block_size)
    for cols, new in ((data_cols, data), (scale_cols, scale)):  # slot 0 is at cols[0] when none is kept
        rows.index_put_((blk, cols), torch.where(any_kept, new, rows[0].index_select(0, cols[0])))


def indexer_scale_bytes(dst_scale):
    """The [T, 4] uint8 view of a gather's scale output (float32 [T] or [T, 1], or uint8 [T, 4])."""
    if dst_scale.dtype == torch.uint8:
        return dst_scale
    return (dst_scale if dst_scale.dim() == 2 else dst_scale.unsqueeze(1)).view(torch.uint8)


def gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, *, block_size):
    """dst_k[t], dst_scale[t] = the bytes of token t - cu_seq_lens[b] of request b, for the b with
    cu_seq_lens[b] <= t < cu_seq_lens[b + 1] (docs/design.md §5.1); rows no request covers are not
    written; a block-table entry < 0, >= num_blocks or past the table gives zero bytes. No host sync."""
    num_tokens, batch = dst_k.shape[0], block_table.shape[0]
    if num_tokens == 0 or batch == 0:
        return
    dev = dst_k.device
    rows = _indexer_rows(kv_cache, block_size)
    cu = cu_seq_lens.to(torch.int64)
    t = torch.arange(num_tokens, device=dev)
    after = torch.searchsorted(cu, t, right=True)  # the first entry > t: request after - 1 covers t
    write = (after >= 1) & (after <= batch)
    b = (after - 1).clamp(0, batch - 1)
    i = t - cu.index_select(0, b)
    j = torch.div(i, block_size, rounding_mode="floor")
    max_blocks = block_table.shape[1]
    valid = write & (j < max_blocks)
    if max_blocks > 0:
        phys = block_table.to(torch.int64)[b, j.clamp(0, max_blocks - 1)]
    else:
        phys = torch.full_like(j, -1)
    valid &= (phys >= 0) & (phys < rows.shape[0])
    if rows.shape[0] == 0:  # an empty cache: every token reads as zero bytes
        data = torch.zeros(num_tokens, Indexer.HEAD_DIM, dtype=torch.uint8, device=dev)
        scale = torch.zeros(num_tokens, Indexer.SCALE_BYTES, dtype=torch.uint8, device=dev)
    else:
        phys = torch.where(valid, phys, torch.zeros_like(phys)).unsqueeze(1)
        pos = torch.where(valid, i % block_size, torch.zeros_like(i)).unsqueeze(1)
        data_cols, scale_cols = _indexer_columns(pos, block_size)
        keep = valid.unsqueeze(1)
        data = torch.where(keep, rows[phys, data_cols], 0)
        scale = torch.where(keep, rows[phys, scale_cols], 0)
    write = write.unsqueeze(1)
    for dst, new in ((dst_k.view(torch.uint8), data), (indexer_scale_bytes(dst_scale), scale)):
        dst.copy_(torch.where(write, new, dst))


# Paged MLA gather (gather_mla_cache)
#
# Output row t belongs to request r, the largest r < num_reqs with cu_seq_lens[r] <= t, when t <
# cu_seq_lens[r + 1]; it is token i = t - cu_seq_lens[r] of the request, at position p = seq_starts[r] + i
# (seq_starts None: p = i) of its block table: block block_table[r, p // block_size], row p % block_size.
# A position < 0, past the table's width, or whose block entry is < 0 or >= num_blocks gives a zero row.
# Rows no request covers are not written; out.shape[0] is the total (rows past it are clipped).
# Formats: "auto" copies the bytes; "fp8_e4m3"/"fp8_e5m2": bf16(float(x) * scale); "fp8_ds_mla":
# bf16(float(e4m3) * tile scale) for the 512 nope dims, the 64 rope dims copied. A NaN result is
# written as 0x7FFF (what the GPU conversion gives).

_BF16_NAN = 0x7FFF


def check_gather_rows(cu_seq_lens, rows, *, op="gather_mla_cache"):
    """Raise ValueError before anything is written when cu_seq_lens does not describe rows of ``out``:
    where it decreases, where a request starts below row 0 or ends past ``rows``. Reads
    cu_seq_lens on the host (a CUDA sync: refused during graph capture, as ``check_slots``)."""
    _refuse_capture(cu_seq_lens, "cu_seq_lens", op)
    cu = cu_seq_lens.long().cpu()
    down = (cu[1:] < cu[:-1]).nonzero()
    if down.numel():
        i = int(down[0, 0])
        raise ValueError(
            f"{op}: cu_seq_lens: expected non-decreasing values, got {int(cu[i])} then {int(cu[i + 1])} "
            f"at positions {i}, {i + 1}"
        )
    if cu.numel() and int(cu[0]) < 0:
        raise ValueError(f"{op}: cu_seq_lens: request 0 starts at row {int(cu[0])}, below row 0 of out")
    if cu.numel() and int(cu[-1]) > rows:
        raise ValueError(f"{op}: out: has {rows} rows, but the requests end at row {int(cu[-1])} (cu_seq_lens[-1])")


def _gather_plan(rows, block_table, cu_seq_lens, seq_starts, block_size, num_blocks):
    """Per output row t < rows: (write [T] bool, valid [T] bool, block [T], row in block [T]); valid
    rows read the cache, written rows that are not valid become zero rows. No host sync."""
    dev = cu_seq_lens.device
    cu = cu_seq_lens.long()
    num_reqs = cu.numel() - 1
    t = torch.arange(rows, device=dev)
    req = torch.searchsorted(cu[1:num_reqs].contiguous(), t, right=True)  # largest r with cu[r] <= t
    start = cu.index_select(0, req)
    write = (t >= start) & (t < cu.index_select(0, req + 1))
    pos = t - start
    if seq_starts is not None:
        pos = pos + seq_starts.long().index_select(0, req)
    blk = torch.div(pos, block_size, rounding_mode="floor")
    max_blocks = block_table.shape[1]
    valid = write & (pos >= 0) & (blk < max_blocks)
    if max_blocks:
        phys = block_table.long()[req, blk.clamp(0, max_blocks - 1)]
    else:
        phys = torch.full_like(blk, -1)
    valid &= (phys >= 0) & (phys < num_blocks)
    zero = torch.zeros_like(phys)
    return write, valid, torch.where(valid, phys, zero), torch.where(valid, pos - blk * block_size, zero)


def _bf16_nan_canonical(x):
    """fp32 -> bf16 (round to nearest even), NaN as 0x7FFF."""
    nan = torch.full((), _BF16_NAN, dtype=torch.int16, device=x.device).view(torch.bfloat16)  # a fill, not a host copy
    return torch.where(torch.isnan(x), nan, x.to(torch.bfloat16))


def _scale_tensor(scale, device):
    if isinstance(scale, torch.Tensor):
        return scale.reshape(())
    return torch.full((), scale, dtype=torch.float32, device=device)  # a fill, not a host copy


def dequantize_mla_rows(rows, kv_cache_dtype, scale=None):
    """Cache entries [m, W] (as stored, any dtype of their width) -> output rows: the same bits for
    "auto", bf16 otherwise."""
    if kv_cache_dtype == "auto":
        return rows
    u8 = rows.contiguous().view(torch.uint8)
    if kv_cache_dtype == "fp8_ds_mla":
        m = u8.shape[0]
        nope = u8[:, : DsMla.NOPE].contiguous().view(torch.float8_e4m3fn).float().view(m, -1, DsMla.TILE)
        scales = u8[:, DsMla.SCALE_OFFSET : DsMla.ROPE_OFFSET].contiguous().view(torch.float32)
        nope = _bf16_nan_canonical(nope * scales.unsqueeze(-1)).view(m, DsMla.NOPE)
        return torch.cat([nope, u8[:, DsMla.ROPE_OFFSET : DsMla.BYTES].contiguous().view(torch.bfloat16)], dim=1)
    x = u8.view(FP8_DTYPES[KV_FORMATS[kv_cache_dtype]]).float()
    return _bf16_nan_canonical(x * _scale_tensor(scale, rows.device))


def gather_mla_cache(
    out, kv_cache, block_table, cu_seq_lens, *, seq_starts=None, kv_cache_dtype="auto", scale=None, strict=None
):
    """out[t] = the cache entry of output row t, converted per kv_cache_dtype (see the block comment
    above). ``strict`` (default: CPU or JITKV_DEBUG=1) first raises as ``check_gather_rows``."""
    strict = default_strict(cu_seq_lens) if strict is None else strict
    if strict:
        check_gather_rows(cu_seq_lens, out.shape[0])
    if out.shape[0] == 0 or cu_seq_lens.numel() < 2:
        return
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    write, valid, blk, row = _gather_plan(out.shape[0], block_table, cu_seq_lens, seq_starts, block_size, num_blocks)
    dst = _bits(out)
    if num_blocks == 0:  # an empty cache: every written row is a zero row
        val = torch.zeros_like(dst)
    else:
        val = _bits(dequantize_mla_rows(_bits(kv_cache)[blk, row], kv_cache_dtype, scale))
        val = torch.where(valid.unsqueeze(1), val, 0)
    dst.copy_(torch.where(write.unsqueeze(1), val, dst))


# ---------------------------------------------------------------------------------------------
# The attention prologue: RoPE, optional QK-RMSNorm, FP8 quantize, KV write (docs/design.md §9)
#
# In float32 with one rounding at each store. RMSNorm sums the squares in a fixed order (each group of
# 8 dims folded by halves, then the group sums folded by halves), so every backend gives the same
# bits; RoPE rounds each product before the sum or difference (no fused multiply-add). Divisions are
# by tensors: torch turns division by a Python scalar on CUDA into a multiply by its reciprocal.


def _fold_by_halves(x):
    """Sum over the last dim of x (a power of two wide) as a[j] + a[j + w/2], repeated."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def rms_norm_fixed_order(x, weight, eps):
    """x float32 [..., D] (D a multiple of 8) -> (x * r) * weight, r = 1 / sqrt(mean(x^2) + eps) with
    the squares summed in docs/design.md §9's order; weight [D] (any float dtype, read as float32)."""
    d = x.shape[-1]
    groups = _fold_by_halves((x * x).reshape(*x.shape[:-1], d // 8, 8))  # [..., D/8]
    pad = (1 << (d // 8 - 1).bit_length()) - d // 8
    if pad:
        groups = torch.cat([groups, groups.new_zeros(*groups.shape[:-1], pad)], dim=-1)
    total = _fold_by_halves(groups)
    # The division, sqrt and reciprocal in float64, each rounded to float32: exactly the float32 IEEE
    # results (float64 holds more than twice float32's precision), where torch's CPU sqrt is not
    # correctly rounded and a division by a scalar may become a multiply by its reciprocal.
    mean = (total.double() / d).float()
    root = torch.sqrt((mean + eps).double()).float()
    r = (1.0 / root.double()).float()
    return (x * r.unsqueeze(-1)) * weight.float()


def apply_rope(y, cos, sin, is_neox):
    """y float32 [T, H, D], cos/sin float32 [T, R/2] -> y with its first R dims rotated (NeoX halves,
    or GPT-J pairs), each product rounded before the sum or difference; dims >= R pass through."""
    half = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    if is_neox:
        a, b = y[..., :half], y[..., half : 2 * half]
        rotated = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    else:
        a, b = y[..., 0 : 2 * half : 2], y[..., 1 : 2 * half : 2]
        rotated = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    return torch.cat([rotated, y[..., 2 * half :]], dim=-1)


def check_positions(positions, n, max_pos, *, op="jitkv"):
    """Raise IndexError naming the first of positions[:n] outside [0, max_pos) (host read: a CUDA
    sync, refused during graph capture as ``check_slots``)."""
    _refuse_capture(positions, "positions", op)
    p = positions[:n].long()
    bad = (p < 0) | (p >= max_pos)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"{op}: positions: position {i} has value {int(p[i])}, out of range for a cos_sin_cache "
            f"of {max_pos} positions"
        )


def rope_rows(x, positions, cos_sin_cache, *, is_neox, rotary_dim=None, norm_weight=None, eps=1e-6):
    """x [T, H, D] (any float dtype), positions [>= T] -> float32 [T, H, D]: RMSNorm (when a weight
    is given), then RoPE at each token's position. A position outside [0, max_pos) is clamped into it
    (what a CUDA kernel does; strict callers raise first)."""
    t = x.shape[0]
    rot = cos_sin_cache.shape[1] if rotary_dim is None else rotary_dim
    p = positions[:t].long().clamp(0, max(cos_sin_cache.shape[0] - 1, 0))
    cs = cos_sin_cache.index_select(0, p).float()
    y = x.float()
    if norm_weight is not None:
        y = rms_norm_fixed_order(y, norm_weight, eps)
    return apply_rope(y, cs[:, : rot // 2], cs[:, rot // 2 : rot], is_neox)


def _head_dim(q, k, k_cache, rotary_dim, cos_sin_cache):
    for t, dims in ((q, (3,)), (k, (3,)), (k_cache, (3, 4))):
        if t.dim() in dims:
            return t.shape[-1]
    return cos_sin_cache.shape[1] if rotary_dim is None else rotary_dim


def _heads(t, d):
    """[n', H, D] view of a [n', H, D] or [n', H*D] tensor."""
    return t if t.dim() == 3 else t.view(t.shape[0], -1, d)


def _store_rows(dst, rows, scale):
    """dst[:n] = rows (float32 [n, H, D]) rounded to dst's dtype, or fp8(clamp(rows / scale, ±max))."""
    vals = quantize_fp8(rows, dst.dtype, scale) if dst.dtype in FP8_MAX else rows.to(dst.dtype)
    dst[: rows.shape[0]].copy_(vals.reshape(dst[: rows.shape[0]].shape))


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
    strict=None,
):
    """The first n = slot_mapping.numel() rows of q and k normed (with a weight) and rotated: q in
    place or into q_out, k into k_out (if given); rotated K and V written as ``store_cache`` writes
    them (docs/design.md §9). ``strict``: positions and slots raise IndexError before any write."""
    n = slot_mapping.numel()
    strict = default_strict(slot_mapping) if strict is None else strict
    if strict:
        check_positions(positions, n, cos_sin_cache.shape[0], op="rope_store_cache")
        num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
        check_slots(slot_mapping, num_slots, skip_slot=skip_slot, loc_map=loc_map, op="rope_store_cache")
    if n == 0:
        return
    d = _head_dim(q, k, k_cache, rotary_dim, cos_sin_cache)
    q3, k3 = _heads(q, d), _heads(k, d)
    kw = dict(is_neox=is_neox, rotary_dim=rotary_dim, eps=eps)
    qr = rope_rows(q3[:n], positions, cos_sin_cache, norm_weight=q_norm_weight, **kw)
    kr = rope_rows(k3[:n], positions, cos_sin_cache, norm_weight=k_norm_weight, **kw)
    _store_rows(q3 if q_out is None else _heads(q_out, d), qr, q_scale)
    if k_out is not None:
        _store_rows(_heads(k_out, d), kr, None)
    k_src = kr.to(k.dtype) if kv_cache_dtype == "auto" else kr  # fp8 quantizes the float32 result
    store_cache(
        k_src,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        loc_map=loc_map,
        skip_slot=skip_slot,
        strict=False,
    )


def _rows_2d(t):
    return t.select(1, 0) if t.dim() == 3 else t


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
    strict=None,
):
    """The first n = loc.numel() rows: k_pe rotated, ``[kv_c | rope(k_pe)]`` written as
    ``set_mla_kv_buffer`` writes it (fp8_ds_mla from rope(k_pe) rounded to k_pe's dtype, the other
    fp8 formats from the float32 result); q_pe rotated in place, or ``q_out = [q_nope | rope(q_pe)]``;
    k_pe_out (if given) = rope(k_pe) (docs/design.md §9)."""
    n = loc.numel()
    strict = default_strict(loc) if strict is None else strict
    buf = _rows_2d(kv_buffer)
    if strict:
        check_positions(positions, n, cos_sin_cache.shape[0], op="rope_set_mla_kv_buffer")
        check_slots(loc, buf.shape[0], skip_slot=skip_slot, name="loc", op="rope_set_mla_kv_buffer")
    if n == 0:
        return
    k2 = _rows_2d(k_pe)
    kr = rope_rows(k2[:n].unsqueeze(1), positions, cos_sin_cache, is_neox=is_neox)[:, 0]
    if q_pe is not None:
        qr = rope_rows(q_pe[:n], positions, cos_sin_cache, is_neox=is_neox)
        if q_out is None:
            _store_rows(q_pe, qr, None)
        else:
            nope = q_nope.shape[-1]
            _store_rows(q_out[..., :nope], q_nope[:n].float(), q_scale)
            _store_rows(q_out[..., nope:], qr, q_scale)
    if k_pe_out is not None:
        _store_rows(_rows_2d(k_pe_out), kr, None)
    rope = kr if kv_cache_dtype not in ("auto", "fp8_ds_mla") else kr.to(k_pe.dtype)
    set_mla_kv_buffer(
        buf, loc, _rows_2d(kv_c), rope, kv_cache_dtype=kv_cache_dtype, scale=scale, skip_slot=skip_slot, strict=False
    )


# ---------------------------------------------------------------------------------------------
# transfer_pages (docs/design.md §2): pools [num_layers, num_pages, *page] with a dense page part,
# moved as bytes [num_layers, num_pages, page_bytes].


def page_bytes_view(pool):
    """A pool as bytes ``[num_layers, num_pages, page_bytes]``: a view (the page part is dense), for any
    strides of dims 0 and 1 (a page-first pool given as its ``transpose(0, 1)``)."""
    return pool.view(pool.shape[0], pool.shape[1], pool[0, 0].numel() if pool.numel() else -1).view(torch.uint8)


def _page_plan(src_pages, dst_pages, src_count, dst_count, strict, op):
    """(keep [n] bool, src [n], dst [n]) on the ids' device with no host sync: a pair with a negative id
    is padding; one with an id past its pool is skipped, or raises IndexError first when ``strict``."""
    s, d = src_pages.long(), dst_pages.long()
    keep = (s >= 0) & (d >= 0)
    checks = [
        (
            keep & (s >= src_count),
            s,
            f"src_pages: position {{i}} has page {{v}}, out of range for a pool of {src_count} pages",
        ),
        (
            keep & (d >= dst_count),
            d,
            f"dst_pages: position {{i}} has page {{v}}, out of range for a pool of {dst_count} pages",
        ),
    ]
    if strict:
        _refuse_capture(src_pages, "src_pages", op)
        for oob, values, message in checks:
            if bool(oob.any()):
                i = int(oob.nonzero()[0, 0])
                raise IndexError(f"{op}: " + message.format(i=i, v=int(values[i])))
    return keep & (s < src_count) & (d < dst_count), s, d


def check_pages(src_pages, dst_pages, src_count, dst_count, *, op="transfer_pages"):
    """Raise IndexError naming the first pair whose page is past its pool (pairs with a negative id are
    padding). Reads the ids on the host: a CUDA sync, refused during graph capture (``check_slots``)."""
    _page_plan(src_pages, dst_pages, src_count, dst_count, True, op)


def transfer_pages(src, dst, src_pages, dst_pages, *, max_sms=None, strict=None):
    """Page ``src_pages[i]`` of every layer of ``src`` to page ``dst_pages[i]`` of ``dst``, as bytes.
    ``max_sms`` (the CUDA kernel's SM bound) is accepted and ignored.

    Pairs with a negative id are skipped; out-of-range ids raise IndexError first (``strict``, the
    default on CPU ids and under JITKV_DEBUG=1) or are skipped. Of pairs naming one destination page
    the last wins (``_last_per_slot``); every other pair repeats the first winner's copy, and with no
    pair to copy page 0 of dst gets its own bytes back (see ``_plan``). Graph-safe when both pools are
    on the ids' device; a CPU pool against CUDA ids reads the plan on the host (a sync: the CUDA kernels
    of this op do not)."""
    strict = default_strict(src_pages) if strict is None else strict
    src_b, dst_b = page_bytes_view(src), page_bytes_view(dst)
    num_src, num_dst = src_b.shape[1], dst_b.shape[1]
    keep, s, d = _page_plan(src_pages, dst_pages, num_src, num_dst, strict, "transfer_pages")
    n = src_pages.numel()
    if n == 0 or num_src == 0 or num_dst == 0 or src_b.shape[0] == 0 or src_b.shape[2] == 0:
        return
    keep = _last_per_slot(keep, d)
    first = keep.to(torch.uint8).argmax().view(1)  # the first winner; 0 when no pair is copied
    any_kept = keep.index_select(0, first)
    dest = torch.where(keep, d, torch.where(any_kept, d.index_select(0, first), 0))
    from_ = torch.where(keep, s, torch.where(any_kept, s.index_select(0, first), 0))
    vals = src_b.index_select(1, from_.to(src_b.device)).to(dst_b.device)
    old = dst_b.select(1, 0).unsqueeze(1)
    dst_b.index_copy_(1, dest.to(dst_b.device), torch.where(any_kept.to(dst_b.device), vals, old))
