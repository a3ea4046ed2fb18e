"""The benchmark's latency-floor kernels write their bytes at loc[0] and nothing else (GPU only): the
copy floor 16 source bytes, the e4m3 floor 8 values divided by the scale, the fp8_ds_mla floor two
128-value tiles and their scales, the rope floor 4 rotated pairs; the rope rows floor each token's q bytes
contiguous and its k and v bytes at its slot (their high bytes for fp8 widths). Their exact modes write
torch's bytes."""

from __future__ import annotations

import pytest
import torch

import jitkv
from jitkv.tests.conftest import assert_bitwise, gpu, rand


def _floor_fn(name="latency_floor"):
    from jitkv.benchmark.gpu import latency_floor_spec

    return jitkv.jit.get_function(latency_floor_spec(jitkv.jit.cuda_arch(torch.device("cuda"))), name)


SLOTS = [0, 37, 63, -1, 64, 1 << 40]


@gpu
@pytest.mark.parametrize("slot", SLOTS)
def test_writes_16_bytes_at_the_slot_only(slot):
    fn = _floor_fn()
    dst = rand((64, 576), torch.bfloat16, "cuda")
    src = rand((1, 576), torch.bfloat16, "cuda")
    expected = dst.clone()
    if 0 <= slot < 64:
        expected[slot, :8] = src[0, :8]  # 8 bf16 = 16 bytes
    fn(dst, torch.tensor([slot], device="cuda"), src)
    torch.cuda.synchronize()
    assert_bitwise(dst, expected)


@gpu
@pytest.mark.parametrize("slot", SLOTS)
@pytest.mark.parametrize("scale", [0.37, 2.0**-90, 2.0**110])
def test_e4m3_floor_writes_the_quotients_at_the_slot_only(slot, scale):
    fn = _floor_fn("latency_floor_e4m3")
    src = rand((1, 576), torch.bfloat16, "cuda") * 40
    scale_t = torch.tensor([scale], device="cuda")
    for exact in (True, False):
        dst = rand((64, 576), torch.uint8, "cuda")
        before = dst.clone()
        fn(dst, torch.tensor([slot], device="cuda"), src, scale_t, exact)
        torch.cuda.synchronize()
        if not 0 <= slot < 64:
            assert_bitwise(dst, before)
            continue
        q = (src[0, :8].float() / scale_t).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        if exact:
            before[slot, :8] = q
        else:  # x * rcp.approx(scale): torch's codes give or take one rounding step
            assert (dst[slot, :8].int() - q.int()).abs().max() <= 1
            before[slot, :8] = dst[slot, :8]
        assert_bitwise(dst, before)


