"""store_cache: whole-cache bitwise equality with the torch reference, on every backend of every
device present (CPU: jit, torch; CUDA adds triton)."""

from __future__ import annotations

import math
import re

import pytest
import torch

import jitkv
from jitkv import reference
from jitkv.codes import FP8_MAX
from jitkv.tests.conftest import (
    BACKENDS,
    DEV_BACKENDS,
    DEVICES,
    QUICK_WINDOW_SCALES,
    assert_bitwise,
    every_16_bit_value,
    gpu,
    rand,
    slots,
)
from jitkv.tests.triton.interpreter import run_under_interpreter

NUM_SLOTS = 1024


def _run(k, v, kc, vc, sm, backend, **kw):
    """Run jitkv.store_cache on clones and the reference on other clones; compare whole caches."""
    got_k, got_v, ref_k, ref_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    jitkv.store_cache(k, v, got_k, got_v, sm, backend=backend, **kw)
    reference.store_cache(k, v, ref_k, ref_v, sm, **kw)
    assert_bitwise(got_k, ref_k)
    assert_bitwise(got_v, ref_v)
    return got_k, got_v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [1, 8, 16, 32])
@pytest.mark.parametrize("n", [1, 7, 133])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_matrix_cpu(dtype, head_dim, heads, n, idx_dtype):
    k, v = rand((n, heads, head_dim), dtype), rand((n, heads, head_dim), dtype)
    kc, vc = rand((NUM_SLOTS, heads, head_dim), dtype), rand((NUM_SLOTS, heads, head_dim), dtype)
    _run(k, v, kc, vc, slots(NUM_SLOTS, n, idx_dtype), "jit")


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_padding_skip_and_extra_source_rows(device, backend, idx_dtype):
    n, h, d = 40, 8, 64
    k, v = rand((n + 9, h, d), torch.bfloat16, device), rand((n + 9, h, d), torch.bfloat16, device)
    kc, vc = rand((NUM_SLOTS, h, d), torch.bfloat16, device), rand((NUM_SLOTS, h, d), torch.bfloat16, device)
    sm = slots(NUM_SLOTS, n, idx_dtype, device)
    sm[::5] = -1
    sm[3] = 0  # the reserved padding slot
    got_k, _ = _run(k, v, kc, vc, sm, backend, skip_slot=0)
    assert torch.equal(got_k[0], kc[0])


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_loc_map_with_negative_entries(device, backend):
    n, full, window, h, d = 64, 4096, 512, 4, 128
    k, v = rand((n, h, d), torch.float16, device), rand((n, h, d), torch.float16, device)
    kc, vc = rand((window, h, d), torch.float16, device), rand((window, h, d), torch.float16, device)
    loc_map = torch.randint(0, window, (full,), dtype=torch.int32)
    loc_map[torch.randperm(full)[: full // 4]] = -1  # slots outside the sliding window
    sm = slots(full, n, torch.int64, device)
    sm[1] = -1
    # unique mapped targets keep the expected result well defined
    loc_map[sm[sm >= 0].cpu()] = torch.randperm(window)[: int((sm >= 0).sum())].to(torch.int32)
    loc_map[sm[2].cpu()] = -1
    _run(k, v, kc, vc, sm, backend, loc_map=loc_map.to(device))


def _cache(layout, num_blocks, block_size, h, d, dtype, device):
    if layout == "flat3d":
        return rand((num_blocks * block_size, h, d), dtype, device)
    if layout == "flat2d":
        return rand((num_blocks * block_size, h * d), dtype, device)
    if layout == "nhd":
        return rand((num_blocks, block_size, h, d), dtype, device)
    return rand((num_blocks, h, block_size, d), dtype, device).permute(0, 2, 1, 3)  # hnd


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("layout", ["flat3d", "flat2d", "nhd", "hnd"])
@pytest.mark.parametrize("block_size", [16, 8, 12, 1])  # 12: a block size that is not a power of two
def test_layouts(device, backend, layout, block_size):
    h, d, nb, n = 8, 64, 32, 77  # h == block_size at 8: strides, not shapes, say HND
    k, v = rand((n, h, d), torch.bfloat16, device), rand((n, h * d), torch.bfloat16, device)
    kc = _cache(layout, nb, block_size, h, d, torch.bfloat16, device)
    vc = _cache(layout, nb, block_size, h, d, torch.bfloat16, device)
    last = nb * block_size - 1  # the last slot (the last row of the last block) always among them
    sm = torch.cat([slots(last, n - 1, torch.int32, device), torch.tensor([last], dtype=torch.int32, device=device)])
    _run(k, v, kc, vc, sm, backend)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_k_and_v_block_sizes_differ(device, backend, kv_dtype):
    """A paged K cache (blocks of 12) beside a flat V cache of the same slot count: a slot's block and
    row are found per cache."""
    h, d, n = 4, 64, 50
    cache_dtype = torch.bfloat16 if kv_dtype == "auto" else torch.float8_e4m3fn
    k, v = rand((n, h, d), torch.bfloat16, device), rand((n, h, d), torch.bfloat16, device)
    kc = _cache("nhd", 10, 12, h, d, torch.bfloat16, device).to(cache_dtype)
    vc = _cache("flat3d", 10, 12, h, d, torch.bfloat16, device).to(cache_dtype)
    kw = {} if kv_dtype == "auto" else dict(kv_cache_dtype=kv_dtype, k_scale=0.5, v_scale=2.0)
    _run(k, v, kc, vc, slots(120, n, torch.int64, device), backend, **kw)


@pytest.mark.parametrize("layout", ["flat3d", "nhd", "hnd"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("src_2d", [False, True])
def test_cuda_variant_short_path_matches_any_layout(layout, cache_dtype, src_2d):
    """The per-call head-bytes shortcut picks the same CUDA build as the general rule."""
    from jitkv.ops.store_cache import _head_bytes_any_layout, variant

    h, dk, dv, n = 8, 128, 64, 3
    k, v = torch.empty(n, h, dk), torch.empty(n, h, dv)
    if src_2d:
        k, v = k.view(n, h * dk), v.view(n, h * dv)
    kc = _cache(layout, 4, 16, h, dk, torch.bfloat16, "cpu").to(cache_dtype)
    vc = _cache(layout, 4, 16, h, dv, torch.bfloat16, "cpu").to(cache_dtype)
    got = variant(k, v, kc, vc, None, "auto", None, None, None, None)[:2]
    assert got == _head_bytes_any_layout(k, kc, v, vc)
    assert got == (dk * kc.element_size(), dv * vc.element_size())


def _view(shape, strides, offset, dtype):
    """A strided view of random values into a fresh 64-byte aligned buffer, ``offset`` elements in."""
    need = offset + sum((size - 1) * stride for size, stride in zip(shape, strides)) + 1
    return rand((need,), dtype, "cuda").as_strided(shape, strides, offset)


def _every_head_start_aligned(t, rows) -> bool:
    """Whether the address of element 0 of every head of the first ``rows`` rows is a multiple of 16
    bytes (2-D tensors: every index of the first dim; heads inside the row are a head's bytes apart)."""
    offsets = torch.zeros(1, dtype=torch.int64)
    for size, stride in zip((rows, *t.shape[1:-1]), t.stride()[:-1]):
        offsets = (offsets[:, None] + torch.arange(size) * stride).flatten()
    return bool(((t.data_ptr() + offsets * t.element_size()) % 16 == 0).all())


# (k [n', H, D] strides and element offset, k_cache shape, strides and offset): each a layout the
# 16-byte build takes or must refuse.
ALIGNMENT_CASES = [
    ((1024, 128, 1), 0, (64, 8, 128), (1024, 128, 1), 0),  # dense
    ((1024, 128, 1), 1, (64, 8, 128), (1024, 128, 1), 0),  # source base 2 bytes off
    ((1024, 128, 1), 0, (64, 8, 128), (1024, 128, 1), 4),  # cache base 8 bytes off
    ((6144, 128, 1), 0, (64, 8, 128), (1024, 128, 1), 0),  # fused qkv source (token stride 48 heads)
    ((6148, 128, 1), 0, (64, 8, 128), (1024, 128, 1), 0),  # token stride 8 bytes off: n > 1 reads it
    ((1024, 132, 1), 0, (64, 8, 128), (1024, 128, 1), 0),  # head stride 8 bytes off
    ((1024, 128, 1), 0, (4, 16, 8, 128), (16388, 128, 2048, 1), 0),  # HND, block stride 8 bytes off
    ((1024, 128, 1), 0, (4, 16, 8, 128), (16384, 128, 2048, 1), 0),  # HND
    ((1024, 128, 1), 0, (1, 16, 8, 128), (3, 128, 2048, 1), 0),  # one block: its odd stride is never used
    ((1024, 128, 1), 0, (64, 1, 128), (1024, 4, 1), 0),  # one head: its odd stride is never used
    ((1024, 128, 1), 0, (64, 1, 128), (1028, 4, 1), 0),  # one head, row stride 8 bytes off
    ((1028, 128, 1), 0, (64, 8, 128), (1024, 128, 1), 0),  # k token stride 8 bytes off (n = 1: unused)
]


@gpu
@pytest.mark.parametrize("case", range(len(ALIGNMENT_CASES)))
@pytest.mark.parametrize("n", [1, 5])
def test_16_byte_build_takes_exactly_the_aligned_views(case, n):
    """The 16-byte build writes a call exactly when every head it addresses starts on 16 bytes
    (checked address by address) and otherwise answers NEEDS_ANY_ALIGNMENT with nothing written; the
    op then writes the reference's bytes through the any-alignment build."""
    from jitkv.codes import Status

    k_strides, k_off, c_shape, c_strides, c_off = ALIGNMENT_CASES[case]
    h, d = c_shape[-2], c_shape[-1]
    k = _view((8, h, d), k_strides if h > 1 else (k_strides[0], d, 1), k_off, torch.bfloat16)
    v = rand((8, h, d), torch.bfloat16, "cuda")
    kc, vc = _view(c_shape, c_strides, c_off, torch.bfloat16), rand(c_shape, torch.bfloat16, "cuda")
    rows = c_shape[0]
    aligned = all(_every_head_start_aligned(t, r) for t, r in ((k, n), (v, n), (kc, rows), (vc, rows)))
    sm = slots(math.prod(c_shape[:-2]), n, torch.int64, "cuda")
    ref_k, ref_v = kc.clone(), vc.clone()
    reference.store_cache(k, v, ref_k, ref_v, sm)

    def same_view(t):  # a copy of a cache with its layout (clone() would make it contiguous)
        return _view(c_shape, t.stride(), t.storage_offset(), t.dtype).copy_(t)

    got_k, got_v = same_view(kc), vc.clone()
    status = _module("auto", 2 * d)(*_binding_args(k, v, got_k, got_v, sm, {}))
    assert status == (Status.DONE if aligned else Status.NEEDS_ANY_ALIGNMENT)
    if not aligned:
        assert_bitwise(got_k, kc)
        assert_bitwise(got_v, vc)
        jitkv.store_cache(k, v, got_k, got_v, sm, backend="jit")
    assert_bitwise(got_k, ref_k)
    assert_bitwise(got_v, ref_v)


def test_cuda_variant_of_heads_not_16_byte_multiples():
    from jitkv.codes import KvFormat, SrcDtype
    from jitkv.ops.store_cache import Variant, variant

    k, kc = rand((4, 2, 36), torch.bfloat16), rand((64, 2, 36), torch.bfloat16)
    assert Variant(*variant(k, k, kc, kc, None, "auto", None, None, None, None)) == Variant(
        0, 0, SrcDtype.NONE, KvFormat.COPY, False
    )
    kc8 = rand((64, 2, 36), torch.float8_e5m2)
    assert Variant(*variant(k, k, kc8, kc8, None, "fp8_e5m2", None, None, None, None)) == Variant(
        0, 0, SrcDtype.BF16, KvFormat.E5M2, False
    )


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_sources_are_views_of_fused_qkv(device, backend):
    n, hq, h, d = 50, 32, 8, 128
    qkv = rand((n, (hq + 2 * h) * d), torch.bfloat16, device)
    _, k, v = qkv.split([hq * d, h * d, h * d], dim=1)
    k3, v3 = k.view(n, h, d), v.view(n, h, d)  # token stride (hq + 2h) * d, not h * d
    kc, vc = rand((NUM_SLOTS, h, d), torch.bfloat16, device), rand((NUM_SLOTS, h, d), torch.bfloat16, device)
    _run(k3, v3, kc, vc, slots(NUM_SLOTS, n, torch.int64, device), backend)
    _run(k, v, kc, vc, slots(NUM_SLOTS, n, torch.int64, device), backend)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_empty_index(device, backend):
    k = rand((3, 2, 64), torch.float16, device)
    kc, vc = rand((16, 2, 64), torch.float16, device), rand((16, 2, 64), torch.float16, device)
    before_k, before_v = kc.clone(), vc.clone()
    jitkv.store_cache(k, k, kc, vc, torch.empty(0, dtype=torch.int64, device=device), backend=backend)
    assert_bitwise(kc, before_k)
    assert_bitwise(vc, before_v)


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
@pytest.mark.parametrize("use_loc_map", [False, True])
def test_out_of_range_raises_before_writing_cpu(backend, use_loc_map):
    h, d, n = 2, 64, 20
    k, v = rand((n, h, d), torch.bfloat16), rand((n, h, d), torch.bfloat16)
    kc, vc = rand((64, h, d), torch.bfloat16), rand((64, h, d), torch.bfloat16)
    before_k, before_v = kc.clone(), vc.clone()
    sm = slots(64, n)
    loc_map = None
    if use_loc_map:
        loc_map = torch.arange(64)
        loc_map[sm[-1]] = 64  # maps to a slot past the cache
    else:
        sm[-1] = 64
    with pytest.raises(IndexError, match=str(n - 1)):
        jitkv.store_cache(k, v, kc, vc, sm, loc_map=loc_map, backend=backend)
    assert_bitwise(kc, before_k)
    assert_bitwise(vc, before_v)


# ------------------------------------------------------------------------------------------ FP8

FP8 = [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]


def _wide_range(shape, dtype, device):
    """Magnitudes 1e-3 .. 1e4 with both signs, plus NaN, ±inf, ±0 and fp8 subnormal-range values."""
    mag = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e4)))
    x = mag * torch.where(torch.rand(shape) < 0.5, -1.0, 1.0)
    flat = x.view(-1)
    flat[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-6, -3e-5, 448.5])
    return x.to(dtype).to(device)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("kv_dtype,fp8", FP8)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cache_as_uint8", [False, True])
