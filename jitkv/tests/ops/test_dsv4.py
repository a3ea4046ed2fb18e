"""DeepSeek-V4 FP8 K cache (docs/design.md §5): writer and gather byte for byte against the torch reference over
whole buffers, on every backend of every device present (CPU: torch only; CUDA: jit, triton, torch);
the round-trip error bound; the layout descriptor; bad inputs."""

from __future__ import annotations

import pytest
import torch

import jitkv
from jitkv import DSV4_K_CACHE as L
from jitkv import reference
from jitkv.tests.conftest import DEVICES, assert_bitwise, gpu, rand, slots
from jitkv.tests.triton.interpreter import run_under_interpreter

BACKENDS = {"cpu": ["torch"], "cuda": ["jit", "triton", "torch"]}
DEV_BACKENDS = [(d, b) for d in DEVICES for b in BACKENDS[d]]
WRITE_OP, GATHER_OP = "quantize_and_insert_k_cache", "dequantize_and_gather_k_cache"
WRITE, GATHER = jitkv.quantize_and_insert_k_cache, jitkv.dequantize_and_gather_k_cache
NUM_BLOCKS = {64: 8, 2: 128}  # 512 / 256 slots
LAYOUTS = ["2d", "3d", "wide", "padded"]
SPECIAL = [  # (row, dims, value): amax exactly 448 and just above it, amax below the 1e-4 floor, a zero
    # group, ±inf, NaN, bf16 denormals, near the bf16 maximum
    (0, slice(0, 64), 448.0),
    (0, 70, -450.0),
    (1, slice(64, 128), 1e-30),
    (2, slice(128, 192), 0.0),
    (3, 3, float("inf")),
    (3, 70, -float("inf")),
    (4, 10, float("nan")),
    (5, slice(0, 448), 3e-39),
    (6, slice(200, 264), 3.3e38),
]


def _k(rows, device, mags=(1e-3, 1.0, 100.0), special=True, col=0):
    """bf16 [rows, 512] at column `col` of a [rows, 520] buffer: a magnitude per row, exponents spread
    over the 64-dim groups, and (special) the SPECIAL groups plus a -NaN in the first rows."""
    x = torch.randn(rows, 512) * torch.tensor(mags)[torch.randint(len(mags), (rows, 1))]
    x *= torch.exp2(torch.randint(-8, 9, (rows, 8)).float()).repeat_interleave(64, 1)
    base = torch.zeros(rows, 520, dtype=torch.bfloat16)
    k = base[:, col : col + 512]
    k.copy_(x)
    for row, dims, val in SPECIAL if special else ():
        if row < rows:
            k[row, dims] = val
    if special and rows > 4:
        k.view(torch.int16)[4, 11] = -0x40  # 0xFFC0
    return base.to(device)[:, col : col + 512]