@gpu
@pytest.mark.parametrize("slot", SLOTS)
def test_ds_mla_floor_writes_two_tiles_and_their_scales_at_the_slot_only(slot):
    fn = _floor_fn("latency_floor_ds_mla")
    src = rand((1, 576), torch.bfloat16, "cuda") * 40
    dst = rand((64, 656), torch.uint8, "cuda")
    expected = dst.clone()
    fn(dst, torch.tensor([slot], device="cuda"), src, 512, True)
    torch.cuda.synchronize()
    if 0 <= slot < 64:
        tiles = src[0, :256].float().view(2, 128)
        amax = tiles.abs().amax(dim=1)  # divided by a tensor: torch multiplies by 1 / a Python scalar
        scales = (amax / torch.full_like(amax, 448.0)).clamp_min(torch.finfo(torch.float32).tiny)
        expected[slot, :256] = (
            (tiles / scales[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).flatten()
        )
        expected[slot, 512:520] = scales.view(torch.uint8)
    assert_bitwise(dst, expected)


@gpu
@pytest.mark.parametrize("slot", SLOTS)
@pytest.mark.parametrize("position", [5, -3, 999])
def test_rope_floor_writes_the_rotated_pairs_at_the_slot_only(slot, position):
    """8 bf16 values rotated as 4 GPT-J pairs with the (clamped) position's cos/sin: reference.apply_rope."""
    from jitkv import reference
    from jitkv.ops.rope import cos_sin_table

    fn = _floor_fn("latency_floor_rope")
    src = rand((1, 576), torch.bfloat16, "cuda")
    cs = cos_sin_table(300, 64, device="cuda")
    dst = rand((64, 576), torch.bfloat16, "cuda")
    expected = dst.clone()
    fn(dst, torch.tensor([slot], device="cuda"), src, torch.tensor([position], device="cuda"), cs)
    torch.cuda.synchronize()
    if 0 <= slot < 64:
        row = cs[min(max(position, 0), 299)]  # cos half [0, 32), sin half [32, 64): the floor reads 4 of each
        rotated = reference.apply_rope(src[:, None, :8].float(), row[None, :4], row[None, 32:36], False)
        expected[slot, :8] = rotated[0, 0].to(torch.bfloat16)
    assert_bitwise(dst, expected)


@gpu
@pytest.mark.parametrize("half_q", [False, True])
@pytest.mark.parametrize("half_kv", [False, True])
def test_rope_rows_floor_stores_q_contiguous_and_k_v_at_the_slots_only(half_q, half_kv):
    """3 tokens of 64 q, 32 k and 32 v bf16 values: q's bytes in q_dst's row, k's and v's in the slot's
    rows (slots -1 and 9 past the 8-row caches write nothing), every byte (or, at half width, every
    high byte) unchanged."""
    fn = _floor_fn("latency_floor_rope_rows")
    n, qb, kvb = 3, 128, 64
    src = rand((n, qb + 2 * kvb), torch.uint8, "cuda")
    q_dst = rand((n, qb // (2 if half_q else 1)), torch.uint8, "cuda")
    caches = [rand((8, kvb // (2 if half_kv else 1)), torch.uint8, "cuda") for _ in "kv"]
    slots = torch.tensor([5, -1, 9], device="cuda")
    expected = [q_dst.clone(), *(c.clone() for c in caches)]
    fn(q_dst, *caches, slots, src, torch.tensor([2, 7, -4], device="cuda"), torch.randn(6, 16, device="cuda"), qb, 64)
    torch.cuda.synchronize()

    def stored(part, half):  # the bytes a destination gets of a source part
        return part[..., 1::2] if half else part  # the high byte of each bf16 value

    expected[0].copy_(stored(src[:, :qb], half_q))
    expected[1][5] = stored(src[0, qb : qb + kvb], half_kv)
    expected[2][5] = stored(src[0, qb + kvb :], half_kv)
    for got, want in zip((q_dst, *caches), expected):
        assert_bitwise(got, want)


@gpu
def test_bad_input():
    fn = _floor_fn()
    dst = torch.empty(64, 576, dtype=torch.bfloat16, device="cuda")
    src = torch.empty(1, 576, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="latency_floor: expected CUDA tensors dst"):
        fn(dst, torch.tensor([3], dtype=torch.int32, device="cuda"), src)
    loc = torch.tensor([3], device="cuda")
    with pytest.raises(ValueError, match="latency_floor_e4m3: expected a float32 CUDA scale"):
        _floor_fn("latency_floor_e4m3")(dst, loc, src, torch.ones(1, dtype=torch.float64, device="cuda"), True)
    with pytest.raises(ValueError, match="latency_floor_ds_mla: expected a scale_offset"):
        _floor_fn("latency_floor_ds_mla")(torch.empty(64, 656, dtype=torch.uint8, device="cuda"), loc, src, 100, True)
    rows = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in ((1, 64), (8, 32), (8, 32), (1, 96))]
    with pytest.raises(ValueError, match="latency_floor_rope_rows: expected CUDA positions and slots int64"):
        _floor_fn("latency_floor_rope_rows")(*rows[:3], loc, rows[3], loc, torch.empty(6, 16, device="cuda"), 64, 64)