def test_fp8_bit_exact(device, backend, kv_dtype, fp8, src_dtype, cache_as_uint8):
    n, h, d = 133, 8, 128
    k, v = _wide_range((n, h, d), src_dtype, device), _wide_range((n, h, d), src_dtype, device)
    cdt = torch.uint8 if cache_as_uint8 else fp8
    kc, vc = rand((512, h, d), cdt, device), rand((512, h, d), cdt, device)
    sm = slots(512, n, torch.int32, device)
    _run(k, v, kc, vc, sm, backend, kv_cache_dtype=kv_dtype, k_scale=0.37, v_scale=2.5)
    scale = torch.tensor([0.1], dtype=torch.float32, device=device)
    _run(k, v, kc, vc, sm, backend, kv_cache_dtype=kv_dtype, k_scale=scale, v_scale=scale)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_fp8_saturates_and_keeps_nan(device, backend):
    x = torch.tensor([1e4, -1e4, 449.0, float("nan"), 1e-12], dtype=torch.float32).repeat(64, 1).view(64, 1, 5 * 1)
    x = torch.cat([x] * 16, dim=2).to(device)  # [64, 1, 80]
    kc = rand((64, 1, 80), torch.float8_e4m3fn, device)
    jitkv.store_cache(
        x,
        x,
        kc,
        kc.clone(),
        torch.arange(64, device=device),
        kv_cache_dtype="fp8",
        k_scale=1.0,
        v_scale=1.0,
        backend=backend,
    )
    vals = kc[0, 0, :5].float().tolist()
    assert vals[:3] == [448.0, -448.0, 448.0] and math.isnan(vals[3]) and vals[4] == 0.0


