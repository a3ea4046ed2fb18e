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
# DeepSeek-V4 FP8 K cache


def dsv4_block_stride(block_size: int) -> int:
    """Bytes per block: token data, then scales, padded to a multiple of 576."""
    return -(-block_size * DSV4_TOKEN_BYTES // DSV4_DATA_BYTES) * DSV4_DATA_BYTES


def _flat_blocks(k_cache):
    stride = k_cache.stride(0)
    return torch.as_strided(k_cache, (k_cache.shape[0], stride), (stride, 1), k_cache.storage_offset())


def ue8m0_exponent(amax):
    """Smallest integer e with 448 * 2^e >= max(amax, 1e-4), exactly (frexp, no log2)."""
    a = amax.float().clamp(min=1e-4) / 448.0
    m, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def dsv4_quantize_tokens(k):
    """k [n, 512] bf16 -> (data [n, 576] uint8, scales [n, 8] uint8) of the DSv4 record."""
    n = k.shape[0]
    groups = k[:, :DSV4_NOPE].float().reshape(n, DSV4_NOPE // DSV4_GROUP, DSV4_GROUP)
    e = ue8m0_exponent(groups.abs().amax(dim=2))
    q = (groups / torch.ldexp(torch.ones_like(groups[..., :1]), e[..., None].float())).clamp(-448, 448)
    data = torch.cat([q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, DSV4_NOPE), k[:, DSV4_NOPE:].contiguous().view(torch.uint8)], dim=1)
    scales = torch.zeros(n, DSV4_SCALE_BYTES, dtype=torch.uint8, device=k.device)
    scales[:, : DSV4_NOPE // DSV4_GROUP] = (e + 127).clamp(0, 255).to(torch.uint8)
    return data, scales


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, *, block_size=64):
    """Quantize k [n', 512] bf16 into the DSv4 FP8 K cache at slot_mapping (slot < 0 skipped)."""
    blocks = _flat_blocks(k_cache)
    num_slots = blocks.shape[0] * block_size
    slots, rows = valid_rows(slot_mapping, num_slots)
    data, scales = dsv4_quantize_tokens(k[rows])
    blk, pos = slots // block_size, slots % block_size
    cols = torch.arange(DSV4_DATA_BYTES, device=k.device)
    blocks[blk[:, None], pos[:, None] * DSV4_DATA_BYTES + cols] = data
    scols = torch.arange(DSV4_SCALE_BYTES, device=k.device)
    blocks[blk[:, None], block_size * DSV4_DATA_BYTES + pos[:, None] * DSV4_SCALE_BYTES + scols] = scales


def dsv4_dequantize_tokens(data, scales):
    """(data [n, 576], scales [n, 8]) uint8 -> [n, 512] bf16."""
    n = data.shape[0]
    q = data[:, :DSV4_NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(n, -1, DSV4_GROUP)
    e = scales[:, : DSV4_NOPE // DSV4_GROUP].to(torch.int32) - 127
    nope = (q * torch.ldexp(torch.ones_like(q[..., :1]), e[..., None].float())).to(torch.bfloat16).reshape(n, DSV4_NOPE)
    rope = data[:, DSV4_NOPE:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=1)


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset=0):
    """out[r, offset + i] = dequant(token seq_len - gather_len + i of request r), DESIGN §5.

    Positions whose block-table entry is < 0 or past the table yield zero rows; rows at or past
    out.shape[1] are not written."""
    blocks = _flat_blocks(k_cache)
    max_blocks = block_table.shape[1]
    dev = out.device
    for r, sl in enumerate(seq_lens.tolist()):
        gl = sl if gather_lens is None else int(gather_lens[r])
        i = torch.arange(max(min(gl, out.shape[1] - offset), 0), device=dev)
        p = sl - gl + i
        blk = torch.div(p, block_size, rounding_mode="floor")
        ok = (p >= 0) & (blk < max_blocks)
        phys = torch.where(ok, block_table[r, blk.clamp(0, max_blocks - 1)].long(), -1)
        ok &= phys >= 0
        pos = (p % block_size)[:, None]
        b = phys.clamp(min=0)[:, None]
        data = blocks[b, pos * DSV4_DATA_BYTES + torch.arange(DSV4_DATA_BYTES, device=dev)]
        scales = blocks[b, block_size * DSV4_DATA_BYTES + pos * DSV4_SCALE_BYTES + torch.arange(DSV4_SCALE_BYTES, device=dev)]
        rows = dsv4_dequantize_tokens(data, scales)
        out[r, offset + i] = torch.where(ok[:, None], rows, torch.zeros((), dtype=rows.dtype, device=dev))
