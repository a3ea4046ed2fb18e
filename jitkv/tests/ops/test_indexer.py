"""DeepSeek-V3.2 indexer K cache (docs/design.md §5.1): writer and gather byte for byte against the torch
reference over whole buffers, on every backend of every device present (CPU: jit, torch; CUDA: jit,
triton, torch); the scales and e4m3 bytes against an independent computation and torch's fp8
conversion; the round-trip error bound; the layout descriptor; bad inputs."""

from __future__ import annotations

import pytest
import torch

import jitkv
from jitkv import INDEXER_K_CACHE as L
from jitkv import reference
from jitkv.tests.conftest import BACKENDS, DEV_BACKENDS, assert_bitwise, gpu, rand, slots
from jitkv.tests.triton.interpreter import run_under_interpreter

WRITE_OP, GATHER_OP = "indexer_k_quant_and_cache", "gather_indexer_k_quant_cache"
WRITE, GATHER = jitkv.indexer_k_quant_and_cache, jitkv.gather_indexer_k_quant_cache
NUM_BLOCKS = {64: 8, 3: 100}  # 512 / 300 slots
# (block size, layout): "2d" jitkv's allocation (stride rounded up to 16: 8448 at 64, 400 at 3); "3d"
# vLLM's [num_blocks, block_size, 132] (stride block_size * 132: 396 at 3, which the CUDA kernels
# refuse, so auto runs Triton there); "wide" a [num_blocks, W] slice of a wider allocation.
CACHES = [(64, "2d"), (64, "3d"), (64, "wide"), (3, "2d"), (3, "3d")]
WIDE = 144  # extra bytes per block of the "wide" layout (the stride stays a multiple of 16)
DTYPES = [torch.bfloat16, torch.float16]
FMTS = [None, "ue8m0"]
SPECIAL = [  # (row, dims, value): amax 3.5 (scale exactly 2^-7) and just above it, amax below the 1e-4
    # floor, a zero row, ±inf, one NaN, an all-NaN row, denormals, near the bf16 and fp16 maxima
    (0, slice(0, 128), 3.5),
    (1, slice(0, 128), -3.5),
    (1, 9, 3.515625),
    (2, slice(0, 128), 1e-30),
    (3, slice(0, 128), 0.0),
    (4, 3, float("inf")),
    (4, 70, -float("inf")),
    (5, 10, float("nan")),
    (6, slice(0, 128), float("nan")),
    (7, slice(0, 64), 3e-39),
    (7, slice(64, 128), 5e-8),
    (8, 100, 3.3e38),
    (9, 100, -65504.0),
]


def _k(rows, device, dtype, col=0, special=True, mags=(1e-3, 1.0, 100.0)):
    """[rows, 128] at column `col` of a [rows, 136] buffer: a magnitude per row spread over 2^-8..2^8,
    and (special) the SPECIAL rows plus a -NaN."""
    x = torch.randn(rows, 128) * torch.tensor(mags)[torch.randint(len(mags), (rows, 1))]
    x *= torch.exp2(torch.randint(-8, 9, (rows, 1)).float())
    base = torch.zeros(rows, 136, dtype=dtype)
    k = base[:, col : col + 128]
    k.copy_(x)
    for row, dims, val in SPECIAL if special else ():
        if row < rows:
            k[row, dims] = val
    if special and rows > 10:
        k.view(torch.int16)[10, 11] = -0x40  # bf16 0xFFC0 / fp16 0xFFC0: a negative NaN
    return base.to(device)[:, col : col + 128]


def _cache(block_size, layout, device):
    """Random bytes (most blocks' scales in a realistic range) in a 2-D allocation; "wide" has a larger
    stride and one leading row that is not part of the cache (see _blocks)."""
    bs, nb = block_size, NUM_BLOCKS[block_size]
    stride = bs * 132 if layout == "3d" else L.block_stride(bs) + (WIDE if layout == "wide" else 0)
    c = rand((nb + (layout == "wide"), stride), torch.uint8)
    tame = torch.rand(c.shape[0]) < 0.75
    s = L.scale_offset(bs)
    c[tame, s : s + 4 * bs] = (torch.rand(int(tame.sum()), bs) + 0.01).view(torch.uint8)
    return c.to(device)


def _blocks(c, layout):
    """The [num_blocks, W] cache of an allocation made by _cache ("wide": W = the default stride, less
    than stride(0), as a 2-D cache's width gives its block size)."""
    return c[1:, : c.shape[1] - WIDE] if layout == "wide" else c


def _view(c, block_size, layout):
    """The cache argument: 2-D, or the [num_blocks, block_size, 132] view of the same allocation."""
    if layout == "3d":
        return c.view(c.shape[0], block_size, 132)
    return _blocks(c, layout)


def _token_bytes(c, slot, block_size):
    """(values [m, 128], scale bytes [m, 4]) of slots [m] of a [num_blocks, W] cache."""
    s = slot.long()
    blk, pos = s // block_size, (s % block_size)[:, None]
    ar = torch.arange(128, device=s.device)
    values = c[blk[:, None], pos * 128 + ar]
    scale = c[blk[:, None], L.scale_offset(block_size) + pos * 4 + ar[:4]]
    return values, scale


def _skip_refused(device, backend, block_size, layout):
    """Forcing the jit backend on CUDA with vLLM's 396-byte blocks raises (test_unaligned_views_fall_back)."""
    if device == "cuda" and backend == "jit" and (block_size * 132) % 16 and layout == "3d":
        pytest.skip("the CUDA kernels refuse blocks that are not 16-byte aligned")


