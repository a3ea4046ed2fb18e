"""jitkv.compat.vllm: each shim against vLLM's rule written out with torch indexing, bitwise over the
whole allocation (K and V halves and every untouched row), on caches poisoned with random bytes."""

from __future__ import annotations

import math

import pytest
import torch

from jitkv.compat import vllm
from jitkv.tests.conftest import assert_bitwise, gpu, rand, slots

DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t):
    """Same-width integer view: assignments through it copy bytes (float8 and NaN payloads included)."""
    return t.view(_INT[t.element_size()])


# ------------------------------------------------------------------------- reshape_and_cache_flash


def _allocate(layout, kv_dim, num_blocks, block_size, heads, head_size, dtype, device):
    """One K+V allocation as vLLM makes it: K/V pair first (kv_dim 0) or inside each block (kv_dim 1);
    HND stores each block as [heads, block_size, head_size]."""
    outer = (2, num_blocks) if kv_dim == 0 else (num_blocks, 2)
    inner = (heads, block_size) if layout == "HND" else (block_size, heads)
    return rand((*outer, *inner, head_size), dtype, device)


def _caches(alloc, layout, kv_dim):
    """(key_cache, value_cache) as vLLM passes them: logical [num_blocks, block_size, heads, head_size]
    strided views of the allocation."""
    logical = alloc.transpose(2, 3) if layout == "HND" else alloc
    return logical.unbind(kv_dim)


def _sources(n_rows, heads, head_size, dtype, device, wide=False):
    """key and value as views of a fused qkv tensor (token stride 3 * heads * head_size), as vLLM has them."""
    make = _wide_range if wide else rand
    return make((n_rows, 3, heads, head_size), dtype, device).unbind(1)[1:]


def _wide_range(shape, dtype, device):
    """Magnitudes 1e-3 .. 1e5 of both signs, plus NaN, ±inf, ±0 and values past the fp8 maxima."""
    mag = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e5)))
    x = mag * torch.where(torch.rand(shape) < 0.5, -1.0, 1.0)
    flat = x.view(-1)
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-6, -3e-5, 448.5, -500.0, 6e4]
    flat[: len(specials)] = torch.tensor(specials)
    flat[-len(specials) :] = torch.tensor(specials)
    return x.to(dtype).to(device)


def _slot_mapping(num_slots, n, idx_dtype, device):
    """n unique slots with every fifth one -1 (vLLM's padding) and slot 0 at position 1: vLLM reserves
    no slot, so block 0, row 0 is written like any other."""
    sm = slots(num_slots, n, idx_dtype)
    sm[sm == 0] = sm[1]
    sm[1] = 0
    sm[::5] = -1
    return sm.to(device)


def _quantizer(fp8, scale, device):
    """vLLM's fp8 rule for one cache: fp8(satfinite(x / scale)) in float32; a tensor scale of
    num_heads elements applies per head."""
    s = scale.float() if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32, device=device)
    s = s.reshape(-1, 1)  # [1, 1] or [heads, 1]: broadcasts over [rows, heads, head_size]
    m = FP8_MAX[fp8]
    return lambda x: (x.float() / s).clamp(-m, m).to(fp8)


