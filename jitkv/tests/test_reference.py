"""The torch reference's writers scatter without a host sync (so the torch backend is graph-safe on
CUDA). Here, on CPU tensors, against a row-by-row loop of the contract (docs/design.md §3): padding (< 0),
skip_slot, loc_map, out-of-range slots skipped (``strict=False``, the CUDA semantics) or raising before
any write (``strict=True``), rows that are all skipped, duplicates. Whole destinations, bitwise."""

from __future__ import annotations

import pytest
import torch

from jitkv import DSV4_K_CACHE, reference
from jitkv.codes import FP8_DTYPES, KV_FORMATS
from jitkv.tests.conftest import assert_bitwise, slots


def _bits(shape, dtype):
    """Random bit patterns of any dtype (NaN payloads included for float types): poison, never zeros."""
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (*shape, size), dtype=torch.uint8).view(dtype).squeeze(-1)


def _index(num_slots, n, dtype, out_of_range):
    """n unique slots with padding (-1), the skip slot 5 twice, and (out_of_range) slots past the cache."""
    s = slots(num_slots, n).to(dtype)
    s[::4] = -1
    s[1], s[2] = 5, 5
    if out_of_range:
        s[3], s[6] = num_slots, 2**31 - 1
    return s


def _kept(slot, num_slots, skip_slot):
    s = int(slot)
    return s >= 0 and s != skip_slot and s < num_slots


# --------------------------------------------------------------------------------------------- MLA


def _mla_loop(buf, loc, nope, rope, skip_slot):
    out = buf.clone()
    dn, dr = nope.shape[1], rope.shape[1]
    for i, s in enumerate(loc.tolist()):
        if _kept(s, buf.shape[0], skip_slot):
            out[s, :dn], out[s, dn : dn + dr] = nope[i], rope[i]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_mla_matches_row_loop(dtype, idx_dtype):
    buf, nope, rope = _bits((300, 600), dtype), _bits((70, 512), dtype), _bits((70, 64), dtype)
    loc = _index(300, 64, idx_dtype, out_of_range=True)
    got = buf.clone()
    reference.set_mla_kv_buffer(got, loc, nope, rope, skip_slot=5, strict=False)
    assert_bitwise(got, _mla_loop(buf, loc, nope, rope, 5))
    with pytest.raises(IndexError, match=r"loc: position 3 has slot 300\b"):
        reference.set_mla_kv_buffer(got, loc, nope, rope, skip_slot=5)  # CPU default: strict
    assert_bitwise(got, _mla_loop(buf, loc, nope, rope, 5))  # nothing written by the raising call


# ------------------------------------------------------------------------------------- store_cache


def _cache(layout, dtype):
    """A 64-slot cache, 2 heads of 32: flat [64, 64], flat [64, 2, 32], paged NHD or HND (block 8)."""
    return {
        "flat2d": lambda: _bits((64, 64), dtype),
        "flat3d": lambda: _bits((64, 2, 32), dtype),
        "nhd": lambda: _bits((8, 8, 2, 32), dtype),
        "hnd": lambda: _bits((8, 2, 8, 32), dtype).permute(0, 2, 1, 3),
    }[layout]()


def _raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _slot_view(cache, s):
    return cache[s // cache.shape[1], s % cache.shape[1]] if cache.dim() == 4 else cache[s]


def _store_loop(k, v, kc, vc, sm, loc_map, skip_slot, kw):
    out_k, out_v = kc.clone(), vc.clone()
    for i, s in enumerate(sm.tolist()):
        if s < 0 or s == skip_slot or s >= loc_map.numel():
            continue
        t = int(loc_map[s])
        if not _kept(t, 64, None):
            continue
        for src, dst, scale in ((k, out_k, kw.get("k_scale")), (v, out_v, kw.get("v_scale"))):
            row = src[i : i + 1]
            if "kv_cache_dtype" in kw:
                row = reference.quantize_fp8(row, FP8_DTYPES[KV_FORMATS[kw["kv_cache_dtype"]]], scale)
            dst_row = _slot_view(dst, t)
            _raw(dst_row).copy_(_raw(row.reshape(dst_row.shape)))  # a bitwise copy, float8 into uint8 too
    return out_k, out_v


@pytest.mark.parametrize("layout", ["flat2d", "flat3d", "nhd", "hnd"])
@pytest.mark.parametrize("fp8", [False, True])
def test_store_cache_matches_row_loop(layout, fp8):
    n = 40
    src_dtype, cache_dtype = (torch.bfloat16, torch.uint8) if fp8 else (torch.float16, torch.float16)
    k = torch.randn(n + 3, 2, 32).to(src_dtype) * 100
    v = torch.randn(n + 3, 64).to(src_dtype)
    kc, vc = _cache(layout, cache_dtype), _cache(layout, cache_dtype)
    sm = _index(80, n, torch.int64, out_of_range=True)  # 80: past the 72-entry loc_map
    loc_map = torch.randperm(72).to(torch.int32)
    loc_map[loc_map >= 64] = 100  # maps past the 64-slot cache
    loc_map[int(sm[7]) % 72] = -1
    kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=0.37, v_scale=torch.tensor([2.5])) if fp8 else {}
    got_k, got_v = kc.clone(), vc.clone()
    reference.store_cache(k, v, got_k, got_v, sm, loc_map=loc_map, skip_slot=5, strict=False, **kw)
    want_k, want_v = _store_loop(k, v, kc, vc, sm, loc_map, 5, kw)
    assert_bitwise(got_k, want_k)
    assert_bitwise(got_v, want_v)