def _write(k, c, sm, bs, layout, backend, fmt):
    """The op and the reference on clones of the whole allocation; they must agree byte for byte."""
    got, ref = c.clone(), c.clone()
    WRITE(k, _view(got, bs, layout), sm, block_size=bs, scale_fmt=fmt, backend=backend)
    reference.indexer_k_quant_and_cache(k, _view(ref, bs, layout), sm, block_size=bs, scale_fmt=fmt)
    assert_bitwise(got, ref)
    return got


def _expected_scale(k, fmt):
    """The scale from first principles: max |x| over non-NaN values in float64, floored at fp32(1e-4),
    over 448 (one rounding to fp32: float64 carries more than twice fp32's bits); "ue8m0": the smallest
    power of two >= it, from frexp (s = f * 2^E, f in [0.5, 1): 2^E, or 2^(E-1) when f == 0.5)."""
    x = k.double().abs()
    amax = torch.where(torch.isnan(x), 0.0, x).amax(1)
    s = (amax.clamp(min=torch.tensor(1e-4, dtype=torch.float32).item()) / 448).float()
    if fmt == "ue8m0":
        f, e = torch.frexp(s.double())
        s = torch.where(torch.isinf(s), s, torch.ldexp(torch.ones_like(f), e - (f == 0.5).int()).float())
    return s