def _stride(block_size, layout):
    """The default block stride (block_size * 584, vLLM's allocation, at block sizes 64 and 2);
    "padded": rounded up to a multiple of 576; "wide": more than a block uses."""
    if layout == "padded":
        return -(-block_size * 584 // 576) * 576
    return L.block_stride(block_size) + (576 if layout == "wide" else 0)


def _cache(block_size, layout, device):
    """Random bytes (scale bytes of most blocks in a realistic range) in a 2-D allocation; "wide" has a
    larger block stride and one leading row that is not part of the cache (see _blocks)."""
    stride = _stride(block_size, layout)
    c = rand((NUM_BLOCKS[block_size] + (layout == "wide"), stride), torch.uint8)
    lo, hi = L.scale_offset(block_size), L.scale_offset(block_size) + 8 * block_size
    tame = torch.rand(c.shape[0]) < 0.75
    c[tame, lo:hi] = torch.randint(100, 150, (int(tame.sum()), hi - lo), dtype=torch.uint8)
    return c.to(device)


def _blocks(c, layout):
    """The [num_blocks, W] cache of an allocation made by _cache ("wide": W = the padded stride, less
    than stride(0), as a 2-D cache's width gives its block size)."""
    return c[1:, : c.shape[1] - 576] if layout == "wide" else c


def _view(c, block_size, layout):
    """The cache argument: 2-D, or the [num_blocks, block_size, 584] view of the same allocation."""
    if layout == "3d":
        return c.as_strided((c.shape[0], block_size, 584), (c.stride(0), 584, 1))
    return _blocks(c, layout)


def _token_idx(slot, block_size):
    """(block, data byte indices [m, 576], scale byte indices [m, 8]) of slots [m] inside a block row."""
    s = slot.long()[:, None]
    pos, ar = s % block_size, torch.arange(576, device=s.device)
    return s // block_size, pos * 576 + ar, L.scale_offset(block_size) + pos * 8 + ar[:8]


def _requests(bs, num_reqs, max_tokens, gl_mode, short_bt, device):
    """seq_lens (some 0, some past max_tokens); gather_lens None, <= seq_lens ("short") or > seq_lens
    ("long": leading zero rows); a block table (row stride != width) with -1 entries, an entry equal to
    num_blocks and one of 2^31 - 1 (all read as zero rows)."""
    seq = torch.randint(0, max_tokens + 5, (num_reqs,), dtype=torch.int32)
    gl = {
        None: None,
        "short": torch.minimum(seq, torch.randint(0, max_tokens, (num_reqs,), dtype=torch.int32)),
        "long": seq + torch.randint(1, 5, (num_reqs,), dtype=torch.int32),
    }[gl_mode]
    width = -(-(max_tokens + 5) // bs)
    width = max(1, width // 2) if short_bt else width
    bt = torch.randint(0, NUM_BLOCKS[bs], (num_reqs, width + 3), dtype=torch.int32)
    bt[torch.rand(bt.shape) < 0.1] = -1
    bt[0, 0], bt[-1, width - 1] = NUM_BLOCKS[bs], 2**31 - 1
    return seq.to(device), None if gl is None else gl.to(device), bt.to(device)[:, :width]


def _write(k, c, sm, bs, layout, backend):
    """The op and the reference on clones of the whole allocation; they must agree byte for byte."""
    got, ref = c.clone(), c.clone()
    WRITE(k, _view(got, bs, layout), sm, block_size=bs, backend=backend)
    reference.quantize_and_insert_k_cache(k, _view(ref, bs, layout), sm, block_size=bs)
    assert_bitwise(got, ref)
    return got


def _gather(c, bs, layout, seq, gl, bt, m, offset, backend, col=0):
    """The op and the reference into clones of a random [R, m + 3, 520] buffer (out = [:, :m, col:col+512]);
    compare the whole buffer."""
    base = rand((bt.shape[0], m + 3, 520), torch.bfloat16, c.device)
    got, ref = base.clone(), base.clone()
    GATHER(got[:, :m, col : col + 512], _view(c, bs, layout), seq, gl, bt, bs, offset, backend=backend)
    reference.dequantize_and_gather_k_cache(ref[:, :m, col : col + 512], _view(c, bs, layout), seq, gl, bt, bs, offset)
    assert_bitwise(got, ref)
    return base, got


# -------------------------------------------------------------------------------------- writer


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("block_size", [64, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 77])
def test_writer_matches_reference(device, backend, block_size, layout, idx_dtype, n):
    c = _cache(block_size, layout, device)
    k = _k(n + 3, device)  # extra rows are never read
    sm = slots(NUM_BLOCKS[block_size] * block_size, n, idx_dtype, device)
    sm[3::5] = -1
    got = _write(k, c, sm, block_size, layout, backend)
    # Independent of the reference: rope bytes in place, 8th scale byte 0, no other byte touched.
    keep = (sm >= 0).nonzero().flatten()
    blk, data, scale = _token_idx(sm[keep], block_size)
    assert_bitwise(_blocks(got, layout)[blk, data][:, 448:], k[keep, 448:].contiguous().view(torch.uint8))
    assert not _blocks(got, layout)[blk, scale][:, 7].any()
    touched = torch.zeros_like(c, dtype=torch.bool)
    _blocks(touched, layout)[blk, data] = True
    _blocks(touched, layout)[blk, scale] = True
    assert_bitwise(got[~touched], c[~touched])


def test_out_of_range_slot_raises_before_writing_cpu():
    c = _cache(2, "2d", "cpu")
    before = c.clone()
    sm = slots(256, 9)
    sm[4] = 256
    with pytest.raises(IndexError, match=r"slot_mapping: position 4 has slot 256\b"):
        WRITE(_k(9, "cpu"), c, sm, block_size=2)
    assert_bitwise(c, before)


# -------------------------------------------------------------------------------------- gather

GATHER_CASES = [  # (block_size, num_reqs, max_tokens, offset, gather_lens, short block table)
    (64, 1, 300, 0, None, False),
    (64, 3, 200, 5, "short", False),
    (64, 2, 150, 0, "long", True),
    (64, 4, 100, 60, "short", False),
    (64, 2, 50, 50, None, False),
    (2, 5, 120, 17, None, False),
    (2, 3, 97, 0, "short", True),
    (2, 2, 64, 3, "long", False),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", GATHER_CASES, ids=str)
def test_gather_matches_reference(device, backend, layout, case):
    bs, num_reqs, m, offset, gl_mode, short_bt = case
    seq, gl, bt = _requests(bs, num_reqs, m, gl_mode, short_bt, device)
    base, got = _gather(_cache(bs, layout, device), bs, layout, seq, gl, bt, m, offset, backend)
    assert_bitwise(got[:, :offset], base[:, :offset])  # rows before offset
    assert_bitwise(got[:, m:], base[:, m:])  # rows past out.shape[1]
    assert_bitwise(got[..., 512:], base[..., 512:])  # row padding


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_gather_semantics(device, backend):
    """Spelled out, without the reference gather: token t in slot t (block_size 2), offset 1, 6 out rows."""
    k = _k(16, device, special=False)
    c = L.allocate(8, 2, device)
    WRITE(k, c, torch.arange(16, device=device), block_size=2, backend=backend)
    tok = reference.dsv4_dequantize_tokens(*reference.dsv4_quantize_tokens(k))  # what each token reads back as
    seq = torch.tensor([7, 9, 9], dtype=torch.int32, device=device)
    gl = torch.tensor([5, 9, 3], dtype=torch.int32, device=device)
    bt = torch.tensor([[3, -1, 5, 0], [7, 6, 2, 1], [1, 1, 1, 4]], dtype=torch.int32, device=device)
    base = rand((3, 8, 520), torch.bfloat16, device)
    got, want = base.clone(), base.clone()
    GATHER(got[:, :6, :512], c, seq, gl, bt, 2, 1, backend=backend)
    # r0: positions 2..6; 2, 3 in block -1. r1: positions 0..4 fit, 5..8 fall past out.shape[1].
    # r2: positions 6..8; 8 is past the 4-entry block table.
    for r, toks in enumerate([[None, None, 10, 11, 0], [14, 15, 12, 13, 4], [8, 9, None]]):
        for i, t in enumerate(toks):
            want[r, 1 + i, :512] = 0 if t is None else tok[t]
    assert_bitwise(got, want)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("block_size", [64, 2])
@pytest.mark.parametrize("mag", [1e-3, 1.0, 100.0])
def test_round_trip_error_bound(device, backend, block_size, mag):
    nb = NUM_BLOCKS[block_size]
    n = nb * block_size
    k = _k(n, device, mags=(mag,), special=False)
    sm = slots(n, n, torch.int64, device)  # every slot
    c = _cache(block_size, "2d", device)
    WRITE(k, c, sm, block_size=block_size, backend=backend)
    # e = ceil(log2(r)), r = max(amax, 1e-4) / 448, from r = f * 2^E (f in [0.5, 1)): E, or E - 1 when
    # f == 0.5. r in float64 is exact when it is a power of two; otherwise a bf16 amax keeps it >= 2^-8
    # (relative) away from one, far beyond float64 rounding.
    x = k[:, :448].double().reshape(n, 7, 64)
    f, big_e = torch.frexp(x.abs().amax(-1).clamp(min=1e-4) / 448)
    e = (big_e - (f == 0.5).int()).double()
    blk, _, scale = _token_idx(sm, block_size)
    assert torch.equal(c[blk, scale].long(), torch.cat([e + 127, torch.zeros_like(e[:, :1])], 1).long())

    bt = torch.randperm(nb, device=device).to(torch.int32)[None]
    out = torch.empty(1, n, 512, dtype=torch.bfloat16, device=device)
    GATHER(out, c, torch.tensor([n], dtype=torch.int32, device=device), None, bt, block_size, backend=backend)
    p = torch.arange(n, device=device)
    token_of_slot = torch.empty_like(sm)
    token_of_slot[sm] = p
    src = token_of_slot[bt[0, p // block_size].long() * block_size + p % block_size]  # token at position p
    assert_bitwise(out[0, :, 448:], k[src, 448:])  # rope: bit-exact
    # Nope bound. y = x / 2^e lies in [-448, 448] (448 * 2^e >= amax): no saturation. e4m3 keeps 3
    # mantissa bits: for normal |y| >= 2^-6, round-to-nearest is off by at most half a step,
    # 2^(floor(log2|y|) - 4) <= 2^-4 |y|; subnormals (step 2^-9) by at most 2^-10. e4m3 * 2^e has at most
    # 4 significant bits, so its bf16 output is exact. Hence |x' - x| <= 2^-4 |x| + 2^-10 * 2^e.
    err = (out[0, :, :448].double() - k[src, :448].double()).abs().reshape(n, 7, 64)
    assert (err <= 2**-4 * x[src].abs() + 2**-10 * torch.exp2(e[src])[..., None]).all()


@pytest.mark.parametrize(
    "device,backend",
    [(d, b) for d, b in DEV_BACKENDS if (d, b) != ("cuda", "jit")] + [pytest.param("cuda", None, marks=gpu)],
)
def test_unaligned_views(device, backend, monkeypatch):
    """k and out not 16-byte aligned: Triton and torch take them; on CUDA auto falls back from the jit
    backend to Triton, recorded in backend_info and warned about."""
    monkeypatch.setattr(jitkv.ops._op, "_WARNED", set())
    with pytest.warns(jitkv.JitkvFallbackWarning, match="16-byte aligned") if backend is None else _no_warning():
        c = _write(
            _k(50, device, col=1), _cache(64, "2d", device), slots(512, 50, torch.int32, device), 64, "2d", backend
        )
        seq, gl, bt = _requests(64, 2, 100, "short", False, device)
        _gather(c, 64, "2d", seq, gl, bt, 100, 0, backend, col=1)
    if backend is None:
        for op in (WRITE_OP, GATHER_OP):
            info = [i for i in jitkv.backend_info(op).values() if "16-byte aligned" in i["reason"]]
            assert info and info[0]["backend"] == "triton", jitkv.backend_info(op)


@gpu
def test_unaligned_view_forced_jit_raises():
    """Forcing the jit backend where its kernels cannot run raises with the reason, writing nothing."""
    c = _cache(64, "2d", "cuda")
    before = c.clone()
    with pytest.raises(jitkv.BackendUnavailable, match="k: the CUDA kernels need a 16-byte aligned base"):
        WRITE(_k(50, "cuda", col=1), c, slots(512, 50, torch.int32, "cuda"), block_size=64, backend="jit")
    assert_bitwise(c, before)


def _no_warning():
    import contextlib

    return contextlib.nullcontext()


# -------------------------------------------------------------------------------------- layout


def test_layout_numbers():
    assert (L.head_dim, L.nope_dim, L.rope_dim, L.group_size) == (512, 448, 64, 64)
    assert (L.token_bytes, L.data_bytes, L.scale_bytes, L.data_offset) == (584, 576, 8, 0)
    assert (L.block_stride(64), L.block_stride(2), L.block_stride(1)) == (37376, 1168, 592)
    assert (L.scale_offset(64), L.scale_offset(2)) == (36864, 1152)
    c = L.allocate(3, device="cpu")
    assert c.shape == (3, 37376) and c.dtype == torch.uint8 and c.device.type == "cpu" and not c.any()
    c = L.allocate(4, 2, device="cpu")
    assert c.shape == (4, 1168)
    L.validate(c, 2)
    L.validate(c.as_strided((4, 2, 584), (1168, 584, 1)), 2)
    L.validate(c[:, : 2 * 584], 2)  # the used bytes only: stride(0) is still the block stride


LAYOUT_BAD = [  # (case, cache from a good [4, 1168] block_size-2 cache, exception)
    ("int8", lambda c: c.view(torch.int8), TypeError),
    ("not a tensor", lambda c: c.tolist(), TypeError),
    (
        "stride short",
        lambda c: torch.zeros(4 * 1152 + 16, dtype=torch.uint8).as_strided((4, 1168), (1152, 1)),
        ValueError,
    ),
    ("stride not a multiple of 16", lambda c: torch.zeros(4, 1736, dtype=torch.uint8), ValueError),
    ("narrower than 2 * 584", lambda c: c[:, :1000], ValueError),
    ("3-D wrong shape", lambda c: c.view(4, 1, 1168), ValueError),
    ("3-D tokens not 584 apart", lambda c: c.as_strided((4, 2, 584), (1168, 576, 1)), ValueError),
    ("wider than 2 tokens", lambda c: torch.zeros(4, 1760, dtype=torch.uint8), ValueError),
    ("1-D", lambda c: c.view(-1), ValueError),
    ("misaligned", lambda c: c.view(-1)[1 : 1 + 3 * 1168].view(3, 1168), ValueError),
]


@pytest.mark.parametrize("case", LAYOUT_BAD, ids=[c[0] for c in LAYOUT_BAD])
def test_layout_validate_rejects(case):
    _, make, exc = case
    with pytest.raises(exc, match=r"DSV4_K_CACHE: k_cache\b"):
        L.validate(make(L.allocate(4, 2, device="cpu")), 2)


@pytest.mark.parametrize("cache_bs,block_size", [(64, 32), (64, 63), (64, 65), (2, 1), (2, 3)])
@pytest.mark.parametrize("stride", ["padded", "unpadded"])
def test_block_size_must_match_the_cache(cache_bs, block_size, stride):
    """A cache laid out for cache_bs tokens per block, used with another block_size: ValueError naming
    both numbers, from the validator and from both ops, before anything is written."""
    c = L.allocate(4, cache_bs, "cpu", block_stride=None if stride == "padded" else cache_bs * 584).random_(0, 256)
    width = c.shape[1]
    views = (
        (c, rf"k_cache: blocks of {width} bytes hold {cache_bs} tokens of 584 bytes, but block_size is {block_size}\b"),
        (
            c[:, : cache_bs * 584].view(4, cache_bs, 584),
            rf"k_cache: expected \[num_blocks, {block_size}, 584\] for block_size {block_size}, "
            rf"got \[4, {cache_bs}, 584\]",
        ),
    )
    for cache, message in views:
        with pytest.raises(ValueError, match="DSV4_K_CACHE: " + message):
            L.validate(cache, block_size)
        before = c.clone()
        with pytest.raises(ValueError, match=f"{WRITE_OP}: " + message):
            WRITE(_k(4, "cpu"), cache, torch.arange(4), block_size=block_size)
        out = rand((1, 8, 512), torch.bfloat16)
        with pytest.raises(ValueError, match=f"{GATHER_OP}: " + message):
            GATHER(
                out, cache, torch.tensor([8], dtype=torch.int32), None, torch.zeros(1, 8, dtype=torch.int32), block_size
            )
        assert_bitwise(c, before)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("block_size", [64, 2])
def test_unpadded_cache_holds_the_padded_caches_records(device, backend, block_size):
    """vLLM's unpadded cache (block stride block_size * 584: 37,376 bytes at 64) gets, block for block,
    the bytes jitkv's padded cache gets, and gathers the same rows, 2-D and as the 3-D view."""
    bs, nb = block_size, NUM_BLOCKS[block_size]
    padded = _cache(bs, "padded", device)
    unpadded = L.allocate(nb, bs, device, block_stride=bs * 584)
    unpadded.copy_(padded[:, : bs * 584])  # the same poison in the bytes a block uses
    k, sm = _k(100, device), slots(nb * bs, 100, torch.int32, device)
    seq, gl, bt = _requests(bs, 3, 150, "short", False, device)
    outs = []
    for cache, layout in ((padded, "2d"), (unpadded, "2d"), (unpadded, "3d")):
        got = cache.clone()
        WRITE(k, _view(got, bs, layout), sm, block_size=bs, backend=backend)
        out = rand((3, 150, 512), torch.bfloat16, device, gen=torch.Generator().manual_seed(1))
        GATHER(out, _view(got, bs, layout), seq, gl, bt, bs, 0, backend=backend)
        outs.append((got, out))
    assert_bitwise(outs[0][0][:, bs * 584 :], padded[:, bs * 584 :])  # padding untouched
    for got, out in outs[1:]:
        assert_bitwise(got, outs[0][0][:, : bs * 584])
        assert_bitwise(out, outs[0][1])


def test_allocate_block_stride():
    assert L.allocate(2, 64, "cpu", block_stride=37376).shape == (2, 37376)
    assert L.allocate(2, 3, "cpu", block_stride=3 * 584 + 8).shape == (2, 1760)
    L.validate(L.allocate(2, 64, "cpu", block_stride=37376), 64)
    for bad in (37360, 37384, 37960, 37376.0):  # short, not a multiple of 16, a 65th token fits, not an int
        with pytest.raises(
            ValueError, match=rf"DSV4_K_CACHE.allocate: block_stride: .* \[37376, 37960\) for block_size 64, got {bad}"
        ):
            L.allocate(2, 64, "cpu", block_stride=bad)


# ----------------------------------------------------------------------------------- bad inputs


def _args(op, device):
    if op == WRITE_OP:
        return dict(
            k=rand((8, 512), torch.bfloat16, device),
            k_cache=L.allocate(4, 2, device),
            slot_mapping=slots(8, 8, torch.int64, device),
            block_size=2,
        )
    return dict(
        out=rand((2, 8, 512), torch.bfloat16, device),
        k_cache=L.allocate(4, 2, device),
        seq_lens=torch.tensor([5, 8], dtype=torch.int32, device=device),
        gather_lens=None,
        block_table=torch.zeros(2, 4, dtype=torch.int32, device=device),
        block_size=2,
        offset=0,
    )


def _short_stride(a):
    """Blocks of 1168 bytes (block_size 2) 1152 bytes apart."""
    c = torch.zeros(4 * 1152 + 16, dtype=torch.uint8, device=a["k_cache"].device)
    a.update(k_cache=c.as_strided((4, 1168), (1152, 1)))


BAD = [  # (op, case, mutate(args), exception, argument named in the message)
    (WRITE_OP, "k float32", lambda a: a.update(k=a["k"].float()), TypeError, "k"),
    (WRITE_OP, "k width 448", lambda a: a.update(k=a["k"][:, :448]), ValueError, "k"),
    (WRITE_OP, "k too few rows", lambda a: a.update(k=a["k"][:5]), ValueError, "k"),
    (WRITE_OP, "k not a tensor", lambda a: a.update(k=a["k"].tolist()), TypeError, "k"),
    (
        WRITE_OP,
        "slot_mapping float",
        lambda a: a.update(slot_mapping=a["slot_mapping"].float()),
        TypeError,
        "slot_mapping",
    ),
    (WRITE_OP, "k_cache int8", lambda a: a.update(k_cache=a["k_cache"].view(torch.int8)), TypeError, "k_cache"),
    (WRITE_OP, "k_cache stride short", _short_stride, ValueError, "k_cache"),
    (
        WRITE_OP,
        "k_cache 3-D wrong shape",
        lambda a: a.update(k_cache=a["k_cache"].view(4, 1, 1168)),
        ValueError,
        "k_cache",
    ),
    (WRITE_OP, "block_size 0", lambda a: a.update(block_size=0), ValueError, "block_size"),
    (WRITE_OP, "block_size 1 on a block_size-2 cache", lambda a: a.update(block_size=1), ValueError, "k_cache"),
    (GATHER_OP, "out float32", lambda a: a.update(out=a["out"].float()), TypeError, "out"),
    (GATHER_OP, "out width 256", lambda a: a.update(out=a["out"][..., :256]), ValueError, "out"),
    (GATHER_OP, "seq_lens int64", lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens"),
    (
        GATHER_OP,
        "gather_lens 3 entries",
        lambda a: a.update(gather_lens=a["seq_lens"].repeat(2)[:3]),
        ValueError,
        "gather_lens",
    ),
    (GATHER_OP, "block_table 1 row", lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table"),
    (GATHER_OP, "block_table int64", lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table"),
    (GATHER_OP, "offset negative", lambda a: a.update(offset=-1), ValueError, "offset"),
    (GATHER_OP, "k_cache stride short", _short_stride, ValueError, "k_cache"),
    (GATHER_OP, "block_size 3 on a block_size-2 cache", lambda a: a.update(block_size=3), ValueError, "k_cache"),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[("write " if c[0] == WRITE_OP else "gather ") + c[1] for c in BAD])
def test_bad_input(device, backend, case):
    op, _, mutate, exc, name = case
    args = _args(op, device)
    mutate(args)
    dst = "k_cache" if op == WRITE_OP else "out"
    before = args[dst].clone()
    with pytest.raises(exc, match=rf"{op}: {name}\b"):
        getattr(jitkv, op)(**args, backend=backend)
    assert_bitwise(args[dst], before)


@pytest.mark.parametrize("backend", ["jit", "triton"])
def test_cpu_runs_torch_only(backend):
    for op in (WRITE_OP, GATHER_OP):
        args = _args(op, "cpu")
        with pytest.raises(jitkv.BackendUnavailable, match=rf"{op}: backend '{backend}' is not available on cpu"):
            getattr(jitkv, op)(**args, backend=backend)
        getattr(jitkv, op)(**args)
        assert jitkv.backend_info(op)["cpu"]["backend"] == "torch"


# ------------------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_out_of_range_slots_skipped_gpu(backend, monkeypatch):
    monkeypatch.delenv("JITKV_DEBUG", raising=False)
    c, k = _cache(64, "2d", "cuda"), _k(40, "cuda")
    sm = slots(512, 40, torch.int64, "cuda")
    sm[10], sm[20] = 512, 1 << 40
    got, ref = c.clone(), c.clone()
    WRITE(k, got, sm, block_size=64, backend=backend)
    reference.quantize_and_insert_k_cache(k, ref, torch.where(sm >= 512, -1, sm), block_size=64)
    assert_bitwise(got, ref)


@gpu
@pytest.mark.parametrize("backend", ["jit", "triton"])
def test_out_of_range_debug_raises_gpu(backend, monkeypatch):

    monkeypatch.setenv("JITKV_DEBUG", "1")
    jitkv.ops.reset()  # JITKV_DEBUG is read when a backend is resolved
    c, k = _cache(64, "2d", "cuda"), _k(40, "cuda")
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
@pytest.mark.parametrize("block_size", [64, 2])
def test_every_backend_same_bytes(block_size):
    """Writer then gather on jit, triton and torch on CUDA, and the CPU reference: the same bytes."""
    bs = block_size
    k, c, base = _k(200, "cpu"), _cache(bs, "3d", "cpu"), rand((5, 303, 520), torch.bfloat16)
    sm = slots(NUM_BLOCKS[bs] * bs, 200, torch.int64)
    sm[3::5] = -1
    seq, gl, bt = _requests(bs, 5, 300, "short", True, "cpu")
    results = []
    for device, backend in [("cpu", "torch")] + [("cuda", b) for b in BACKENDS["cuda"]]:
        cd, out = c.to(device), base.to(device)
        WRITE(k.to(device), _view(cd, bs, "3d"), sm.to(device), block_size=bs, backend=backend)
        GATHER(
            out[:, :300, :512],
            _view(cd, bs, "3d"),
            seq.to(device),
            gl.to(device),
            bt.to(device),
            bs,
            1,
            backend=backend,
        )
        results.append((cd.cpu(), out.cpu()))
    for cd, out in results[1:]:
        assert_bitwise(cd, results[0][0])
        assert_bitwise(out, results[0][1])


def _reference_step(c, k, sm, bs, out, m, seq, gl, bt, offset):
    """Clones of cache and out after the reference writer, then the reference gather."""
    c, out = c.clone(), out.clone()
    reference.quantize_and_insert_k_cache(k, c, sm, block_size=bs)
    reference.dequantize_and_gather_k_cache(out[:, :m, :512], c, seq, gl, bt, bs, offset)
    return c, out


@gpu
@pytest.mark.parametrize("backend", ["jit", "triton"])
@pytest.mark.parametrize("block_size", [64, 2])
def test_cuda_graph_replay_with_new_inputs(backend, block_size):
    bs, n, num_reqs, m, offset = block_size, 200, 3, 150, 2
    num_slots = NUM_BLOCKS[bs] * bs
    c, k, sm = _cache(bs, "2d", "cuda"), _k(n, "cuda"), slots(num_slots, n, torch.int32, "cuda")
    seq, gl, bt = _requests(bs, num_reqs, m, "short", False, "cuda")
    out = rand((num_reqs, m + 3, 520), torch.bfloat16, "cuda")

    def step():
        WRITE(k, c, sm, block_size=bs, backend=backend)
        GATHER(out[:, :m, :512], c, seq, gl, bt, bs, offset, backend=backend)

    step()  # build / compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        new_sm = slots(num_slots, n, torch.int32, "cuda")
        new_sm[3::5] = -1
        new_seq, new_gl, new_bt = _requests(bs, num_reqs, m, "short", False, "cuda")
        for dst, src in (
            (k, _k(n, "cuda")),
            (sm, new_sm),
            (out, torch.randn_like(out)),
            (seq, new_seq),
            (gl, new_gl),
            (bt, new_bt),
        ):
            dst.copy_(src)
        ref_c, ref_out = _reference_step(c, k, sm, bs, out, m, seq, gl, bt, offset)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(c, ref_c)
        assert_bitwise(out, ref_out)


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_side_stream(backend):
    """Both ops on a side stream whose k only becomes ready after a long sleep there: an op launched on
    another stream would read the old k."""
    bs, n, m = 64, 300, 200
    c, k, sm = _cache(bs, "2d", "cuda"), _k(n, "cuda"), slots(512, n, torch.int64, "cuda")
    new_k = _k(n, "cuda")
    seq, gl, bt = _requests(bs, 4, m, None, False, "cuda")
    out = rand((4, m + 3, 520), torch.bfloat16, "cuda")
    ref_c, ref_out = _reference_step(c, new_k, sm, bs, out, m, seq, gl, bt, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        k.copy_(new_k)
        WRITE(k, c, sm, block_size=bs, backend=backend)
        GATHER(out[:, :m, :512], c, seq, gl, bt, bs, 0, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert_bitwise(c, ref_c)
    assert_bitwise(out, ref_out)


def test_triton_kernel_under_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 against the reference (CI has no GPU)."""
    run_under_interpreter(f"{__name__}:triton_interpreter_cases")


def triton_interpreter_cases():
    """Run by test_triton_kernel_under_interpreter in a process with TRITON_INTERPRET=1."""
    from jitkv.triton.dsv4 import dequantize_and_gather_k_cache_triton, quantize_and_insert_k_cache_triton

    for bs, stride in ((64, None), (2, None), (64, 64 * 584)):  # padded, and vLLM's unpadded blocks
        cache = L.allocate(24, bs, "cpu", block_stride=stride).random_(0, 256)
        k = (torch.randn(50, 512) * torch.logspace(-3, 2, 50)[:, None]).bfloat16()
        sm = slots(24 * bs, 45)
        sm[::6] = -1
        got, ref = cache.clone(), cache.clone()
        quantize_and_insert_k_cache_triton(k, got, sm, bs)
        reference.quantize_and_insert_k_cache(k, ref, sm, block_size=bs)
        assert_bitwise(got, ref)
        seq = torch.tensor([5 * bs - 3, 2 * bs], dtype=torch.int32)
        gl = torch.tensor([3 * bs, 2 * bs + 9], dtype=torch.int32)
        table = torch.randperm(24)[:10].view(2, 5).int()
        table[1, 0] = -1
        out = rand((2, 4 * bs, 512), torch.bfloat16)
        expect = out.clone()
        dequantize_and_gather_k_cache_triton(out, got, seq, gl, table, bs, 5)
        reference.dequantize_and_gather_k_cache(expect, ref, seq, gl, table, bs, 5)
        assert_bitwise(out, expect)