def test_store_cache_strict_raises_before_writing():
    kc = _cache("nhd", torch.bfloat16)
    before = kc.clone()
    k = torch.randn(6, 2, 32).bfloat16()
    loc_map = torch.arange(70)
    for sm, lm, message in (
        (torch.tensor([3, 64, 1]), None, r"slot_mapping: position 1 has slot 64, out of range for a cache of 64"),
        (
            torch.tensor([3, 70, 1]),
            loc_map,
            r"slot_mapping: position 1 has slot 70, out of range for loc_map of size 70",
        ),
        (torch.tensor([3, 66, 1]), loc_map, r"loc_map: slot_mapping position 1 maps to 66, out of range"),
    ):
        with pytest.raises(IndexError, match=message):
            reference.store_cache(k, k, kc, kc, sm, loc_map=lm, strict=True)
        assert_bitwise(kc, before)


# ----------------------------------------------------------------------------------------- DSv4


def _dsv4_loop(k, cache, sm, bs):
    out = cache.clone()
    for i, s in enumerate(sm.tolist()):
        if not _kept(s, cache.shape[0] * bs, None):
            continue
        data, scales = reference.dsv4_quantize_tokens(k[i : i + 1])
        blk, pos = divmod(s, bs)
        out[blk, pos * 576 : (pos + 1) * 576] = data[0]
        out[blk, bs * 576 + pos * 8 : bs * 576 + pos * 8 + 8] = scales[0]
    return out


@pytest.mark.parametrize("bs", [64, 2])
def test_dsv4_writer_matches_row_loop(bs):
    nb = 256 // bs
    cache = _bits((nb, DSV4_K_CACHE.block_stride(bs)), torch.uint8)
    k = torch.randn(60, 512).bfloat16()
    sm = _index(256, 57, torch.int32, out_of_range=True)
    got = cache.clone()
    reference.quantize_and_insert_k_cache(k, got, sm, block_size=bs, strict=False)
    assert_bitwise(got, _dsv4_loop(k, cache, sm, bs))


# ------------------------------------------------------------------- every row skipped, duplicates


def _writers(n):
    """(name, destination, write(destination, idx)) per writer; idx [n] slots into a 64-slot cache
    (skip_slot 9 where the op has one)."""
    nope, rope = _bits((n, 512), torch.bfloat16), _bits((n, 64), torch.bfloat16)
    k, kd = torch.randn(n, 2, 32).bfloat16(), torch.randn(n, 512).bfloat16()
    return [
        (
            "set_mla_kv_buffer",
            _bits((64, 600), torch.bfloat16),
            lambda d, idx: reference.set_mla_kv_buffer(d, idx, nope, rope, skip_slot=9, strict=False),
        ),
        (
            "store_cache",
            _cache("hnd", torch.float8_e4m3fn),
            lambda d, idx: reference.store_cache(
                k, k, d, d, idx, kv_cache_dtype="fp8", k_scale=0.5, v_scale=0.5, skip_slot=9, strict=False
            ),
        ),
        (
            "quantize_and_insert_k_cache",
            _bits((32, DSV4_K_CACHE.block_stride(2)), torch.uint8),
            lambda d, idx: reference.quantize_and_insert_k_cache(kd, d, idx, block_size=2, strict=False),
        ),
    ]


@pytest.mark.parametrize("idx", [[-1, 9, -7], [64, -1, 2**40], [-1]], ids=str)
def test_every_row_skipped_changes_no_byte(idx):
    """Each row padding, skip_slot or out of range: the sync-free scatter puts slot 0's own bytes
    back, so the destination stays bit-identical (random bit patterns, NaN payloads included)."""
    for name, dst, write in _writers(len(idx)):
        if name == "quantize_and_insert_k_cache" and 9 in idx:
            continue  # no skip_slot there: slot 9 is a real write
        before = dst.clone()
        write(dst, torch.tensor(idx))
        assert_bitwise(dst, before)


def test_empty_cache_and_empty_index():
    for _, dst, write in _writers(2):
        write(dst[:0], torch.tensor([-1, 3]))  # no slot at all: nothing to write, no error
        before = dst.clone()
        write(dst, torch.empty(0, dtype=torch.int64))
        assert_bitwise(dst, before)


def test_duplicates_one_row_wins():
    """Slot 7 from rows 0, 2 or 4 and slot 3 from rows 3 or 6: the whole destination equals what one
    of the six choices of winners writes alone."""
    idx = torch.tensor([7, -1, 7, 3, 7, 11, 3])
    for name, dst, write in _writers(idx.numel()):
        before = dst.clone()
        write(dst, idx)
        outcomes = []
        for w7 in (0, 2, 4):
            for w3 in (3, 6):
                alone = idx.clone()
                alone[[i for i in (0, 2, 4, 3, 6) if i not in (w7, w3)]] = -1
                outcomes.append(before.clone())
                write(outcomes[-1], alone)
        assert any(torch.equal(dst.view(torch.uint8), o.view(torch.uint8)) for o in outcomes), name