# -------------------------------------------------------------------------------------- writer


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("block_size,layout", CACHES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(
    "idx_dtype,n", [(torch.int64, 0), (torch.int32, 1), (torch.int64, 2), (torch.int32, 77), (torch.int64, 77)]
)
def test_writer_matches_reference(device, backend, block_size, layout, dtype, fmt, idx_dtype, n):
    _skip_refused(device, backend, block_size, layout)
    c = _cache(block_size, layout, device)
    k = _k(n + 3, device, dtype)  # extra rows are never read
    sm = slots(NUM_BLOCKS[block_size] * block_size, n, idx_dtype, device)
    sm[3::5] = -1
    got = _write(k, c, sm, block_size, layout, backend, fmt)
    # Independent of the reference: scales from first principles, values torch's fp8 conversion of
    # x / scale, no other byte touched.
    keep = (sm >= 0).nonzero().flatten()
    values, scale = _token_bytes(_blocks(got, layout), sm[keep], block_size)
    want = _expected_scale(k[keep].cpu(), fmt)
    assert_bitwise(scale.cpu().contiguous().view(torch.float32).flatten(), want)
    q = (k[keep].float() / want.to(device)[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert_bitwise(values, q.view(torch.uint8))
    touched = torch.zeros_like(c, dtype=torch.bool)
    blk, pos = sm[keep].long() // block_size, (sm[keep].long() % block_size)[:, None]
    ar = torch.arange(128, device=device)
    _blocks(touched, layout)[blk[:, None], pos * 128 + ar] = True
    _blocks(touched, layout)[blk[:, None], L.scale_offset(block_size) + pos * 4 + ar[:4]] = True
    assert_bitwise(got[~touched], c[~touched])


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_writer_special_values(device, backend):
    """Every SPECIAL row, spelled out: ue8m0 keeps an exact power of two and rounds one ulp above it up;
    the 1e-4 floor; NaN ignored by the amax (an all-NaN row gets the floor's scale) and stored as NaN;
    an inf amax gives an inf scale (finite values 0, inf NaN)."""
    k = _k(11, device, torch.bfloat16)
    c = L.allocate(1, 16, device)
    WRITE(k, c, torch.arange(11, device=device), block_size=16, scale_fmt="ue8m0", backend=backend)
    values, scale = _token_bytes(c, torch.arange(11, device=device), 16)
    scale = scale.cpu().contiguous().view(torch.float32).flatten()
    floor = float(2.0**-22)  # max(amax, 1e-4) / 448 = 2.2e-7, rounded up
    assert scale[:4].tolist() == [2.0**-7, 2.0**-6, floor, floor]
    assert scale[4] == float("inf") and scale[6] == floor
    assert (values[0] == 0x7E).all() and (values[3] == 0).all()  # 3.5 / 2^-7 = 448: the e4m3 maximum
    nan = values.view(torch.float8_e4m3fn).float().isnan()
    assert nan[5].sum() == 1 and nan[6].all() and nan[10, 11]
    fin = torch.isfinite(k[4].float())
    assert (values[4][fin] & 0x7F == 0).all() and nan[4][~fin].all()


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
def test_out_of_range_slot_raises_before_writing_cpu(backend):
    c = _cache(3, "2d", "cpu")
    before = c.clone()
    sm = slots(300, 9)
    sm[4] = 300
    with pytest.raises(IndexError, match=r"slot_mapping: position 4 has slot 300\b"):
        WRITE(_k(9, "cpu", torch.bfloat16), c, sm, block_size=3, backend=backend)
    assert_bitwise(c, before)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_duplicate_slots_write_one_token(device, backend):
    """Tokens sharing a slot: the slot's values are one token's, its scale one token's (on GPUs, as in
    vLLM, not necessarily the same token's: the stores of two tokens may interleave)."""
    k = _k(40, device, torch.bfloat16, special=False)
    sm = torch.arange(40, device=device) % 7
    c = L.allocate(2, 8, device)
    WRITE(k, c, sm, block_size=8, backend=backend)
    values, scale = _token_bytes(c, torch.arange(7, device=device), 8)
    for s in range(7):
        cands = [reference.indexer_quantize_tokens(k[t : t + 1]) for t in range(s, 40, 7)]
        assert any(torch.equal(values[s], v[0]) for v, _ in cands)
        assert any(torch.equal(scale[s], sc[0]) for _, sc in cands)


# -------------------------------------------------------------------------------------- gather

GATHER_CASES = [  # (block size, sequence lengths, cu_seq_lens[0], extra dst rows, block-table width)
    (64, [300], 0, 0, None),
    (64, [70, 0, 129, 5], 0, 7, None),
    (64, [40, 64, 65], 9, 3, 1),
    (3, [7, 1, 0, 25, 3], 0, 4, None),
    (3, [50, 2], 5, 0, 6),
    (3, [], 0, 5, None),
]


def _requests(bs, lens, first, extra, width, device):
    """cu_seq_lens from the lengths (starting at `first`), dst rows for all tokens plus `extra`, and a block
    table (row stride != width) with -1 entries, an entry equal to num_blocks and one of 2^31 - 1 (zero
    bytes); `width` shorter than a request's blocks puts tokens past the table."""
    nb = NUM_BLOCKS[bs]
    cu = torch.tensor([first] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    need = max([-(-n // bs) for n in lens] + [1])
    width = need if width is None else width
    bt = torch.randint(0, nb, (max(len(lens), 1), width + 3), dtype=torch.int32)[: len(lens)]
    if len(lens):
        bt[torch.rand(bt.shape) < 0.1] = -1
        bt[0, 0], bt[-1, width - 1] = nb, 2**31 - 1
    return cu.to(device), bt.to(device)[:, :width], int(cu[-1]) + extra


def _dst(num_tokens, scale_kind, k_dtype, device, gen=None):
    """Random dst_k and dst_scale inside larger buffers (rows strided, the buffers' other bytes checked
    by the callers): "f32" [T], "f32x1" [T, 1] (row stride 3), "u8x4" vLLM's [T, 4] uint8."""
    dk = rand((num_tokens, 144), torch.uint8, device, gen).view(k_dtype)
    if scale_kind == "f32":
        ds = rand((num_tokens,), torch.float32, device, gen)
    elif scale_kind == "f32x1":
        ds = rand((num_tokens, 3), torch.float32, device, gen)
    else:
        ds = rand((num_tokens, 8), torch.uint8, device, gen)
    return dk, ds


def _dst_views(dk, ds, scale_kind):
    """The dst_k and dst_scale arguments inside the buffers _dst makes."""
    return dk[:, 16:144], ds if scale_kind == "f32" else ds[:, 1:2] if scale_kind == "f32x1" else ds[:, 4:8]


def _gather(c, bs, layout, cu, bt, rows, scale_kind, k_dtype, backend):
    """The op and the reference into clones of random buffers; compare them whole."""
    dk, ds = _dst(rows, scale_kind, k_dtype, c.device)
    got, ref = (dk.clone(), ds.clone()), (dk.clone(), ds.clone())
    GATHER(_view(c, bs, layout), *_dst_views(*got, scale_kind), bt, cu, block_size=bs, backend=backend)
    reference.gather_indexer_k_quant_cache(_view(c, bs, layout), *_dst_views(*ref, scale_kind), bt, cu, block_size=bs)
    assert_bitwise(got[0], ref[0])
    assert_bitwise(got[1], ref[1])
    return (dk, ds), got


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize(
    "layout,case", [(layout, case) for bs, layout in CACHES for case in GATHER_CASES if case[0] == bs], ids=str
)
@pytest.mark.parametrize(
    "scale_kind,k_dtype", [("f32", torch.uint8), ("f32x1", torch.float8_e4m3fn), ("u8x4", torch.float8_e4m3fn)]
)
def test_gather_matches_reference(device, backend, layout, case, scale_kind, k_dtype):
    bs, lens, first, extra, width = case
    _skip_refused(device, backend, bs, layout)
    cu, bt, rows = _requests(bs, lens, first, extra, width, device)
    base, got = _gather(_cache(bs, layout, device), bs, layout, cu, bt, rows, scale_kind, k_dtype, backend)
    covered = torch.zeros(rows, dtype=torch.bool)
    covered[first : int(cu[-1])] = True
    assert_bitwise(got[0][~covered], base[0][~covered])  # rows no request covers
    assert_bitwise(got[0][:, :16], base[0][:, :16])  # bytes beside dst_k's rows


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_gather_semantics(device, backend):
    """Spelled out, without the reference gather: token t written to slot t (block_size 2)."""
    k = _k(16, device, torch.float16, special=False)
    c = L.allocate(8, 2, device)
    WRITE(k, c, torch.arange(16, device=device), block_size=2, backend=backend)
    tok_values, tok_scale = reference.indexer_quantize_tokens(k)
    cu = torch.tensor([1, 4, 4, 9], dtype=torch.int32, device=device)
    bt = torch.tensor([[3, -1, 5], [7, 6, 2], [1, 8, 4]], dtype=torch.int32, device=device)
    dk, ds = rand((11, 128), torch.uint8, device), rand((11, 4), torch.uint8, device)
    want_k, want_s = dk.clone(), ds.clone()
    GATHER(c, dk, ds, bt, cu, block_size=2, backend=backend)
    # Row 0: before request 0. Rows 1-3: request 0, tokens 0-2: blocks 3, 3, -1. Request 1 is empty.
    # Rows 4-8: request 2, tokens 0-4: blocks 1, 1, 8 (= num_blocks), 8, 4. Rows 9, 10: past the end.
    for row, tok in [(1, 6), (2, 7), (3, None), (4, 2), (5, 3), (6, None), (7, None), (8, 8)]:
        want_k[row] = 0 if tok is None else tok_values[tok]
        want_s[row] = 0 if tok is None else tok_scale[tok]
    assert_bitwise(dk, want_k)
    assert_bitwise(ds, want_s)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_bound(device, backend, fmt, dtype):
    """Write every slot, gather it back in a random block order: the gathered bytes are the slot's
    bytes, and values * scale is within e4m3's rounding of k."""
    bs, nb = 64, NUM_BLOCKS[64]
    n = nb * bs
    k = _k(n, device, dtype, special=False, mags=(1e-3, 1.0, 10.0))  # fp16 stays finite
    sm = slots(n, n, torch.int64, device)
    c = _cache(bs, "2d", device)
    WRITE(k, c, sm, block_size=bs, scale_fmt=fmt, backend=backend)
    bt = torch.randperm(nb, device=device).to(torch.int32).view(2, nb // 2)
    cu = torch.tensor([0, n // 2, n], dtype=torch.int32, device=device)
    dk = torch.empty(n, 128, dtype=torch.float8_e4m3fn, device=device)
    ds = torch.empty(n, dtype=torch.float32, device=device)
    GATHER(c, dk, ds, bt, cu, block_size=bs, backend=backend)
    p = torch.arange(n, device=device)
    slot_of_row = bt.flatten()[p // bs].long() * bs + p % bs
    token_of_slot = torch.empty_like(sm)
    token_of_slot[sm] = p
    values, scale = _token_bytes(c, slot_of_row, bs)
    assert_bitwise(dk.view(torch.uint8), values)
    assert_bitwise(ds.view(torch.uint8).view(n, 4), scale)
    # y = x / s lies in [-448, 448] up to the quotient's rounding (448 s >= amax). e4m3 keeps 3 mantissa
    # bits: normal |y| >= 2^-6 rounds by at most 2^-4 |y|, subnormals (step 2^-9) by at most 2^-10; the
    # quotient's own fp32 rounding and the clamp of a quotient just past 448 add a few 2^-24 |y|. Hence
    # |x' - x| <= (2^-4 + 2^-20) |x| + 2^-10 s.
    x = k[token_of_slot[slot_of_row]].double()
    err = (dk.double() * ds.double()[:, None] - x).abs()
    assert (err <= (2**-4 + 2**-20) * x.abs() + 2**-10 * ds.double()[:, None]).all()
    if fmt == "ue8m0":
        f, _ = torch.frexp(ds.double())
        assert (f == 0.5).all()


# -------------------------------------------------------------------------------------- layout


def test_layout_numbers():
    assert (L.head_dim, L.quant_block_size, L.data_bytes, L.scale_bytes, L.token_bytes) == (128, 128, 128, 4, 132)
    assert (L.data_offset, L.alignment) == (0, 4)
    assert (L.block_stride(64), L.block_stride(3), L.block_stride(1)) == (8448, 400, 144)
    assert (L.scale_offset(64), L.scale_offset(3)) == (8192, 384)
    c = L.allocate(3, device="cpu")
    assert c.shape == (3, 8448) and c.dtype == torch.uint8 and not c.any()
    for cache in (c, c.view(3, 64, 132), c[:, : 64 * 132 + 131]):
        L.validate(cache, 64)
    c = L.allocate(4, 3, "cpu", block_stride=396)  # vLLM's unpadded blocks
    L.validate(c, 3)
    L.validate(c.view(4, 3, 132), 3)


def test_values_and_scales_views():
    c = L.allocate(2, 3, "cpu").random_(0, 256)
    v, s = L.values(c, 3), L.scales(c, 3)
    assert v.shape == (2, 3, 128) and v.dtype == torch.float8_e4m3fn
    assert s.shape == (2, 3) and s.dtype == torch.float32
    assert_bitwise(v[1, 2].view(torch.uint8), c[1, 256:384])
    assert_bitwise(s[1, 2].reshape(1).view(torch.uint8), c[1, 392:396])


LAYOUT_BAD = [  # (case, cache from a good [4, 400] block_size-3 cache, exception)
    ("int8", lambda c: c.view(torch.int8), TypeError),
    ("not a tensor", lambda c: c.tolist(), TypeError),
    ("stride short", lambda c: torch.zeros(4 * 392 + 8, dtype=torch.uint8).as_strided((4, 400), (392, 1)), ValueError),
    ("stride not a multiple of 4", lambda c: torch.zeros(4, 397, dtype=torch.uint8), ValueError),
    ("narrower than 3 * 132", lambda c: c[:, :395], ValueError),
    ("3-D wrong shape", lambda c: c.view(4, 1, 400), ValueError),
    ("3-D tokens not 132 apart", lambda c: c.as_strided((4, 3, 132), (400, 128, 1)), ValueError),
    ("wider than 3 tokens", lambda c: torch.zeros(4, 528, dtype=torch.uint8), ValueError),
    ("1-D", lambda c: c.view(-1), ValueError),
    ("misaligned", lambda c: c.view(-1)[2 : 2 + 3 * 400].view(3, 400), ValueError),
    ("last dim strided", lambda c: torch.zeros(4, 800, dtype=torch.uint8)[:, ::2], ValueError),
]


@pytest.mark.parametrize("case", LAYOUT_BAD, ids=[c[0] for c in LAYOUT_BAD])
def test_layout_validate_rejects(case):
    _, make, exc = case
    with pytest.raises(exc, match=r"INDEXER_K_CACHE: kv_cache\b"):
        L.validate(make(L.allocate(4, 3, device="cpu")), 3)


@pytest.mark.parametrize("block_size,exc", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)])
def test_layout_validate_block_size(block_size, exc):
    with pytest.raises(exc, match=r"INDEXER_K_CACHE: block_size\b"):
        L.validate(L.allocate(4, 3, device="cpu"), block_size)


@pytest.mark.parametrize("cache_bs,block_size", [(64, 32), (64, 63), (64, 65), (3, 2), (3, 4)])
@pytest.mark.parametrize("backend", BACKENDS["cpu"])
def test_block_size_must_match_the_cache(cache_bs, block_size, backend):
    """A cache laid out for cache_bs tokens per block used with another block_size: ValueError naming
    both numbers, from the validator and from both ops, before anything is written."""
    c = L.allocate(4, cache_bs, "cpu", block_stride=cache_bs * 132).random_(0, 256)
    views = (
        (
            c,
            rf"kv_cache: blocks of {cache_bs * 132} bytes hold {cache_bs} tokens of 132 bytes, but block_size is "
            rf"{block_size}\b",
        ),
        (
            c.view(4, cache_bs, 132),
            rf"kv_cache: expected \[num_blocks, {block_size}, 132\] for block_size {block_size}, "
            rf"got \[4, {cache_bs}, 132\]",
        ),
    )
    for cache, message in views:
        with pytest.raises(ValueError, match="INDEXER_K_CACHE: " + message):
            L.validate(cache, block_size)
        before = c.clone()
        with pytest.raises(ValueError, match=f"{WRITE_OP}: " + message):
            WRITE(_k(4, "cpu", torch.bfloat16), cache, torch.arange(4), block_size=block_size, backend=backend)
        dk, ds = rand((8, 128), torch.uint8), rand((8, 4), torch.uint8)
        with pytest.raises(ValueError, match=f"{GATHER_OP}: " + message):
            GATHER(
                cache,
                dk,
                ds,
                torch.zeros(1, 8, dtype=torch.int32),
                torch.tensor([0, 8], dtype=torch.int32),
                block_size=block_size,
                backend=backend,
            )
        assert_bitwise(c, before)


def test_allocate_block_stride():
    assert L.allocate(2, 64, "cpu", block_stride=8448).shape == (2, 8448)
    assert L.allocate(2, 3, "cpu", block_stride=396).shape == (2, 396)
    for bad in (8444, 8450, 8580, 8448.0):  # short, not a multiple of 4, a 65th token fits, not an int
        with pytest.raises(
            ValueError,
            match=rf"INDEXER_K_CACHE.allocate: block_stride: .* \[8448, 8580\) for "
            rf"block_size 64, got {bad}",
        ):
            L.allocate(2, 64, "cpu", block_stride=bad)


# ----------------------------------------------------------------------------------- bad inputs


def _args(op, device):
    cache = L.allocate(4, 3, device)
    if op == WRITE_OP:
        return dict(
            k=rand((8, 128), torch.bfloat16, device),
            kv_cache=cache,
            slot_mapping=slots(12, 8, torch.int64, device),
            block_size=3,
        )
    return dict(
        kv_cache=cache,
        dst_k=rand((8, 128), torch.uint8, device),
        dst_scale=rand((8,), torch.float32, device),
        block_table=torch.zeros(2, 4, dtype=torch.int32, device=device),
        cu_seq_lens=torch.tensor([0, 5, 8], dtype=torch.int32, device=device),
        block_size=3,
    )


def _short_stride(a):
    """Blocks of 400 bytes (block_size 3) 392 bytes apart."""
    c = torch.zeros(4 * 392 + 8, dtype=torch.uint8, device=a["kv_cache"].device)
    a.update(kv_cache=c.as_strided((4, 400), (392, 1)))


BAD = [  # (op, case, mutate(args), exception, argument named in the message)
    (WRITE_OP, "k float32", lambda a: a.update(k=a["k"].float()), TypeError, "k"),
    (WRITE_OP, "k width 64", lambda a: a.update(k=a["k"][:, :64]), ValueError, "k"),
    (WRITE_OP, "k 3-D", lambda a: a.update(k=a["k"].view(8, 1, 128)), ValueError, "k"),
    (WRITE_OP, "k too few rows", lambda a: a.update(k=a["k"][:5]), ValueError, "k"),
    (
        WRITE_OP,
        "k not contiguous",
        lambda a: a.update(k=rand((128, 8), torch.bfloat16, a["k"].device).t()),
        ValueError,
        "k",
    ),
    (WRITE_OP, "k not a tensor", lambda a: a.update(k=a["k"].tolist()), TypeError, "k"),
    (
        WRITE_OP,
        "slot_mapping float",
        lambda a: a.update(slot_mapping=a["slot_mapping"].float()),
        TypeError,
        "slot_mapping",
    ),
    (
        WRITE_OP,
        "slot_mapping 2-D",
        lambda a: a.update(slot_mapping=a["slot_mapping"].view(2, 4)),
        ValueError,
        "slot_mapping",
    ),
    (WRITE_OP, "kv_cache int8", lambda a: a.update(kv_cache=a["kv_cache"].view(torch.int8)), TypeError, "kv_cache"),
    (WRITE_OP, "kv_cache stride short", _short_stride, ValueError, "kv_cache"),
    (
        WRITE_OP,
        "kv_cache 3-D wrong shape",
        lambda a: a.update(kv_cache=a["kv_cache"].view(4, 1, 400)),
        ValueError,
        "kv_cache",
    ),
    (WRITE_OP, "block_size 0", lambda a: a.update(block_size=0), ValueError, "block_size"),
    (WRITE_OP, "block_size float", lambda a: a.update(block_size=3.0), TypeError, "block_size"),
    (WRITE_OP, "block_size 2 on a block_size-3 cache", lambda a: a.update(block_size=2), ValueError, "kv_cache"),
    (WRITE_OP, "scale_fmt unknown", lambda a: a.update(scale_fmt="e8m0"), ValueError, "scale_fmt"),
    (WRITE_OP, "scale_fmt not a string", lambda a: a.update(scale_fmt=["ue8m0"]), ValueError, "scale_fmt"),
    (
        GATHER_OP,
        "dst_k bf16",
        lambda a: a.update(dst_k=a["dst_k"].view(8, 64, 2).view(torch.bfloat16)[..., 0]),
        TypeError,
        "dst_k",
    ),
    (GATHER_OP, "dst_k width 64", lambda a: a.update(dst_k=a["dst_k"][:, :64]), ValueError, "dst_k"),
    (
        GATHER_OP,
        "dst_k not contiguous",
        lambda a: a.update(dst_k=rand((128, 8), torch.uint8, a["dst_k"].device).t()),
        ValueError,
        "dst_k",
    ),
    (GATHER_OP, "dst_scale float16", lambda a: a.update(dst_scale=a["dst_scale"].half()), TypeError, "dst_scale"),
    (GATHER_OP, "dst_scale 7 rows", lambda a: a.update(dst_scale=a["dst_scale"][:7]), ValueError, "dst_scale"),
    (
        GATHER_OP,
        "dst_scale float32 [T, 4]",
        lambda a: a.update(dst_scale=a["dst_scale"][:, None].expand(8, 4)),
        ValueError,
        "dst_scale",
    ),
    (
        GATHER_OP,
        "dst_scale uint8 [T, 8]",
        lambda a: a.update(dst_scale=rand((8, 8), torch.uint8, a["dst_k"].device)),
        ValueError,
        "dst_scale",
    ),
    (
        GATHER_OP,
        "dst_scale strided 1-D",
        lambda a: a.update(dst_scale=rand((16,), torch.float32, a["dst_k"].device)[::2]),
        ValueError,
        "dst_scale",
    ),
    (GATHER_OP, "block_table int64", lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table"),
    (GATHER_OP, "block_table 1-D", lambda a: a.update(block_table=a["block_table"][0]), ValueError, "block_table"),
    (GATHER_OP, "cu_seq_lens int64", lambda a: a.update(cu_seq_lens=a["cu_seq_lens"].long()), TypeError, "cu_seq_lens"),
    (
        GATHER_OP,
        "cu_seq_lens 2 entries",
        lambda a: a.update(cu_seq_lens=a["cu_seq_lens"][:2]),
        ValueError,
        "cu_seq_lens",
    ),
    (
        GATHER_OP,
        "cu_seq_lens strided",
        lambda a: a.update(cu_seq_lens=a["cu_seq_lens"].repeat_interleave(2)[::2]),
        ValueError,
        "cu_seq_lens",
    ),
    (GATHER_OP, "kv_cache stride short", _short_stride, ValueError, "kv_cache"),
    (GATHER_OP, "block_size 4 on a block_size-3 cache", lambda a: a.update(block_size=4), ValueError, "kv_cache"),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[("write " if c[0] == WRITE_OP else "gather ") + c[1] for c in BAD])
def test_bad_input(device, backend, case):
    op, _, mutate, exc, name = case
    args = _args(op, device)
    mutate(args)
    dsts = ("kv_cache",) if op == WRITE_OP else ("dst_k", "dst_scale")
    before = {d: args[d].clone() for d in dsts if isinstance(args[d], torch.Tensor)}
    with pytest.raises(exc, match=rf"{op}: {name}\b"):
        getattr(jitkv, op)(**args, backend=backend)
    for d, t in before.items():
        assert_bitwise(args[d], t)


# ------------------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_out_of_range_slots_skipped_gpu(backend, monkeypatch):
    monkeypatch.delenv("JITKV_DEBUG", raising=False)
    c, k = _cache(64, "2d", "cuda"), _k(40, "cuda", torch.bfloat16)
    sm = slots(512, 40, torch.int64, "cuda")
    sm[10], sm[20] = 512, 1 << 40
    got, ref = c.clone(), c.clone()
    WRITE(k, got, sm, block_size=64, backend=backend)
    reference.indexer_k_quant_and_cache(k, ref, torch.where(sm >= 512, -1, sm), block_size=64)
    assert_bitwise(got, ref)


@gpu
@pytest.mark.parametrize("backend", ["jit", "triton"])
def test_out_of_range_debug_raises_gpu(backend, monkeypatch):

    monkeypatch.setenv("JITKV_DEBUG", "1")
    jitkv.ops.reset()  # JITKV_DEBUG is read when a backend is resolved
    c, k = _cache(64, "2d", "cuda"), _k(40, "cuda", torch.bfloat16)
    sm = slots(512, 40, torch.int64, "cuda")
    sm[7] = 512
    before = c.clone()
    try:
        with pytest.raises(IndexError, match=r"slot_mapping: position 7 has slot 512"):
            WRITE(k, c, sm, block_size=64, backend=backend)
    finally:
        monkeypatch.undo()
        jitkv.ops.reset()
    assert_bitwise(c, before)


@gpu
@pytest.mark.parametrize("block_size,layout", CACHES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_every_backend_same_bytes(block_size, layout, dtype, fmt):
    """Writer then gather on every backend of both devices: the same bytes (the special rows that make
    NaN replaced: torch's fp8 NaN keeps its sign on CPU, not on CUDA)."""
    bs = block_size
    k, c = _k(200, "cpu", dtype), _cache(bs, layout, "cpu")
    for row in (4, 5, 6, 8, 10):  # inf (fp16 turns 3.3e38 into one) and NaN rows
        k[row] = row
    sm = slots(NUM_BLOCKS[bs] * bs, 200, torch.int64)
    sm[3::5] = -1
    cu, bt, rows = _requests(bs, [70, 0, 50, 33], 2, 5, None, "cpu")
    base = _dst(rows, "u8x4", torch.uint8, "cpu")
    results = []
    for device in ("cpu", "cuda"):
        for backend in BACKENDS[device]:
            if device == "cuda" and backend == "jit" and layout == "3d" and bs == 3:
                continue  # refused: 396-byte blocks (test_unaligned_views_fall_back)
            cd, (dk, ds) = c.to(device), (t.to(device) for t in base)
            WRITE(k.to(device), _view(cd, bs, layout), sm.to(device), block_size=bs, scale_fmt=fmt, backend=backend)
            GATHER(
                _view(cd, bs, layout),
                *_dst_views(dk, ds, "u8x4"),
                bt.to(device),
                cu.to(device),
                block_size=bs,
                backend=backend,
            )
            results.append((device, cd.cpu(), dk.cpu(), ds.cpu()))
    for device, *r in results[1:]:
        if device != results[0][0]:  # a NaN's e4m3 code keeps its sign on CPU, is 0x7F on CUDA (docs/design.md §4)
            r = _nan_codes_unsigned(r, bs, layout)
            want = _nan_codes_unsigned(results[0][1:], bs, layout)
        else:
            want = results[0][1:]
        for got, exp in zip(r, want):
            assert_bitwise(got, exp)


def _nan_codes_unsigned(result, bs, layout):
    """(cache, dst_k, dst_scale) with every e4m3 NaN code (0x7F, 0xFF) of the values made 0x7F."""
    cache, dk, ds = (t.clone() for t in result)
    for vals in (L.values(_view(cache, bs, layout), bs).view(torch.uint8), dk.view(torch.uint8)):
        vals[(vals & 0x7F) == 0x7F] = 0x7F
    return cache, dk, ds


@gpu
@pytest.mark.parametrize("backend", ["jit", "triton"])
@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_graph_replay_with_new_inputs(backend, fmt):
    bs, n = 64, 200
    c, k, sm = _cache(bs, "2d", "cuda"), _k(n, "cuda", torch.bfloat16), slots(512, n, torch.int32, "cuda")
    cu, bt, rows = _requests(bs, [100, 30, 90], 0, 4, None, "cuda")
    dk, ds = _dst(rows, "f32x1", torch.uint8, "cuda")

    def step():
        WRITE(k, c, sm, block_size=bs, scale_fmt=fmt, backend=backend)
        GATHER(c, *_dst_views(dk, ds, "f32x1"), bt, cu, block_size=bs, backend=backend)

    step()  # build / compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        new_sm = slots(512, n, torch.int32, "cuda")
        new_sm[3::5] = -1
        new_cu, new_bt, _ = _requests(bs, [60, 70, 90], 0, 4, None, "cuda")
        for dst, src in (
            (k, _k(n, "cuda", torch.bfloat16)),
            (sm, new_sm),
            (cu, new_cu),
            (bt, new_bt),
            (dk, rand(dk.shape, torch.uint8, "cuda")),
            (ds, torch.randn_like(ds)),
        ):
            dst.copy_(src)
        ref = [c.clone(), dk.clone(), ds.clone()]
        reference.indexer_k_quant_and_cache(k, ref[0], sm, block_size=bs, scale_fmt=fmt)
        reference.gather_indexer_k_quant_cache(ref[0], *_dst_views(ref[1], ref[2], "f32x1"), bt, cu, block_size=bs)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip((c, dk, ds), ref):
            assert_bitwise(got, want)


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_side_stream(backend):
    """Both ops on a side stream whose k only becomes ready after a long sleep there: an op launched on
    another stream would read the old k."""
    bs, n = 64, 300
    c, k, sm = _cache(bs, "2d", "cuda"), _k(n, "cuda", torch.bfloat16), slots(512, n, torch.int64, "cuda")
    new_k = _k(n, "cuda", torch.bfloat16)
    cu, bt, rows = _requests(bs, [200, 100], 0, 0, None, "cuda")
    dk, ds = _dst(rows, "f32", torch.uint8, "cuda")
    ref = [c.clone(), dk.clone(), ds.clone()]
    reference.indexer_k_quant_and_cache(new_k, ref[0], sm, block_size=bs)
    reference.gather_indexer_k_quant_cache(ref[0], *_dst_views(ref[1], ref[2], "f32"), bt, cu, block_size=bs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        k.copy_(new_k)
        WRITE(k, c, sm, block_size=bs, backend=backend)
        GATHER(c, *_dst_views(dk, ds, "f32"), bt, cu, block_size=bs, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for got, want in zip((c, dk, ds), ref):
        assert_bitwise(got, want)


UNALIGNED = [  # (op, argument, what makes it unaligned for the 16-byte CUDA kernels)
    (WRITE_OP, "k", "k at column 1"),
    (WRITE_OP, "kv_cache", "vLLM's 396-byte blocks (block_size 3)"),
    (GATHER_OP, "dst_k", "dst_k at column 1"),
    (GATHER_OP, "dst_scale", "uint8 dst_scale at column 1"),
]


def _unaligned_call(op, arg, backend):
    """One call of `op` with `arg` unaligned, checked against the reference."""
    bs = 3 if arg == "kv_cache" else 64
    c = _cache(bs, "3d" if arg == "kv_cache" else "2d", "cuda")
    if op == WRITE_OP:
        _write(
            _k(50, "cuda", torch.bfloat16, col=int(arg == "k")),
            c,
            slots(NUM_BLOCKS[bs] * bs, 50, torch.int32, "cuda"),
            bs,
            "3d" if arg == "kv_cache" else "2d",
            backend,
            "ue8m0",
        )
        return
    cu, bt, rows = _requests(bs, [100, 20], 0, 2, None, "cuda")
    dk, ds = rand((rows, 144), torch.uint8, "cuda"), rand((rows, 8), torch.uint8, "cuda")  # aligned rows
    cols = (slice(1, 129) if arg == "dst_k" else slice(16, 144)), (slice(1, 5) if arg == "dst_scale" else slice(4, 8))
    got, ref = (dk.clone(), ds.clone()), (dk.clone(), ds.clone())
    GATHER(c, got[0][:, cols[0]], got[1][:, cols[1]], bt, cu, block_size=bs, backend=backend)
    reference.gather_indexer_k_quant_cache(c, ref[0][:, cols[0]], ref[1][:, cols[1]], bt, cu, block_size=bs)
    assert_bitwise(got[0], ref[0])
    assert_bitwise(got[1], ref[1])


@gpu
@pytest.mark.parametrize("op,arg,why", UNALIGNED, ids=[u[2] for u in UNALIGNED])
def test_unaligned_views_fall_back(op, arg, why, monkeypatch):
    """Views the vector CUDA kernels refuse: auto runs Triton (recorded in backend_info, warned about
    once); forcing jit raises BackendUnavailable naming the argument; forcing Triton runs them."""

    jitkv.ops.reset()
    monkeypatch.setattr(jitkv.ops._op, "_WARNED", set())
    with pytest.warns(jitkv.JitkvFallbackWarning, match=rf"{arg}: the CUDA kernels need"):
        _unaligned_call(op, arg, None)
    info = jitkv.backend_info(op)["cuda:0"]
    assert info["backend"] == "triton" and f"{arg}: the CUDA kernels need" in info["reason"], info
    with pytest.raises(jitkv.BackendUnavailable, match=rf"{arg}: the CUDA kernels need a (16|4)-byte aligned"):
        _unaligned_call(op, arg, "jit")
    _unaligned_call(op, arg, "triton")


def test_triton_kernel_under_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 against the reference (CI has no GPU)."""
    run_under_interpreter(f"{__name__}:triton_interpreter_cases")


def triton_interpreter_cases():
    """Run by test_triton_kernel_under_interpreter in a process with TRITON_INTERPRET=1."""
    from jitkv.triton.indexer import gather_indexer_k_quant_cache_triton, indexer_k_quant_and_cache_triton

    for bs, stride in ((64, None), (3, 3 * 132)):  # jitkv's blocks, and vLLM's 396-byte ones
        for dtype, ue8m0 in ((torch.bfloat16, True), (torch.float16, False)):
            cache = L.allocate(10, bs, "cpu", block_stride=stride).random_(0, 256)
            k = (torch.randn(30, 128) * torch.logspace(-3, 2, 30)[:, None]).to(dtype)
            k[0, 3], k[1], k[2, 5], k[3] = float("nan"), float("nan"), float("inf"), 0.0
            sm = slots(10 * bs, 27)
            sm[::6] = -1
            got, ref = cache.clone(), cache.clone()
            indexer_k_quant_and_cache_triton(k, got, sm, bs, "ue8m0" if ue8m0 else None)
            reference.indexer_k_quant_and_cache(k, ref, sm, block_size=bs, scale_fmt="ue8m0" if ue8m0 else None)
            assert_bitwise(got, ref)
        cu = torch.tensor([2, 9, 9, 3 * bs + 4], dtype=torch.int32)
        table = torch.randperm(10)[:9].view(3, 3).int()
        table[0, 0], table[2, 1] = -1, 10
        dst_k, dst_scale = rand((3 * bs + 9, 128), torch.uint8), rand((3 * bs + 9, 4), torch.uint8)
        want_k, want_scale = dst_k.clone(), dst_scale.clone()
        gather_indexer_k_quant_cache_triton(got, dst_k, dst_scale, table, cu, bs)
        reference.gather_indexer_k_quant_cache(got, want_k, want_scale, table, cu, block_size=bs)
        assert_bitwise(dst_k, want_k)
        assert_bitwise(dst_scale, want_scale)