def _expected_flash(key, value, key_cache, value_cache, slot_mapping, quant_k=None, quant_v=None):
    """vLLM's rule with torch indexing: for slot s >= 0, cache[s // block_size, s % block_size] = row."""
    block_size = key_cache.shape[1]
    rows = (slot_mapping >= 0).nonzero().flatten()
    s = slot_mapping[rows].long()
    for src, cache, quant in ((key, key_cache, quant_k), (value, value_cache, quant_v)):
        vals = src[rows] if quant is None else quant(src[rows])
        _bits(cache)[s // block_size, s % block_size] = _bits(vals)


def _check_flash(
    key,
    value,
    alloc,
    layout,
    kv_dim,
    slot_mapping,
    kv_cache_dtype,
    k_scale=None,
    v_scale=None,
    quant_k=None,
    quant_v=None,
):
    got, want = alloc.clone(), alloc.clone()
    vllm.reshape_and_cache_flash(
        key, value, *_caches(got, layout, kv_dim), slot_mapping, kv_cache_dtype, k_scale, v_scale
    )
    _expected_flash(key, value, *_caches(want, layout, kv_dim), slot_mapping, quant_k, quant_v)
    assert not torch.equal(_bits(want), _bits(alloc))  # the reference wrote something
    assert_bitwise(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dim", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache_flash_auto(device, layout, kv_dim, dtype, block_size, idx_dtype):
    heads, head_size, num_blocks, n = 8, 64, 24, 50  # heads == 8 and block_size 16 vs 5: strides, not shapes, say HND
    key, value = _sources(n + 7, heads, head_size, dtype, device)  # 7 padding rows vLLM never writes
    alloc = _allocate(layout, kv_dim, num_blocks, block_size, heads, head_size, dtype, device)
    sm = _slot_mapping(num_blocks * block_size, n, idx_dtype, device)
    _check_flash(key, value, alloc, layout, kv_dim, sm, "auto", torch.ones(1, device=device), None)


def _scales(kind, heads, device):
    """k and v scales in the forms vLLM has passed them."""
    if kind == "float":
        return 0.37, 2.5
    if kind == "per_head":
        return (torch.linspace(0.05, 3.0, heads, device=device), torch.linspace(4.0, 0.5, heads, device=device))
    shape = () if kind == "0-dim" else (1,)  # vLLM's tests pass x.amax() / 64: a 0-dim tensor
    return torch.full(shape, 0.37, device=device), torch.full(shape, 2.5, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
@pytest.mark.parametrize("as_uint8", [False, True])
@pytest.mark.parametrize("scale_kind", ["0-dim", "[1]", "per_head", "float"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reshape_and_cache_flash_fp8(device, kv_cache_dtype, as_uint8, scale_kind, layout, src_dtype):
    heads, head_size, num_blocks, block_size, n = 4, 64, 16, 16, 61
    fp8 = FORMATS[kv_cache_dtype]
    key, value = _sources(n + 3, heads, head_size, src_dtype, device, wide=True)
    alloc = _allocate(layout, 1, num_blocks, block_size, heads, head_size, torch.uint8 if as_uint8 else fp8, device)
    sm = _slot_mapping(num_blocks * block_size, n, torch.int64, device)
    k_scale, v_scale = _scales(scale_kind, heads, device)
    _check_flash(
        key,
        value,
        alloc,
        layout,
        1,
        sm,
        kv_cache_dtype,
        k_scale,
        v_scale,
        _quantizer(fp8, k_scale, device),
        _quantizer(fp8, v_scale, device),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_flash_fp8_saturates(device):
    """satfinite: finite values past the maximum and ±inf store ±max; tiny values store 0."""
    x = torch.tensor([1e4, -1e4, float("inf"), -float("inf"), 449.0, 1e-12, 0.0, 1.0]).repeat(4, 2, 8)
    x = x.to(torch.bfloat16).to(device)  # [4, 2, 64]
    alloc = _allocate("NHD", 1, 1, 4, 2, 64, torch.float8_e4m3fn, device)
    key_cache, value_cache = _caches(alloc, "NHD", 1)
    one = torch.ones((), device=device)
    vllm.reshape_and_cache_flash(x, x, key_cache, value_cache, torch.arange(4, device=device), "fp8", one, one)
    assert key_cache[0, 0, 0, :8].float().tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 0.0, 0.0, 1.0]


def _fp8_args(device):
    heads, head_size = 2, 64
    key, value = _sources(8, heads, head_size, torch.bfloat16, device)
    alloc = _allocate("NHD", 1, 4, 8, heads, head_size, torch.float8_e4m3fn, device)
    scale = torch.ones(1, device=device)
    return [key, value, *_caches(alloc, "NHD", 1), slots(32, 8, torch.int64, device), "fp8", scale, scale], alloc


def _set(i, value):
    def mutate(args, device):
        args[i] = value(args, device) if callable(value) else value

    return mutate


BAD = [
    # (name, mutate(args, device), exception, message)
    ("value dtype differs", _set(1, lambda a, d: a[1].half()), TypeError, r"store_cache: v\b"),
    ("fewer heads in key", _set(0, lambda a, d: a[0][:, :1]), ValueError, r"store_cache: k_cache\b"),
    ("unknown kv_cache_dtype", _set(5, "int4"), ValueError, r"store_cache: kv_cache_dtype\b"),
    ("e5m2 on an e4m3 cache", _set(5, "fp8_e5m2"), ValueError, r"store_cache: k_cache\b"),
    ("slot_mapping float", _set(4, lambda a, d: a[4].float()), TypeError, r"store_cache: slot_mapping\b"),
    (
        "scale sizes differ",
        _set(7, lambda a, d: torch.ones(2, device=d)),
        ValueError,
        r"reshape_and_cache_flash: k_scale\b",
    ),
    (
        "scales of 3 for 2 heads",
        lambda a, d: a.__setitem__(slice(6, 8), [torch.ones(3, device=d)] * 2),
        ValueError,
        r"reshape_and_cache_flash: k_scale\b",
    ),
    (
        "scale float64",
        _set(6, lambda a, d: torch.ones(1, dtype=torch.float64, device=d)),
        TypeError,
        r"store_cache: k_scale\b",
    ),
    ("scale zero", _set(6, 0.0), ValueError, r"store_cache: k_scale\b"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_reshape_and_cache_flash_bad_input(device, case):
    _, mutate, exc, message = case
    args, alloc = _fp8_args(device)
    before = alloc.clone()
    mutate(args, device)
    with pytest.raises(exc, match=message):
        vllm.reshape_and_cache_flash(*args)
    assert_bitwise(alloc, before)


def test_reshape_and_cache_flash_out_of_range_raises_cpu():
    """vLLM writes out of bounds; jitkv on CPU raises before writing anything."""
    args, alloc = _fp8_args("cpu")
    args[4][-1] = 32  # 4 blocks of 8 slots
    before = alloc.clone()
    with pytest.raises(IndexError, match="position 7 has slot 32"):
        vllm.reshape_and_cache_flash(*args)
    assert_bitwise(alloc, before)


@gpu
def test_reshape_and_cache_flash_out_of_range_skipped_cuda():
    """jitkv's CUDA kernels skip an out-of-range slot (vLLM's would write out of bounds)."""
    key, value = _sources(8, 2, 64, torch.bfloat16, "cuda")
    alloc = _allocate("HND", 1, 4, 8, 2, 64, torch.bfloat16, "cuda")
    sm = slots(32, 8, torch.int64, "cuda")
    sm[3] = 32
    got, want = alloc.clone(), alloc.clone()
    vllm.reshape_and_cache_flash(key, value, *_caches(got, "HND", 1), sm, "auto", None, None)
    keep = sm < 32
    _expected_flash(key[keep], value[keep], *_caches(want, "HND", 1), sm[keep])
    assert_bitwise(got, want)


# ---------------------------------------------------------------------------- concat_and_cache_mla


def _mla_sources(n_rows, rank, pe, dtype, device, pe_3d=False):
    """kv_c and k_pe as column slices of one projection output (row stride rank + pe + 16)."""
    fused = rand((n_rows, rank + pe + 16), dtype, device)
    kv_c, k_pe = fused[:, :rank], fused[:, rank + 16 :]
    return kv_c, (k_pe.unsqueeze(1) if pe_3d else k_pe)


def _expected_mla(kv_c, k_pe, kv_cache, slot_mapping):
    """vLLM's rule with torch indexing: for slot s >= 0, kv_cache[s // bs, s % bs] = [kv_c[i] | k_pe[i]]."""
    block_size = kv_cache.shape[1]
    rows = (slot_mapping >= 0).nonzero().flatten()
    s = slot_mapping[rows].long()
    vals = torch.cat([kv_c[rows], k_pe[rows].reshape(rows.numel(), -1)], dim=1)
    _bits(kv_cache)[s // block_size, s % block_size] = _bits(vals)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rank,pe", [(512, 64), (256, 64)])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("pe_3d", [False, True])
def test_concat_and_cache_mla_auto(device, dtype, rank, pe, block_size, idx_dtype, pe_3d):
    num_blocks, n = 12, 150
    kv_c, k_pe = _mla_sources(n + 5, rank, pe, dtype, device, pe_3d)
    kv_cache = rand((num_blocks, block_size, rank + pe), dtype, device)
    sm = _slot_mapping(num_blocks * block_size, n, idx_dtype, device)
    got, want = kv_cache.clone(), kv_cache.clone()
    vllm.concat_and_cache_mla(kv_c, k_pe, got, sm, "auto", torch.ones(1, device=device))
    _expected_mla(kv_c, k_pe, want, sm)
    assert not torch.equal(_bits(want), _bits(kv_cache))
    assert_bitwise(got, want)


def _mla_args(device, width_extra=0):
    kv_c, k_pe = _mla_sources(8, 512, 64, torch.bfloat16, device)
    kv_cache = rand((4, 16, 576 + width_extra), torch.bfloat16, device)
    return [kv_c, k_pe, kv_cache, slots(64, 8, torch.int64, device), "auto", torch.ones(1, device=device)]


def _ds_mla_record(kv_c, k_pe):
    """vLLM's fp8_ds_mla rule for rows [n, 512] + [n, 64]: per tile of 128 nope values, scale =
    max(amax / 448, FLT_MIN) in float32; values e4m3(satfinite(x / scale)); record = [512 e4m3 bytes |
    4 fp32 scales | the 64 rope values' 16-bit patterns]."""
    n = kv_c.shape[0]
    tiles = kv_c.float().reshape(n, 4, 128)
    scale = torch.maximum(
        tiles.abs().amax(-1) / torch.tensor(448.0, device=kv_c.device),
        torch.tensor(torch.finfo(torch.float32).tiny, device=kv_c.device),
    )
    q = (tiles / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(n, 512)
    return torch.cat(
        [
            q.view(torch.uint8),
            scale.view(torch.uint8).reshape(n, 16),
            k_pe.reshape(n, 64).contiguous().view(torch.uint8),
        ],
        dim=1,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("as_uint8", [True, False])
@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_concat_and_cache_mla_fp8(device, kv_cache_dtype, as_uint8, scale_kind):
    fp8 = FORMATS[kv_cache_dtype]
    kv_c, k_pe = _mla_sources(70, 512, 64, torch.bfloat16, device)
    kv_cache = rand((8, 16, 576), torch.uint8 if as_uint8 else fp8, device)
    sm = _slot_mapping(128, 64, torch.int64, device)
    scale = torch.tensor([0.37], device=device) if scale_kind == "tensor" else 0.37
    got, want = kv_cache.clone(), kv_cache.clone()
    vllm.concat_and_cache_mla(kv_c, k_pe, got, sm, kv_cache_dtype, scale)
    quant = _quantizer(fp8, scale, device)
    rows = (sm >= 0).nonzero().flatten()
    s = sm[rows].long()
    vals = quant(torch.cat([kv_c[rows], k_pe[rows]], dim=1).unsqueeze(1)).squeeze(1)
    _bits(want)[s // 16, s % 16] = _bits(vals).to(_bits(want).dtype) if as_uint8 else _bits(vals)
    assert_bitwise(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_concat_and_cache_mla_fp8_ds_mla(device, dtype):
    kv_c, k_pe = _mla_sources(70, 512, 64, dtype, device)
    kv_cache = rand((8, 16, 656), torch.uint8, device)
    sm = _slot_mapping(128, 64, torch.int32, device)
    got, want = kv_cache.clone(), kv_cache.clone()
    vllm.concat_and_cache_mla(kv_c, k_pe, got, sm, "fp8_ds_mla", torch.ones(1, device=device))
    rows = (sm >= 0).nonzero().flatten()
    s = sm[rows].long()
    want[s // 16, s % 16] = _ds_mla_record(kv_c[rows], k_pe[rows])
    assert_bitwise(got, want)


MLA_BAD = [
    (
        "unknown kv_cache_dtype",
        lambda a, d: a.__setitem__(4, "int8"),
        ValueError,
        r"concat_and_cache_mla: kv_cache_dtype\b",
    ),
    (
        "wider row",
        lambda a, d: a.__setitem__(2, rand((4, 16, 584), torch.bfloat16, d)),
        ValueError,
        r"concat_and_cache_mla: kv_cache: expected a row width of .* = 576, got 584",
    ),
    (
        "blocks not packed",
        lambda a, d: a.__setitem__(2, rand((4, 32, 576), torch.bfloat16, d)[:, :16]),
        ValueError,
        r"concat_and_cache_mla: kv_cache: blocks must be packed",
    ),
    (
        "flat cache",
        lambda a, d: a.__setitem__(2, rand((64, 576), torch.bfloat16, d)),
        ValueError,
        r"concat_and_cache_mla: kv_cache: expected shape",
    ),
    ("kv_c dtype", lambda a, d: a.__setitem__(0, a[0].half()), TypeError, r"set_mla_kv_buffer: cache_k_nope\b"),
    ("slot_mapping 2-D", lambda a, d: a.__setitem__(3, a[3].view(2, 4)), ValueError, r"set_mla_kv_buffer: loc\b"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MLA_BAD, ids=[c[0] for c in MLA_BAD])
def test_concat_and_cache_mla_bad_input(device, case):
    _, mutate, exc, message = case
    args = _mla_args(device)
    mutate(args, device)
    before = args[2].clone()
    with pytest.raises(exc, match=message):
        vllm.concat_and_cache_mla(*args)
    assert_bitwise(args[2], before)


def test_concat_and_cache_mla_out_of_range_raises_cpu():
    args = _mla_args("cpu")
    args[3][2] = 64  # 4 blocks of 16
    before = args[2].clone()
    with pytest.raises(IndexError, match="position 2 has slot 64"):
        vllm.concat_and_cache_mla(*args)
    assert_bitwise(args[2], before)


# ---------------------------------------------------------------- concat_and_cache_mla_rope_fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float32])
def test_concat_and_cache_mla_rope_fused(device, kv_cache_dtype, is_neox, table_dtype):
    """vLLM's rule: q_pe and k_pe rotated in place; kv_cache[slot] = [kv_c | rotated k_pe] (copied, or
    fp8(satfinite(x / scale)) of the rotated value), slot < 0 skipped. Rotations in float32 with one
    rounding (jitkv's arithmetic; vLLM's own rounds in the model dtype, see the shim's docstring)."""
    from jitkv.tests.compat.rope_rule import rotate, table

    n, h, rank, rot, bs = 19, 4, 128, 32, 8
    bf16 = torch.bfloat16
    latent = rand((n, rank + rot), bf16, device)  # kv_c and k_pe: column views of one projection output
    kv_c, k_pe = latent.split([rank, rot], dim=1)
    q_pe = rand((n, 3 * h, rot), bf16, device)[:, ::3]  # a strided head view
    cs = table(300, rot, table_dtype).to(device)
    positions = torch.randint(0, 300, (n + 4,), device=device)
    fp8 = FORMATS.get(kv_cache_dtype)
    cache = rand((10, bs, rank + rot), fp8 or bf16, device)
    sm = slots(10 * bs, n, torch.int64, device)
    sm[::5] = -1
    scale = torch.tensor([0.25], device=device)
    want_q, want_k, want_cache = q_pe.clone(), k_pe.clone(), cache.clone()
    for t in range(n):
        want_q[t] = rotate(q_pe[t], positions[t], cs, is_neox).to(bf16)
        k_rot = rotate(k_pe[t], positions[t], cs, is_neox)
        want_k[t] = k_rot.to(bf16)
        s = int(sm[t])
        if s < 0:
            continue
        row = want_cache.view(-1, rank + rot)[s]
        if fp8 is None:
            row.copy_(torch.cat([kv_c[t], k_rot.to(bf16)]))
        else:
            m = FP8_MAX[fp8]
            vals = torch.cat([kv_c[t].float(), k_rot]) / scale
            _bits(row).copy_(_bits(vals.clamp(-m, m).to(fp8)))
    vllm.concat_and_cache_mla_rope_fused(positions, q_pe, k_pe, kv_c, cs, is_neox, sm, cache, kv_cache_dtype, scale)
    assert_bitwise(q_pe, want_q)
    assert_bitwise(k_pe, want_k)
    assert_bitwise(cache, want_cache)


def test_concat_and_cache_mla_rope_fused_refuses_ds_mla_and_wide_rows():
    """fp8_ds_mla, rows wider than the parts, and a k_pe that is no tensor (named k_pe, not the op's
    k_pe_out, which vLLM's k_pe also is) raise before anything is written."""
    kv_c, k_pe, q_pe = (
        rand((4, 512), torch.bfloat16, "cpu"),
        rand((4, 64), torch.bfloat16, "cpu"),
        rand((4, 2, 64), torch.bfloat16, "cpu"),
    )
    args = (torch.arange(4), q_pe, k_pe, kv_c, torch.randn(16, 64).bfloat16(), False, torch.arange(4))
    with pytest.raises(ValueError, match=r"^concat_and_cache_mla_rope_fused: kv_cache_dtype: expected one of auto"):
        vllm.concat_and_cache_mla_rope_fused(*args, rand((2, 4, 656), torch.uint8, "cpu"), "fp8_ds_mla", None)
    with pytest.raises(ValueError, match=r"^concat_and_cache_mla_rope_fused: kv_cache: expected a row width of"):
        vllm.concat_and_cache_mla_rope_fused(*args, rand((2, 4, 600), torch.bfloat16, "cpu"), "auto", None)
    cache = rand((2, 4, 576), torch.bfloat16, "cpu")
    before = cache.clone()
    with pytest.raises(TypeError, match=r"^rope_set_mla_kv_buffer: k_pe: expected a torch.Tensor, got list$"):
        vllm.concat_and_cache_mla_rope_fused(*args[:2], k_pe.tolist(), *args[3:], cache, "auto", None)
    assert_bitwise(cache, before)


# ------------------------------------------------------------------------------------- swap_blocks


def _swap_rule(src, dst, block_bytes, mapping):
    """vLLM's swap_blocks: for each (s, d), block_bytes bytes from src's base + s * block_bytes to dst's
    base + d * block_bytes (on flat byte views of the whole caches)."""
    want = dst.cpu().clone()
    flat_src, flat_dst = src.cpu().contiguous().view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)
    for s, d in mapping.tolist():
        flat_dst[d * block_bytes : (d + 1) * block_bytes] = flat_src[s * block_bytes : (s + 1) * block_bytes]
    return want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["out", "in", "same"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("mapping_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("heads,head_size", [(2, 64), (32, 128)], ids=["small-blocks", "copy-engine-blocks"])
def test_swap_blocks(device, direction, dtype, mapping_dtype, heads, head_size):
    """K and V halves of [2, num_blocks, block_size, heads, head_size] caches, swapped out (device ->
    host), in (host -> device) or on one device; a host cache beside a GPU one is pinned. The mapping on
    the CPU as vLLM keeps it: on a GPU, blocks of 2-4 KiB take the SM kernel, of 64-128 KiB the copy
    engines."""
    shape = (2, 12, 16, heads, head_size)
    pin = device == "cuda"
    gpu_kv, host_kv = rand(shape, dtype, device), rand(shape, dtype)
    host_kv = host_kv.pin_memory() if pin else host_kv
    src_kv, dst_kv = {"out": (gpu_kv, host_kv), "in": (host_kv, gpu_kv), "same": (gpu_kv, rand(shape, dtype, device))}[
        direction
    ]
    mapping = torch.tensor([[3, 0], [11, 7], [0, 11], [5, 2]], dtype=mapping_dtype)
    block = 16 * heads * head_size * dtype.itemsize
    for half in range(2):
        src, dst = src_kv[half], dst_kv[half]
        want = _swap_rule(src, dst, block, mapping)
        vllm.swap_blocks(src, dst, block, mapping)
        if device == "cuda":
            torch.cuda.synchronize()
        assert_bitwise(dst.cpu(), want)


def test_swap_blocks_bad_input():
    src, dst = rand((4, 16, 64), torch.bfloat16), rand((4, 16, 64), torch.bfloat16)
    before = dst.clone()
    mapping = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match=r"^swap_blocks: block_size_in_bytes: expected 2048 \(the bytes of src\[0\]\)"):
        vllm.swap_blocks(src, dst, 1024, mapping)
    with pytest.raises(ValueError, match=r"^swap_blocks: block_mapping: expected shape \[N, 2\], got \[2\]$"):
        vllm.swap_blocks(src, dst, 2048, mapping.view(-1))
    with pytest.raises(TypeError, match=r"^swap_blocks: block_mapping: expected dtype int32 or int64, got float32$"):
        vllm.swap_blocks(src, dst, 2048, mapping.float())
    with pytest.raises(IndexError, match=r"^transfer_pages: dst_pages: position 0 has page 4, out of range"):
        vllm.swap_blocks(src, dst, 2048, torch.tensor([[0, 4]]))
    assert_bitwise(dst, before)