def _per_head_expected(rows, cache, sm, scale, fp8):
    """``cache`` after writing ``rows`` ([n', H, D] or [n', H*D]) at the slots ``sm`` (paged or flat,
    < 0 skipped), head h of row i as torch casts it: (rows[i, h].float() / scale[h]).clamp(-max, max)
    .to(fp8), scale a [H] tensor."""
    out, m = cache.clone(), FP8_MAX[fp8]
    heads = rows.reshape(rows.shape[0], scale.numel(), -1)
    for i, slot in enumerate(sm.tolist()):
        if slot < 0:
            continue
        q = (heads[i].float() / scale.reshape(-1, 1)).clamp(-m, m).to(fp8)
        dst = out[slot // out.shape[1], slot % out.shape[1]] if out.dim() == 4 else out[slot]
        dst.view(torch.uint8).copy_(q.view(torch.uint8).reshape(dst.shape))
    return out


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("kv_dtype,fp8", FP8)
@pytest.mark.parametrize("layout", ["nhd", "hnd", "flat3d", "flat2d"])
@pytest.mark.parametrize("v_kind", ["per-head view", "float", "1-element"])
def test_fp8_per_head_scales(device, backend, kv_dtype, fp8, layout, v_kind):
    """k_scale of [H] divides head h by k_scale[h]; v_scale per head too (a strided view of a larger
    tensor), or one float, or one element: bit-exact with the reference and with torch's cast, head by
    head, over the whole caches (K a [n', H, D] source, V a [n', H*D] one, padding rows and -1 slots)."""
    h, d, nb, bs, n = 8, 64, 16, 8, 45
    k = _wide_range((n + 3, h, d), torch.bfloat16, device)
    v = _wide_range((n + 3, h * d), torch.bfloat16, device)
    kc, vc = _cache(layout, nb, bs, h, d, fp8, device), _cache(layout, nb, bs, h, d, fp8, device)
    sm = slots(nb * bs, n, torch.int64, device)
    sm[::6] = -1
    k_scale = (torch.rand(h) * 3 + 0.05).to(device)
    v_scale = {
        "per-head view": (torch.rand(2 * h) * 3 + 0.05).to(device)[::2],
        "float": 0.37,
        "1-element": torch.tensor([2.5], device=device),
    }[v_kind]
    got_k, got_v = _run(k, v, kc, vc, sm, backend, kv_cache_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    assert_bitwise(got_k, _per_head_expected(k, kc, sm, k_scale, fp8))
    v_heads = v_scale if isinstance(v_scale, torch.Tensor) and v_scale.numel() == h else None
    if v_heads is not None:
        assert_bitwise(got_v, _per_head_expected(v, vc, sm, v_heads, fp8))


# ----------------------------------------------------------------------------------- bad inputs


def _good(device):
    return dict(
        k=rand((8, 2, 64), torch.bfloat16, device),
        v=rand((8, 2, 64), torch.bfloat16, device),
        k_cache=rand((32, 2, 64), torch.bfloat16, device),
        v_cache=rand((32, 2, 64), torch.bfloat16, device),
        slot_mapping=slots(32, 8, torch.int64, device),
    )


def _fp8(device):
    g = _good(device)
    g["k_cache"] = rand((32, 2, 64), torch.float8_e4m3fn, device)
    g["v_cache"] = rand((32, 2, 64), torch.float8_e4m3fn, device)
    return g, dict(kv_cache_dtype="fp8", k_scale=0.5, v_scale=0.5)


BAD = [
    # (name, mutate(args, kwargs, device), exception, argument named in the message)
    ("slot float", lambda a, kw, d: a.update(slot_mapping=a["slot_mapping"].float()), TypeError, "slot_mapping"),
    ("slot 2-D", lambda a, kw, d: a.update(slot_mapping=a["slot_mapping"].view(2, 4)), ValueError, "slot_mapping"),
    ("k_cache dtype", lambda a, kw, d: a.update(k_cache=a["k_cache"].half()), TypeError, "k_cache"),
    ("v dtype", lambda a, kw, d: a.update(v=a["v"].half()), TypeError, "v"),
    ("v_cache dtype", lambda a, kw, d: a.update(v_cache=a["v_cache"].float()), TypeError, "v_cache"),
    ("k rank", lambda a, kw, d: a.update(k=a["k"].view(8, 2, 8, 8)), ValueError, "k"),
    ("k head mismatch", lambda a, kw, d: a.update(k=rand((8, 4, 32), torch.bfloat16, d)), ValueError, "k_cache"),
    ("row mismatch", lambda a, kw, d: a.update(k_cache=rand((32, 2, 32), torch.bfloat16, d)), ValueError, "k_cache"),
    ("too few rows", lambda a, kw, d: a.update(k=a["k"][:5]), ValueError, "k"),
    (
        "noncontig last",
        lambda a, kw, d: a.update(k_cache=rand((32, 64, 2), torch.bfloat16, d).transpose(1, 2)),
        ValueError,
        "k_cache",
    ),
    ("cache device", lambda a, kw, d: a.update(v_cache=a["v_cache"].cpu()), ValueError, "v_cache"),
    ("unknown dtype", lambda a, kw, d: kw.update(kv_cache_dtype="int4"), ValueError, "kv_cache_dtype"),
    (
        "fp8 on bf16 cache",
        lambda a, kw, d: kw.update(kv_cache_dtype="fp8", k_scale=1.0, v_scale=1.0),
        ValueError,
        "kv_cache_dtype",
    ),
    ("k not tensor", lambda a, kw, d: a.update(k=[1, 2]), TypeError, "k"),
]
FP8_BAD = [
    ("missing scale", lambda kw: kw.pop("k_scale"), ValueError, "k_scale"),
    ("zero scale", lambda kw: kw.update(v_scale=0.0), ValueError, "v_scale"),
    ("negative scale", lambda kw: kw.update(k_scale=-2.0), ValueError, "k_scale"),
    ("nan scale", lambda kw: kw.update(k_scale=float("nan")), ValueError, "k_scale"),
    ("inf scale", lambda kw: kw.update(v_scale=float("inf")), ValueError, "v_scale"),
    ("scale tensor f64", None, TypeError, "k_scale"),
    ("scale tensor 3 elements", None, ValueError, "v_scale"),  # 2 heads: neither 1 element nor per head
    ("e5m2 string, e4m3 cache", lambda kw: kw.update(kv_cache_dtype="fp8_e5m2"), ValueError, "k_cache"),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(device, backend, case):
    _, mutate, exc, name = case
    if case[0] == "cache device" and device == "cpu":
        pytest.skip("needs a second device type (a CUDA tensor beside CPU ones)")
    args, kw = _good(device), {}
    mutate(args, kw, device)
    before = {k: t.clone() for k, t in args.items() if isinstance(t, torch.Tensor) and k.endswith("cache")}
    with pytest.raises(exc, match=rf"store_cache: {name}\b"):
        jitkv.store_cache(*args.values(), backend=backend, **kw)
    for key, t in before.items():
        assert_bitwise(args[key], t)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("case", FP8_BAD, ids=[c[0] for c in FP8_BAD])
def test_bad_fp8_input(device, backend, case):
    _, mutate, exc, name = case
    args, kw = _fp8(device)
    if case[0] == "scale tensor f64":
        kw["k_scale"] = torch.tensor([1.0], dtype=torch.float64, device=device)
    elif case[0] == "scale tensor 3 elements":
        kw["v_scale"] = torch.ones(3, dtype=torch.float32, device=device)
    else:
        mutate(kw)
    with pytest.raises(exc, match=rf"store_cache: {name}\b"):
        jitkv.store_cache(*args.values(), backend=backend, **kw)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("shape", [(3,), (1, 2), (2, 1), (2, 2)])  # the caches have 2 heads
def test_bad_per_head_scale_shape(device, backend, name, shape):
    """A scale tensor of neither 1 element nor [num_heads] ([num_heads + 1], 2-D) raises ValueError
    naming it, before anything is written."""
    args, kw = _fp8(device)
    kw[name] = torch.ones(shape, dtype=torch.float32, device=device)
    before = [args["k_cache"].clone(), args["v_cache"].clone()]
    want = rf"store_cache: {name}: expected a 1-element tensor or \[num_heads\] = \[2\] per-head scales, got shape "
    with pytest.raises(ValueError, match=want + re.escape(str(list(shape)))):
        jitkv.store_cache(*args.values(), backend=backend, **kw)
    assert_bitwise(args["k_cache"], before[0])
    assert_bitwise(args["v_cache"], before[1])


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
def test_bad_per_head_scale_value_cpu(backend):
    """Every per-head value of a CPU scale tensor is checked on the host; the message names the head."""
    args, kw = _fp8("cpu")
    kw["v_scale"] = torch.tensor([0.5, float("nan")])
    with pytest.raises(ValueError, match=r"store_cache: v_scale\[1\]: must be finite and > 0, got nan"):
        jitkv.store_cache(*args.values(), backend=backend, **kw)


BAD_SCALE_TENSORS = [
    ("k_scale", 0.0),
    ("v_scale", float("nan")),
    ("k_scale", float("inf")),
    ("v_scale", -1.0),
    ("k_scale", -0.0),
]


def _bad_scale_tensor(device, name, value):
    """fp8 arguments with scale ``name`` a 1-element float32 tensor holding ``value``, and the caches."""
    args, kw = _fp8(device)
    kw[name] = torch.tensor([value], dtype=torch.float32, device=device)
    return args, kw


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
@pytest.mark.parametrize("name,value", BAD_SCALE_TENSORS)
def test_bad_scale_tensor_value_cpu(backend, name, value):
    """A CPU scale tensor is read on the host before anything is written."""
    args, kw = _bad_scale_tensor("cpu", name, value)
    before = [args["k_cache"].clone(), args["v_cache"].clone()]
    with pytest.raises(ValueError, match=rf"store_cache: {name}: must be finite and > 0, got {value}"):
        jitkv.store_cache(*args.values(), backend=backend, **kw)
    assert_bitwise(args["k_cache"], before[0])
    assert_bitwise(args["v_cache"], before[1])


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
@pytest.mark.parametrize("name,value", BAD_SCALE_TENSORS[:2])
def test_bad_scale_tensor_value_gpu_under_debug(backend, name, value, monkeypatch):
    """A CUDA scale tensor is read on the host only under JITKV_DEBUG=1 (it syncs)."""

    monkeypatch.setenv("JITKV_DEBUG", "1")
    jitkv.ops.reset()  # JITKV_DEBUG is read when a backend is resolved
    try:
        args, kw = _bad_scale_tensor("cuda", name, value)
        before = args["k_cache"].clone()
        with pytest.raises(ValueError, match=rf"store_cache: {name}: must be finite and > 0, got {value}"):
            jitkv.store_cache(*args.values(), backend=backend, **kw)
        assert_bitwise(args["k_cache"], before)
    finally:
        monkeypatch.undo()
        jitkv.ops.reset()


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_out_of_range_gpu_skipped_or_raises_under_debug(backend, monkeypatch):

    k = rand((16, 2, 64), torch.bfloat16, "cuda")
    kc, vc = rand((32, 2, 64), torch.bfloat16, "cuda"), rand((32, 2, 64), torch.bfloat16, "cuda")
    sm = slots(32, 16, torch.int64, "cuda")
    sm[5] = 32
    got_k, got_v = kc.clone(), vc.clone()
    jitkv.store_cache(k, k, got_k, got_v, sm, backend=backend)  # skipped on the GPU
    keep = torch.ones(16, dtype=torch.bool, device="cuda")
    keep[5] = False
    ref_k, ref_v = kc.clone(), vc.clone()
    reference.store_cache(k[keep], k[keep], ref_k, ref_v, sm[keep])
    assert_bitwise(got_k, ref_k)
    monkeypatch.setenv("JITKV_DEBUG", "1")
    jitkv.ops.reset()  # JITKV_DEBUG is read when a backend is resolved
    try:
        with pytest.raises(IndexError, match=r"slot_mapping: position 5 has slot 32"):
            jitkv.store_cache(k, k, kc, vc, sm, backend=backend)
    finally:
        monkeypatch.undo()
        jitkv.ops.reset()


# ------------------------------------------------------------------------------- GPU-only cases


def _kv_case(n, h, dk, dv, num_slots, device, kv_dtype):
    """Sources, caches and keyword arguments for one store_cache call: "auto" copies bf16 into bf16
    caches; an fp8 format writes wide-range bf16 into e4m3 caches with device-tensor scales, one per
    side, or one per head for "fp8_e4m3 per-head"."""
    fp8 = kv_dtype != "auto"
    src, cache_dtype = (_wide_range, torch.float8_e4m3fn) if fp8 else (rand, torch.bfloat16)
    k, v = src((n, h, dk), torch.bfloat16, device), src((n, h, dv), torch.bfloat16, device)
    kc, vc = rand((num_slots, h, dk), cache_dtype, device), rand((num_slots, h, dv), cache_dtype, device)
    if not fp8:
        return k, v, kc, vc, {}
    if kv_dtype.endswith(" per-head"):
        scales = dict(
            k_scale=torch.linspace(0.05, 3.0, h, device=device), v_scale=torch.linspace(4.0, 0.5, h, device=device)
        )
    else:
        scales = dict(k_scale=torch.tensor([0.37], device=device), v_scale=torch.tensor([2.5], device=device))
    return k, v, kc, vc, dict(kv_cache_dtype=kv_dtype.split()[0], **scales)


KV_KINDS = ["auto", "fp8_e4m3", "fp8_e4m3 per-head"]


@gpu
@pytest.mark.parametrize("kv_dtype", KV_KINDS)
@pytest.mark.parametrize(
    "h,dk,dv,n",
    [
        (8, 128, 128, 1),
        (8, 128, 128, 3000),
        (32, 128, 128, 700),
        (8, 128, 64, 5),
        (8, 128, 64, 3000),
        (4, 36, 36, 9),
        (4, 36, 36, 2500),
    ],
)
def test_latency_and_bulk_kernels(kv_dtype, h, dk, dv, n):
    """Small n runs the CUDA latency kernel (fp8 with equal K and V heads: K and V in separate warps),
    large n the bulk kernel (rows of 2 KB or more split across warps); 36-dim heads take the generic
    build; per-head scales their own kernels of each. Each writes the reference's bytes over the whole
    caches."""
    k, v, kc, vc, kw = _kv_case(n, h, dk, dv, 4096, "cuda", kv_dtype)
    sm = slots(4096, n, torch.int64, "cuda")
    sm[::7] = -1
    _run(k, v, kc, vc, sm, "jit", **kw)


@gpu
@pytest.mark.parametrize("kv_dtype", KV_KINDS)
@pytest.mark.parametrize("n", [1, 40])
def test_row_kernel_calls_beyond_its_parameter_block(kv_dtype, n):
    """Calls the row kernel's 64-byte block cannot hold run the latency kernel and write the same
    bytes: source rows 1 MiB + 32 bytes apart (16-bit strides in 16-byte units), a skip_slot that
    is a slot of the caches."""
    k, v, kc, vc, kw = _kv_case(n, 8, 128, 128, 4096, "cuda", kv_dtype)
    wide = torch.randn(2, n, (1 << 19) + 16, device="cuda").to(k.dtype)
    k_wide, v_wide = wide[0, :, : 8 * 128].view(n, 8, 128), wide[1, :, 16 : 16 + 8 * 128].view(n, 8, 128)
    k_wide.copy_(k)
    v_wide.copy_(v)
    sm = slots(4096, n, torch.int64, "cuda")
    sm[::7] = -1
    _run(k_wide, v_wide, kc, vc, sm, "jit", **kw)
    _run(k, v, kc, vc, sm, "jit", skip_slot=4095, **kw)


def _fp8_row_views(case, n, num_slots=4096):
    """(k, v, cache, views) for a case of test_fp8_row_kernel_block: sources that are views of one
    allocation, one cache allocation, and views(t), the K and V caches inside t (cache or a clone)."""
    if case == "strides_differ":  # K rows 16 bytes apart in the source and the cache, V rows dense
        src = _wide_range((n * (1032 + 1024),), torch.bfloat16, "cuda")
        cache = rand((num_slots * (1040 + 1024),), torch.float8_e4m3fn, "cuda")

        def views(t):
            return t[: num_slots * 1040].view(-1, 1040)[:, :1024].view(-1, 8, 128), t[num_slots * 1040 :].view(
                -1, 8, 128
            )

        return src[: n * 1032].view(n, 1032)[:, :1024].view(n, 8, 128), src[n * 1032 :].view(n, 8, 128), cache, views
    src = _wide_range((2, n, 8, 128), torch.bfloat16, "cuda")
    if case == "paged":
        return (
            src[0],
            src[1],
            rand((2, num_slots // 16, 16, 8, 128), torch.float8_e4m3fn, "cuda"),
            lambda t: (t[0], t[1]),
        )
    # "v_before_k": V's source and cache at lower addresses than K's
    return src[1], src[0], rand((2, num_slots, 8, 128), torch.float8_e4m3fn, "cuda"), lambda t: (t[1], t[0])


@gpu
@pytest.mark.parametrize("case", ["v_before_k", "strides_differ", "paged"])
@pytest.mark.parametrize("scales", ["float", "tensor"])
@pytest.mark.parametrize("n", [1, 40])
def test_fp8_row_kernel_block(case, scales, n):
    """The fp8 row kernel's 64-byte block keeps V's pointers as offsets from K's and one row stride for
    both (store_cache.cuh RowFp8Args): V below K in one allocation (negative offsets), K and V rows of
    different strides (those calls take the latency kernel), paged caches; scales as floats and as
    tensors. Every byte of the cache allocation is the reference's."""
    k, v, cache, views = _fp8_row_views(case, n)
    kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=0.37, v_scale=2.5)
    if scales == "tensor":
        kw.update(k_scale=torch.tensor([0.37], device="cuda"), v_scale=torch.tensor([2.5], device="cuda"))
    sm = slots(4096, n, torch.int64, "cuda")
    sm[::7] = -1
    ref = cache.clone()
    jitkv.store_cache(k, v, *views(cache), sm, backend="jit", **kw)
    reference.store_cache(k, v, *views(ref), sm, **kw)
    assert_bitwise(cache, ref)


@gpu
@pytest.mark.parametrize("kv_dtype", KV_KINDS)
def test_bulk_kernel_at_large_n(kv_dtype):
    """n x chunks beyond the latency kernel's limit (256 warps per SM for fp8 on a 132-SM GPU:
    32 heads x 128 fp8 = 8 chunks per side, 6000 tokens) runs the bulk kernel; padding and skip_slot
    included."""
    k, v, kc, vc, kw = _kv_case(6000, 32, 128, 128, 8192, "cuda", kv_dtype)
    sm = slots(8192, 6000, torch.int64, "cuda")
    sm[::7] = -1
    sm[5::13] = 100
    _run(k, v, kc, vc, sm, "jit", skip_slot=100, **kw)


@gpu
@pytest.mark.parametrize("backend", ["jit", "triton"])
@pytest.mark.parametrize("kv_dtype", KV_KINDS)
@pytest.mark.parametrize("n", [1, 64, 3000])
def test_cuda_graph_replay_with_new_inputs_and_scales(backend, kv_dtype, n):
    """A captured store_cache replays with new slots, sources and (fp8) device-tensor scales, per-head
    ones included."""
    k, v, kc, vc, kw = _kv_case(n, 8, 128, 128, 8192, "cuda", kv_dtype)
    sm = slots(8192, n, torch.int32, "cuda")
    jitkv.store_cache(k, v, kc, vc, sm, backend=backend, **kw)  # build/compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        jitkv.store_cache(k, v, kc, vc, sm, backend=backend, **kw)
    for step in range(3):
        sm.copy_(slots(8192, n, torch.int32, "cuda"))
        k.copy_(rand(k.shape, torch.bfloat16, "cuda"))
        v.copy_(rand(v.shape, torch.bfloat16, "cuda"))
        if kw:
            kw["k_scale"].copy_(torch.linspace(0.5, 2.0, kw["k_scale"].numel()) + step)
            kw["v_scale"].copy_(torch.linspace(3.0, 0.1, kw["v_scale"].numel()) * (step + 1))
        ref_k, ref_v = kc.clone(), vc.clone()
        reference.store_cache(k, v, ref_k, ref_v, sm, **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(kc, ref_k)
        assert_bitwise(vc, ref_v)


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_side_stream(backend, kv_dtype):
    k, v, kc, vc, kw = _kv_case(4096, 8, 128, 128, 8192, "cuda", kv_dtype)
    sm = slots(8192, 4096, torch.int64, "cuda")
    ref_k, ref_v = kc.clone(), vc.clone()
    reference.store_cache(k, v, ref_k, ref_v, sm, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        jitkv.store_cache(k, v, kc, vc, sm, backend=backend, **kw)
    torch.cuda.current_stream().wait_stream(side)
    assert_bitwise(kc, ref_k)
    assert_bitwise(vc, ref_v)


@gpu
@pytest.mark.parametrize("kv_dtype", [*KV_KINDS, "fp8_e5m2"])
@pytest.mark.parametrize("n", [5, 777, 3000])
def test_every_backend_same_bytes(kv_dtype, n):
    if kv_dtype == "fp8_e5m2":
        k, v = _wide_range((n, 8, 128), torch.float16, "cuda"), _wide_range((n, 8, 128), torch.float16, "cuda")
        kc, vc = rand((4096, 8, 128), torch.uint8, "cuda"), rand((4096, 8, 128), torch.uint8, "cuda")
        kw = dict(kv_cache_dtype=kv_dtype, k_scale=3.0, v_scale=0.01)
    else:
        k, v, kc, vc, kw = _kv_case(n, 8, 128, 128, 4096, "cuda", kv_dtype)
    sm = slots(4096, n, torch.int64, "cuda")
    outs = []
    for backend in BACKENDS["cuda"]:
        got_k, got_v = kc.clone(), vc.clone()
        jitkv.store_cache(k, v, got_k, got_v, sm, backend=backend, **kw)
        outs.append((got_k, got_v))
    for got_k, got_v in outs[1:]:
        assert_bitwise(got_k, outs[0][0])
        assert_bitwise(got_v, outs[0][1])


@gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_misaligned_view_takes_the_generic_variant(kv_dtype):
    """Rows of 16-byte multiples but a source only 2-byte aligned: the 16-byte build answers
    NEEDS_ANY_ALIGNMENT and the op dispatches the any-alignment variant; an aligned call takes the
    16-byte build (backend_info records a variant when it is resolved, so each call starts from none)."""

    n, h, d = 37, 8, 128
    k, v, kc, vc, kw = _kv_case(n, h, d, d, 512, "cuda", kv_dtype)
    head_bytes = d * kc.element_size()
    k_odd = rand((n * h * d + 1,), torch.bfloat16, "cuda")[1:].view(n, h, d)  # 2-byte aligned base
    sm = slots(512, n, torch.int64, "cuda")
    sm[::5] = -1
    for backend in (None, "jit"):
        jitkv.ops.reset()
        _run(k_odd, v, kc, vc, sm, backend, **kw)
        info = jitkv.backend_info("store_cache")["cuda:0"]
        assert info["backend"] == "jit" and info["alignment"].startswith("any"), info
        assert "k_head_bytes0_v_head_bytes0" in info["key"], info
        jitkv.ops.reset()
        _run(k, v, kc, vc, sm, backend, **kw)
        info = jitkv.backend_info("store_cache")["cuda:0"]
        assert (
            info["alignment"] == "16 bytes" and f"k_head_bytes{head_bytes}_v_head_bytes{head_bytes}" in info["key"]
        ), info


def _binding_args(k, v, kc, vc, sm, kw):
    """The positional arguments of the module's full entry point for a _kv_case call."""
    from jitkv.codes import KV_FORMATS

    if not kw:
        return (k, v, kc, vc, sm, None, -1, int(KV_FORMATS["auto"]), None, None, -1.0, -1.0)
    return (k, v, kc, vc, sm, None, -1, int(KV_FORMATS[kw["kv_cache_dtype"]]), kw["k_scale"], kw["v_scale"], -1.0, -1.0)


def _module(kv_dtype, head_bytes, **spec_kw):
    from jitkv.codes import KV_FORMATS, SrcDtype
    from jitkv.jit import cuda_arch, get_function
    from jitkv.ops.store_cache import cuda_spec

    kv_dtype = kv_dtype.split()[0]  # a KV_KINDS entry: one module for both kinds of scales
    src = SrcDtype.NONE if kv_dtype == "auto" else SrcDtype.BF16
    spec = cuda_spec(cuda_arch(torch.device("cuda")), head_bytes, head_bytes, src, KV_FORMATS[kv_dtype], **spec_kw)
    return get_function(spec, "store_cache")


@gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_16_byte_build_answers_a_misaligned_call(kv_dtype):
    """Called directly with a view it cannot address, the 16-byte build returns NEEDS_ANY_ALIGNMENT
    from both entry points and writes nothing (an fp8 build counts source bytes per cache byte)."""
    from jitkv.codes import Status
    from jitkv.jit import cuda_arch, get_function
    from jitkv.ops.store_cache import COPY_ENTRY

    n, h, d = 5, 8, 128
    k, v, kc, vc, kw = _kv_case(n, h, d, d, 64, "cuda", kv_dtype)
    k = rand((n * h * d + 1,), torch.bfloat16, "cuda")[1:].view(n, h, d)  # 2-byte aligned base
    fn = _module(kv_dtype, d * kc.element_size())
    before_k, before_v = kc.clone(), vc.clone()
    sm = slots(64, n, torch.int64, "cuda")
    assert fn(*_binding_args(k, v, kc, vc, sm, kw)) == Status.NEEDS_ANY_ALIGNMENT
    if kv_dtype == "auto":
        from jitkv.ops.store_cache import cuda_spec

        copy = get_function(cuda_spec(cuda_arch(torch.device("cuda")), 2 * d, 2 * d, 0, 0), COPY_ENTRY)
        assert copy(k, v, kc, vc, sm, None, -1) == Status.NEEDS_ANY_ALIGNMENT
    torch.cuda.synchronize()
    assert_bitwise(kc, before_k)
    assert_bitwise(vc, before_v)


@gpu
@pytest.mark.parametrize("kv_dtype", KV_KINDS)
@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("n", [1, 3000])
def test_kernels_without_pdl(kv_dtype, generic, n):
    """Modules built with pdl=False (latency kernel at n = 1, bulk kernel at 3000 for 32 heads) write
    the reference's bytes."""
    k, v, kc, vc, kw = _kv_case(n, 32, 128, 128, 4096, "cuda", kv_dtype)
    sm = slots(4096, n, torch.int64, "cuda")
    ref_k, ref_v = kc.clone(), vc.clone()
    reference.store_cache(k, v, ref_k, ref_v, sm, **kw)
    _module(kv_dtype, 0 if generic else 128 * kc.element_size(), pdl=False)(*_binding_args(k, v, kc, vc, sm, kw))
    assert_bitwise(kc, ref_k)
    assert_bitwise(vc, ref_v)


def _every_float32_binade(n_rows, width):
    """float32 values with random mantissas over every binade (2^-149 ... 2^127), both signs, with ±0,
    ±inf and NaN among them."""
    exp = torch.randint(-149, 128, (n_rows, width)).double()
    x = (torch.rand(n_rows, width, dtype=torch.float64) + 1) * torch.pow(2.0, exp)
    x = torch.where(torch.rand(n_rows, width) < 0.5, -x, x).float()
    x.view(-1)[:5] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
def test_every_value_around_the_quick_division_window(device, kv_dtype, src):
    """The CUDA latency kernels divide without a branch, a scale outside the quick window first
    brought into it (jitkv/cuda/fp8.cuh Divider): the reference's bytes for
    every bf16/fp16 value (float32: every binade) at scales outside, on the edges of and inside that
    window, per side and per head (CPU too)."""
    h, d = 8, 128
    if src == torch.float32:
        x = _every_float32_binade(64 * h, d).view(-1, h, d).to(device)
    else:
        x = every_16_bit_value(src, h * d).view(-1, h, d).to(device)
    n = x.shape[0]
    cache_dtype = torch.float8_e4m3fn if kv_dtype == "fp8_e4m3" else torch.float8_e5m2
    kc, vc = rand((n + 7, h, d), cache_dtype, device), rand((n + 7, h, d), cache_dtype, device)
    sm = slots(n + 7, n, torch.int64, device)
    scales = QUICK_WINDOW_SCALES
    for i, scale in enumerate(scales):
        per_head = torch.tensor([scales[(i + j) % len(scales)] for j in range(h)], device=device)
        _run(x, x.flip(0), kc, vc, sm, "jit", kv_cache_dtype=kv_dtype, k_scale=scale, v_scale=per_head)


def test_triton_kernel_under_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 against the reference (CI has no GPU)."""
    run_under_interpreter(f"{__name__}:triton_interpreter_cases")


def triton_interpreter_cases():
    """Run by test_triton_kernel_under_interpreter in a process with TRITON_INTERPRET=1."""
    from jitkv.triton.store_cache import store_cache_triton

    n, h, d = 21, 4, 64
    for kv_dtype, cdt in (("auto", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.uint8)):
        k, v = rand((n + 3, h, d), torch.bfloat16) * 300, rand((n + 3, h, d), torch.bfloat16)
        kc = rand((6, h, 8, d), cdt).permute(0, 2, 1, 3)  # paged HND
        vc = rand((6, 8, h, d), cdt)  # paged NHD
        sm = slots(48, n)
        sm[::4] = -1
        loc_map = torch.randperm(48)
        loc_map[sm[1]] = -1
        # one scale per side; then per-head scales, V's a strided view
        per_head = (torch.rand(h) * 3 + 0.05, (torch.rand(2 * h) * 3 + 0.05)[::2])
        for k_scale, v_scale in ((torch.tensor([0.37]),) * 2, per_head)[: 1 if kv_dtype == "auto" else 2]:
            got_k, got_v, ref_k, ref_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            store_cache_triton(k, v, got_k, got_v, sm, kv_dtype, k_scale, v_scale, loc_map, 5)
            kw = {} if kv_dtype == "auto" else dict(k_scale=k_scale, v_scale=v_scale)
            reference.store_cache(k, v, ref_k, ref_v, sm, kv_cache_dtype=kv_dtype, loc_map=loc_map, skip_slot=5, **kw)
            assert_bitwise(got_k, ref_k)
            assert_bitwise(got_v, ref_v)
