"""Pure-torch reference of every jitkv op (DESIGN §2-§5).

Used by the tests as ground truth and as the last-resort ``torch`` backend. Arguments are assumed
valid (the op wrappers validate first). Copies go through uint8 views so they are bitwise and work
for float8 dtypes, which torch cannot index-put on every device.
"""

from __future__ import annotations

import os

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# DeepSeek-V4 FP8 K cache record (DESIGN §5).
DSV4_HEAD_DIM = 512
DSV4_NOPE = 448  # dims stored as e4m3, one UE8M0 scale per 64
DSV4_ROPE = 64  # dims stored as bf16
DSV4_DATA_BYTES = DSV4_NOPE + 2 * DSV4_ROPE  # 576
DSV4_SCALE_BYTES = 8  # 7 used + 1 zero byte
DSV4_TOKEN_BYTES = DSV4_DATA_BYTES + DSV4_SCALE_BYTES  # 584
DSV4_GROUP = 64


def valid_rows(index, num_slots, *, skip_slot=None, loc_map=None, strict=None, name="slot_mapping"):
    """(slots, rows) to write: rows i of the sources whose slot survives the padding rules of DESIGN §3.

    Out-of-range slots raise IndexError when ``strict`` (default: CPU or JITKV_DEBUG=1), else are dropped."""
    if strict is None:
        strict = index.device.type == "cpu" or os.environ.get("JITKV_DEBUG", "0") not in ("", "0")
    s = index.long()
    keep = s >= 0
    if skip_slot is not None:
        keep &= s != skip_slot
    if loc_map is not None:
        lm = loc_map.long()
        keep = _check_range(keep, s, lm.numel(), strict, f"{name}: position {{i}} has slot {{v}}, out of range for loc_map of size {lm.numel()}")
        mapped = lm[s.clamp(0, lm.numel() - 1)] if lm.numel() else s
        keep &= mapped >= 0
        keep = _check_range(keep, mapped, num_slots, strict, f"loc_map: {name} position {{i}} maps to {{v}}, out of range for a cache of {num_slots} slots")
        s = mapped
    else:
        keep = _check_range(keep, s, num_slots, strict, f"{name}: position {{i}} has slot {{v}}, out of range for a cache of {num_slots} slots")
    rows = keep.nonzero().flatten()
    return s[rows], rows


def _check_range(keep, s, bound, strict, message):
    oob = keep & (s >= bound)
    if bool(oob.any()):
        if strict:
            i = int(oob.nonzero()[0, 0])
            raise IndexError(message.format(i=i, v=int(s[i])))
        keep = keep & ~oob
    return keep


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, *, skip_slot=None):
    """kv_buffer[loc[i], :nope] = k_nope[i]; kv_buffer[loc[i], nope:nope+rope] = k_rope[i]."""
    buf = _bytes(kv_buffer.select(1, 0) if kv_buffer.dim() == 3 else kv_buffer)
    nope = _bytes(cache_k_nope.select(1, 0) if cache_k_nope.dim() == 3 else cache_k_nope)
    rope = _bytes(cache_k_rope.select(1, 0) if cache_k_rope.dim() == 3 else cache_k_rope)
    slots, rows = valid_rows(loc, buf.shape[0], skip_slot=skip_slot, name="loc")
    dn, dr = nope.shape[1], rope.shape[1]
    buf[slots, :dn] = nope[rows]
    buf[slots, dn : dn + dr] = rope[rows]


def quantize_fp8(x, fp8_dtype, scale):
    """stored = RNE(clamp(x / scale, ±max)) in fp32; scale a float (rounded to float32) or a tensor."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(scale, dtype=torch.float32, device=x.device)
    m = FP8_MAX[fp8_dtype]
    return (x.float() / scale.reshape(())).clamp(-m, m).to(fp8_dtype)


def store_cache(
    k, v, k_cache, v_cache, slot_mapping, *, kv_cache_dtype="auto", k_scale=None, v_scale=None, loc_map=None, skip_slot=None
):
    """k_cache[slot'] = k[i], v_cache[slot'] = v[i] (quantized to fp8 when asked), DESIGN §2-§4."""
    num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
    slots, rows = valid_rows(slot_mapping, num_slots, skip_slot=skip_slot, loc_map=loc_map)
    for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        vals = src[rows]
        if kv_cache_dtype != "auto":
            vals = quantize_fp8(vals, FP8_DTYPES[kv_cache_dtype], scale)
        _write_rows(cache, slots, _bytes(vals))


def _write_rows(cache, slots, vals):
    cache = _bytes(cache)
    if cache.dim() == 4:
        bs = cache.shape[1]
        cache[slots // bs, slots % bs] = vals.reshape(-1, *cache.shape[2:])
    else:
        cache[slots] = vals.reshape(-1, *cache.shape[1:])


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4 FP8 K cache (DESIGN §5)
#
# Per group of 64 nope dims: amax = max |x| (NaN propagates); e = the smallest integer with
# 448 * 2^e >= max(amax, 1e-4), exactly via frexp: for m = f * 2^E (f in [0.5, 1)) and
# 448 = 0.875 * 2^9, e = E - 9 + (f > 0.875). A group whose amax is inf or NaN gets e = 128.
# Scale byte = e + 127 (UE8M0, clamped to [0, 255]; the 8th byte is 0). Stored = e4m3(clamp(x * 2^-e,
# ±448)) rounded to nearest even (x * 2^-e == x / 2^e exactly for finite groups); a NaN element is
# stored as 0x7F with its sign. Dequantized = bf16(float32(e4m3) * 2^(byte - 127)), exact; a NaN
# result is written as 0x7FFF (what the GPU conversion gives). Rope dims are bf16 bytes, bit-exact.


def dsv4_block_stride(block_size: int) -> int:
    """Bytes per block: token data, then scales, padded to a multiple of 576."""
    return -(-block_size * DSV4_TOKEN_BYTES // DSV4_DATA_BYTES) * DSV4_DATA_BYTES


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
    nan = torch.tensor(0x7FFF, dtype=torch.int16, device=data.device).view(torch.bfloat16)
    val = torch.where(torch.isnan(val), nan, val)
    return torch.cat([val, data[:, DSV4_NOPE:].contiguous().view(torch.bfloat16)], dim=1)


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, *, block_size=64):
    """Quantize k [n', 512] bf16 into the DSv4 FP8 K cache at slot_mapping (slot < 0 skipped)."""
    rows = _dsv4_rows(k_cache, block_size)
    slots, keep = valid_rows(slot_mapping, rows.shape[0] * block_size)
    if not slots.numel():
        return
    data, scales = dsv4_quantize_tokens(k[keep])
    blk = (slots // block_size).unsqueeze(1)
    data_cols, scale_cols = _dsv4_columns((slots % block_size).unsqueeze(1), block_size)
    rows[blk, data_cols] = data
    rows[blk, scale_cols] = scales


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset=0):
    """out[r, offset + i] = dequant(token seq_len - gather_len + i of request r), DESIGN §5.

    Positions whose block-table entry is < 0, >= num_blocks or past the table yield zero rows; rows
    at or past out.shape[1] are not written. No host sync."""
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
