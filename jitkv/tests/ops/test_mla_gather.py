"""gather_mla_cache: whole-destination bitwise equality with the torch reference on every backend of every
device present (CPU: jit, torch; CUDA: jit, triton, torch), over every kv_cache_dtype; the semantics
checked without the reference (cache bytes, torch's fp8 conversion); zero rows, clipping, strided views;
bad input with the argument named; graph replay, side streams, every CUDA module."""

from __future__ import annotations

import pytest
import torch

import jitkv
from jitkv import reference
from jitkv.codes import DsMla
from jitkv.tests.conftest import BACKENDS, DEV_BACKENDS, HAS_CUDA, assert_bitwise, gpu, rand
from jitkv.tests.triton.interpreter import run_under_interpreter

OP = "gather_mla_cache"
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# (kv_cache_dtype, cache dtype, cache entry width W): out is bf16 [T, 576] for the fp8 formats, else
# the cache's dtype and width.
FORMATS = [
    ("auto", torch.bfloat16, 576),
    ("auto", torch.float16, 576),
    ("auto", torch.float32, 96),
    ("auto", torch.uint8, 656),
    ("auto", torch.float8_e4m3fn, 576),
    ("fp8_e4m3", torch.float8_e4m3fn, 576),
    ("fp8", torch.uint8, 576),
    ("fp8_e5m2", torch.float8_e5m2, 576),
    ("fp8_e5m2", torch.uint8, 576),
    ("fp8_ds_mla", torch.uint8, DsMla.BYTES),
]
FORMAT_IDS = [f"{f}-{str(d).split('.')[1]}-{w}" for f, d, w in FORMATS]


def _ds_records(num_blocks, block_size, device, *, width=DsMla.BYTES):
    """Random fp8_ds_mla records: random e4m3 bytes (NaN codes included), positive finite tile scales
    over several binades, random bf16 rope."""
    c = rand((num_blocks, block_size, width), torch.uint8)
    tiles = DsMla.NOPE // DsMla.TILE
    scales = torch.rand(num_blocks, block_size, tiles) * torch.exp2(
        torch.randint(-12, 4, (num_blocks, block_size, tiles)).float()
    )
    c[..., DsMla.SCALE_OFFSET : DsMla.ROPE_OFFSET] = (
        (scales + 1e-6).view(torch.uint8).reshape(num_blocks, block_size, -1)
    )
    rope = torch.randn(num_blocks, block_size, DsMla.ROPE).bfloat16()
    c[..., DsMla.ROPE_OFFSET : DsMla.BYTES] = rope.view(torch.uint8)
    return c.to(device)


def _cache(fmt, dtype, width, num_blocks, block_size, device, *, pad=0):
    """[num_blocks, block_size, width] (a view with token stride width + pad when pad > 0)."""
    if fmt == "fp8_ds_mla":
        c = _ds_records(num_blocks, block_size, device, width=width + pad)
    else:
        c = rand((num_blocks, block_size, width + pad), dtype, device)
    return c[..., :width] if pad else c


def _out_shape(fmt, width, rows):
    return (rows, DsMla.NOPE + DsMla.ROPE) if fmt == "fp8_ds_mla" else (rows, width)


def _out_dtype(fmt, dtype):
    return dtype if fmt == "auto" else torch.bfloat16


def _requests(lens, block_size, num_blocks, device, *, max_blocks=None, starts=None, idx_dtypes=(torch.int32,) * 3):
    """(block_table, cu_seq_lens, seq_starts) for requests of token counts `lens` whose tokens start at
    `starts` (None: 0) of their tables; each table a random sample of distinct blocks."""
    starts_list = starts or [0] * len(lens)
    need = max([-(-(n + s) // block_size) for n, s in zip(lens, starts_list)] + [1])
    max_blocks = max_blocks or need
    table = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens]) if lens else torch.zeros(0, max_blocks)
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()])
    bt_dt, cu_dt, st_dt = idx_dtypes
    seq_starts = None if starts is None else torch.tensor(starts).to(st_dt).to(device)
    return table.to(bt_dt).to(device), cu.to(cu_dt).to(device), seq_starts


def _scale(fmt, device, tensor=True):
    if fmt not in FP8:
        return None
    return torch.tensor([0.0371], device=device) if tensor else 0.0371


def _check(out, cache, table, cu, seq_starts, fmt, scale, backend):
    """Runs the op on a copy of the poisoned out and compares every byte with the reference's."""
    got, want = out.clone(), out.clone()
    jitkv.gather_mla_cache(
        got, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype=fmt, scale=scale, backend=backend
    )
    reference.gather_mla_cache(want, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype=fmt, scale=scale)
    assert_bitwise(got, want)
    return got


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("fmt,dtype,width", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("with_starts", [False, True])
def test_formats_match_reference(device, backend, fmt, dtype, width, block_size, with_starts):
    lens = [37, 0, 130, 1, 64]  # an empty request, a request of one token
    nb = 64 if block_size > 1 else 512
    starts = [5, 0, 17, 200, 0] if with_starts else None
    table, cu, seq_starts = _requests(lens, block_size, nb, device, starts=starts)
    cache = _cache(fmt, dtype, width, nb, block_size, device)
    out = rand(_out_shape(fmt, width, sum(lens) + 9), _out_dtype(fmt, dtype), device)  # 9 rows no request covers
    _check(out, cache, table, cu, seq_starts, fmt, _scale(fmt, device, tensor=block_size != 16), backend)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize(
    "idx_dtypes", [(torch.int64, torch.int32, torch.int64), (torch.int32, torch.int64, torch.int32)]
)
def test_index_dtypes(device, backend, idx_dtypes):
    table, cu, seq_starts = _requests([50, 70], 16, 32, device, starts=[3, 9], idx_dtypes=idx_dtypes)
    cache = _cache("auto", torch.bfloat16, 576, 32, 16, device)
    _check(rand((120, 576), torch.bfloat16, device), cache, table, cu, seq_starts, "auto", None, backend)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize(
    "fmt,dtype,width", [FORMATS[0], FORMATS[5], FORMATS[-1]], ids=[FORMAT_IDS[0], FORMAT_IDS[5], FORMAT_IDS[-1]]
)
def test_zero_rows(device, backend, fmt, dtype, width):
    """Entries < 0 and >= num_blocks, positions past the table and negative positions give zero rows;
    every other row is the cache entry."""
    bs, nb = 8, 16
    table, cu, _ = _requests([20, 30, 12], bs, nb, device, max_blocks=3)  # request 1 runs past its table
    table[0, 1] = -1
    table[2, 0] = nb
    seq_starts = torch.tensor([0, 0, -5], dtype=torch.int64, device=device)
    cache = _cache(fmt, dtype, width, nb, bs, device)
    got = _check(
        rand(_out_shape(fmt, width, 62), _out_dtype(fmt, dtype), device),
        cache,
        table,
        cu,
        seq_starts,
        fmt,
        _scale(fmt, device),
        backend,
    )
    zero = torch.zeros(got.shape[1], dtype=got.dtype, device=device)
    for row in [*range(8, 16), *range(20 + 24, 50), *range(50, 62)]:
        assert_bitwise(got[row], zero)
    assert got[0].view(torch.uint8).any() and got[20 + 23].view(torch.uint8).any()


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize(
    "fmt,dtype,width", [FORMATS[0], FORMATS[5], FORMATS[-1]], ids=[FORMAT_IDS[0], FORMAT_IDS[5], FORMAT_IDS[-1]]
)
def test_strided_views(device, backend, fmt, dtype, width):
    """A padded cache (token stride W + 32, block stride larger still), out rows inside wider rows,
    a block table that is a column slice, extra block_table and seq_starts rows."""
    bs, nb = 16, 40
    base = _cache(fmt, dtype, width, nb + 1, bs, device, pad=32)
    cache = base[1:]  # block stride (W + 32) * bs, data pointer one block in
    table, cu, _ = _requests([40, 77, 3], bs, nb, device, starts=[0, 2, 9])
    full = torch.cat([table, (table + 1) % nb], dim=1)
    full = torch.cat([full, full[:2]])  # extra rows
    wide = full[:, table.shape[1] // 2 :]  # a column slice: row stride 2 x max_blocks
    seq_starts = torch.tensor([0, 2, 9, 1000], dtype=torch.int32, device=device)
    d = _out_shape(fmt, width, 1)[1]
    out = rand((130, d + 64), _out_dtype(fmt, dtype), device)[:, 32 : 32 + d]
    assert wide.stride(0) == 2 * table.shape[1] and out.stride(0) == d + 64
    _check(out, cache, wide, cu, seq_starts, fmt, _scale(fmt, device), backend)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_semantics_without_the_reference(device, backend):
    """Each output row is the cache entry its request's table names (a copy), and fp8 rows are
    torch's own float8 -> float conversion times the scale, rounded to bf16."""
    bs, nb = 4, 12
    table = torch.tensor([[5, 2, 9], [0, 11, 7]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 6, 13], dtype=torch.int32, device=device)
    seq_starts = torch.tensor([1, 4], dtype=torch.int32, device=device)
    want_entries = [
        (5, 1),
        (5, 2),
        (5, 3),
        (2, 0),
        (2, 1),
        (2, 2),
        (11, 0),
        (11, 1),
        (11, 2),
        (11, 3),
        (7, 0),
        (7, 1),
        (7, 2),
    ]
    cache = rand((nb, bs, 576), torch.bfloat16, device)
    out = rand((13, 576), torch.bfloat16, device)
    jitkv.gather_mla_cache(out, cache, table, cu, seq_starts=seq_starts, backend=backend)
    for row, (b, t) in enumerate(want_entries):
        assert_bitwise(out[row], cache[b, t])
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        fp8 = rand((nb, bs, 576), FP8[fmt], device)
        jitkv.gather_mla_cache(
            out, fp8, table, cu, seq_starts=seq_starts, kv_cache_dtype=fmt, scale=0.25, backend=backend
        )
        for row, (b, t) in enumerate(want_entries):
            x = (fp8[b, t].float() * 0.25).bfloat16()
            finite = ~torch.isnan(x)
            assert_bitwise(out[row][finite], x[finite])
            assert (out[row][~finite].view(torch.int16) == 0x7FFF).all()


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_ds_mla_round_trip(device, backend):
    """Records quantized here (tile scale amax / 448, e4m3 round to nearest) dequantize to within the
    e4m3 step of the bf16 source; the rope dims come back exactly."""
    bs, n = 16, 48
    x = (torch.randn(n, DsMla.NOPE + DsMla.ROPE) * torch.logspace(-2, 2, n)[:, None]).bfloat16()
    nope = x[:, : DsMla.NOPE].float().view(n, -1, DsMla.TILE)
    scale = nope.abs().amax(-1, keepdim=True) / 448
    q = (nope / scale).to(torch.float8_e4m3fn).view(torch.uint8).view(n, DsMla.NOPE)
    rec = torch.cat([q, scale.view(n, -1).view(torch.uint8), x[:, DsMla.NOPE :].contiguous().view(torch.uint8)], dim=1)
    cache = rec.view(n // bs, bs, DsMla.BYTES).to(device)
    table = torch.arange(n // bs, dtype=torch.int32, device=device).view(1, -1)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    out = rand((n, 576), torch.bfloat16, device)
    jitkv.gather_mla_cache(out, cache, table, cu, kv_cache_dtype="fp8_ds_mla", backend=backend)
    out = out.cpu()
    assert_bitwise(out[:, DsMla.NOPE :], x[:, DsMla.NOPE :])
    err = (out[:, : DsMla.NOPE].float() - x[:, : DsMla.NOPE].float()).abs().view(n, -1, DsMla.TILE)
    # e4m3 rounding: half a step of 3 mantissa bits (subnormals: of 2^-9 x scale); then bf16 rounding
    assert (err <= nope.abs() * (2**-4 + 2**-7) + scale * 2**-9).all()


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_empty(device, backend):
    cache = _cache("auto", torch.bfloat16, 576, 4, 16, device)
    table = torch.zeros(2, 1, dtype=torch.int32, device=device)
    for rows, cu in ((5, [0]), (0, [0, 0, 0]), (5, [0, 0, 0])):  # no request, no row, empty requests
        out = rand((rows, 576), torch.bfloat16, device)
        _check(out, cache, table, torch.tensor(cu, dtype=torch.int32, device=device), None, "auto", None, backend)
    empty = cache[:0]  # no block at all: every row is a zero row
    out = rand((7, 576), torch.bfloat16, device)
    got = _check(out, empty, table, torch.tensor([0, 3, 7], device=device), None, "auto", None, backend)
    assert not got.view(torch.uint8).any()


def test_scale_as_float_or_tensor_same_bytes():
    table, cu, seq_starts = _requests([30, 20], 8, 16, "cpu", starts=[1, 2])
    cache = _cache("fp8_e4m3", torch.float8_e4m3fn, 576, 16, 8, "cpu")
    outs = []
    for scale in (0.0371, torch.tensor([0.0371])):
        out = torch.zeros(50, 576, dtype=torch.bfloat16)
        jitkv.gather_mla_cache(out, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype="fp8_e4m3", scale=scale)
        outs.append(out)
    assert_bitwise(outs[0], outs[1])


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
@pytest.mark.parametrize(
    "cu,exc,message",
    [
        ([0, 10, 8], ValueError, r"cu_seq_lens: expected non-decreasing values, got 10 then 8 at positions 1, 2"),
        ([0, 10, 21], ValueError, r"out: has 20 rows, but the requests end at row 21 \(cu_seq_lens\[-1\]\)"),
        ([-1, 10, 20], ValueError, r"cu_seq_lens: request 0 starts at row -1, below row 0 of out"),
    ],
)
def test_rows_outside_out_raise_before_writing_cpu(backend, cu, exc, message):
    table, _, _ = _requests([10, 10], 8, 8, "cpu")
    cache = _cache("auto", torch.bfloat16, 576, 8, 8, "cpu")
    out = rand((20, 576), torch.bfloat16)
    before = out.clone()
    with pytest.raises(exc, match=rf"{OP}: {message}"):
        jitkv.gather_mla_cache(out, cache, table, torch.tensor(cu), backend=backend)
    assert_bitwise(out, before)


def _bad_args(device):
    table, cu, seq_starts = _requests([5, 6], 8, 4, device, starts=[0, 1])
    return dict(
        out=rand((11, 576), torch.bfloat16, device),
        kv_cache=_cache("auto", torch.bfloat16, 576, 4, 8, device),
        block_table=table,
        cu_seq_lens=cu,
        seq_starts=seq_starts,
        kv_cache_dtype="auto",
        scale=None,
    )


def _fp8(a, **kw):
    a.update(
        kv_cache=rand(a["kv_cache"].shape, torch.float8_e4m3fn, a["out"].device), kv_cache_dtype="fp8_e4m3", scale=0.5
    )
    a.update(kw)


BAD = [
    ("unknown kv_cache_dtype", lambda a: a.update(kv_cache_dtype="fp8_e4m3fnuz"), ValueError, "kv_cache_dtype"),
    ("out dtype", lambda a: a.update(out=a["out"].half()), TypeError, "out"),
    ("cache dtype int32", lambda a: a.update(kv_cache=a["kv_cache"].view(torch.int32)), TypeError, "kv_cache"),
    ("fp8 cache for e5m2", lambda a: _fp8(a, kv_cache_dtype="fp8_e5m2"), ValueError, "kv_cache_dtype"),
    ("bf16 cache for fp8", lambda a: a.update(kv_cache_dtype="fp8_e4m3", scale=0.5), ValueError, "kv_cache_dtype"),
    ("fp8 out not bf16", lambda a: _fp8(a, out=a["out"].half()), TypeError, "out"),
    ("fp8 missing scale", lambda a: _fp8(a, scale=None), ValueError, "scale"),
    ("fp8 zero scale", lambda a: _fp8(a, scale=0.0), ValueError, "scale"),
    ("fp8 nan scale", lambda a: _fp8(a, scale=float("nan")), ValueError, "scale"),
    (
        "fp8 negative scale tensor",
        lambda a: _fp8(a, scale=torch.tensor([-1.0], device=a["out"].device)),
        ValueError,
        "scale",
    ),
    (
        "fp8 scale float64",
        lambda a: _fp8(a, scale=torch.tensor([0.5], dtype=torch.float64, device=a["out"].device)),
        TypeError,
        "scale",
    ),
    (
        "fp8 scale 2 elements",
        lambda a: _fp8(a, scale=torch.tensor([0.5, 1.0], device=a["out"].device)),
        ValueError,
        "scale",
    ),
    ("ds_mla bf16 cache", lambda a: a.update(kv_cache_dtype="fp8_ds_mla"), ValueError, "kv_cache_dtype"),
    (
        "ds_mla width",
        lambda a: a.update(kv_cache_dtype="fp8_ds_mla", kv_cache=a["kv_cache"].view(torch.uint8)[..., :1024]),
        ValueError,
        "kv_cache",
    ),
    ("out width", lambda a: a.update(out=a["out"][:, :512]), ValueError, "out"),
    ("out rank", lambda a: a.update(out=a["out"].view(11, 2, 288)), ValueError, "out"),
    (
        "out noncontiguous",
        lambda a: a.update(out=rand((576, 11), torch.bfloat16, a["out"].device).t()),
        ValueError,
        "out",
    ),
    ("cache rank", lambda a: a.update(kv_cache=a["kv_cache"].view(32, 576)), ValueError, "kv_cache"),
    ("cu float", lambda a: a.update(cu_seq_lens=a["cu_seq_lens"].float()), TypeError, "cu_seq_lens"),
    ("cu empty", lambda a: a.update(cu_seq_lens=a["cu_seq_lens"][:0]), ValueError, "cu_seq_lens"),
    ("cu 2-D", lambda a: a.update(cu_seq_lens=a["cu_seq_lens"].view(3, 1)), ValueError, "cu_seq_lens"),
    ("table float", lambda a: a.update(block_table=a["block_table"].float()), TypeError, "block_table"),
    ("table 1-D", lambda a: a.update(block_table=a["block_table"].flatten()), ValueError, "block_table"),
    ("table too few rows", lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table"),
    ("seq_starts too short", lambda a: a.update(seq_starts=a["seq_starts"][:1]), ValueError, "seq_starts"),
    ("seq_starts uint8", lambda a: a.update(seq_starts=a["seq_starts"].to(torch.uint8)), TypeError, "seq_starts"),
    ("kv_cache not a tensor", lambda a: a.update(kv_cache=3), TypeError, "kv_cache"),
    ("out not a tensor", lambda a: a.update(out=[1.0]), TypeError, "out"),
]


# A CUDA scale tensor's value is read on the device only (checked on the host under JITKV_DEBUG=1).
CPU_ONLY = {"fp8 negative scale tensor"}


@pytest.mark.parametrize(
    "device,backend,case",
    [(d, b, c) for d, b in DEV_BACKENDS for c in BAD if d == "cpu" or c[0] not in CPU_ONLY],
    ids=[f"{d}-{b}-{c[0]}" for d, b in DEV_BACKENDS for c in BAD if d == "cpu" or c[0] not in CPU_ONLY],
)
def test_bad_input(device, backend, case):
    _, mutate, exc, name = case
    args = _bad_args(device)
    mutate(args)
    before = args["out"].clone() if isinstance(args["out"], torch.Tensor) else None
    with pytest.raises(exc, match=rf"{OP}: {name}\b"):
        jitkv.gather_mla_cache(
            *list(args.values())[:4],
            seq_starts=args["seq_starts"],
            kv_cache_dtype=args["kv_cache_dtype"],
            scale=args["scale"],
            backend=backend,
        )
    if before is not None:
        assert_bitwise(args["out"], before)


def test_cuda_compile_only_every_module(tmp_path, monkeypatch):
    """Every prebuilt CUDA module of the family builds for sm_90a with no GPU present."""
    from jitkv.jit import ensure_built
    from jitkv.ops.mla_gather import specs as jit_specs
    from jitkv.tests.jit.test_build import _need_nvcc

    _need_nvcc()
    monkeypatch.setenv("JITKV_CACHE_DIR", str(tmp_path))
    for spec in jit_specs("9.0a"):
        assert (ensure_built(spec) / "manifest.json").is_file()


def test_torch_compile_fullgraph():
    device = "cuda" if HAS_CUDA else "cpu"
    table, cu, seq_starts = _requests([30, 21], 8, 16, device, starts=[2, 0])
    cache = _cache("fp8_e4m3", torch.float8_e4m3fn, 576, 16, 8, device)
    out = rand((60, 576), torch.bfloat16, device)
    want = out.clone()
    reference.gather_mla_cache(want, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype="fp8_e4m3", scale=0.5)

    @torch.compile(fullgraph=True, backend="eager")
    def step(o, c, t, s, st):
        jitkv.gather_mla_cache(o, c, t, s, seq_starts=st, kv_cache_dtype="fp8_e4m3", scale=0.5)

    step(out, cache, table, cu, seq_starts)
    assert_bitwise(out, want)


# ------------------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_requests_past_out_clipped_gpu(backend, monkeypatch):
    """out is a slice of a larger buffer; requests running past it (and one starting below row 0)
    write only out's rows: every byte around out is untouched."""
    monkeypatch.delenv("JITKV_DEBUG", raising=False)
    table, _, seq_starts = _requests([40, 40, 40], 16, 32, "cuda", starts=[0, 3, 1])
    cache = _cache("auto", torch.bfloat16, 576, 32, 16, "cuda")
    buf = rand((140, 576), torch.bfloat16, "cuda")
    for cu in ([0, 40, 80, 120], [-7, 40, 80, 120], [10, 60, 90, 300]):
        cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
        got, want = buf.clone(), buf.clone()
        jitkv.gather_mla_cache(got[10:110], cache, table, cu, seq_starts=seq_starts, backend=backend)
        reference.gather_mla_cache(want[10:110], cache, table, cu, seq_starts=seq_starts, strict=False)
        assert_bitwise(got, want)
        assert_bitwise(got[:10], buf[:10])
        assert_bitwise(got[110:], buf[110:])


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_rows_outside_out_debug_raises_gpu(backend, monkeypatch):
    monkeypatch.setenv("JITKV_DEBUG", "1")
    jitkv.ops.reset()  # JITKV_DEBUG is read when a backend is resolved
    table, _, _ = _requests([10, 10], 8, 8, "cuda")
    cache = _cache("auto", torch.bfloat16, 576, 8, 8, "cuda")
    out = rand((20, 576), torch.bfloat16, "cuda")
    before = out.clone()
    try:
        with pytest.raises(ValueError, match=r"out: has 20 rows, but the requests end at row 25 \(cu_seq_lens\[-1\]\)"):
            jitkv.gather_mla_cache(out, cache, table, torch.tensor([0, 10, 25], device="cuda"), backend=backend)
        with pytest.raises(ValueError, match=r"scale: must be finite and > 0"):
            jitkv.gather_mla_cache(
                out,
                rand((8, 8, 576), torch.float8_e4m3fn, "cuda"),
                table,
                torch.tensor([0, 10, 20], device="cuda"),
                kv_cache_dtype="fp8_e4m3",
                scale=torch.tensor([0.0], device="cuda"),
                backend=backend,
            )
    finally:
        monkeypatch.undo()
        jitkv.ops.reset()
    torch.cuda.synchronize()
    assert_bitwise(out, before)


@gpu
@pytest.mark.parametrize("fmt,dtype,width", FORMATS, ids=FORMAT_IDS)
def test_every_backend_same_bytes(fmt, dtype, width):
    """16 requests of up to 4096 tokens (the benchmark's shape at random lengths), from a cache with
    unused blocks, -1 entries and positions past the tables: jit, triton and torch write the same bytes."""
    bs, nb = 64, 1200
    lens = torch.randint(0, 4096, (16,)).tolist()
    starts = torch.randint(0, 300, (16,)).tolist()
    table, cu, seq_starts = _requests(
        lens, bs, nb, "cuda", starts=starts, idx_dtypes=(torch.int32, torch.int32, torch.int64)
    )
    table[3, 2] = -1
    table[5, -1] = -1
    cache = _cache(fmt, dtype, width, nb, bs, "cuda")
    out = rand(_out_shape(fmt, width, sum(lens) + 100), _out_dtype(fmt, dtype), "cuda")
    scale = _scale(fmt, "cuda")
    outs = []
    for backend in BACKENDS["cuda"]:
        got = out.clone()
        jitkv.gather_mla_cache(
            got, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype=fmt, scale=scale, backend=backend
        )
        outs.append(got)
    for got in outs[1:]:
        assert_bitwise(got, outs[0])
    want = out.clone()
    reference.gather_mla_cache(want, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype=fmt, scale=scale)
    assert_bitwise(outs[0], want)


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
@pytest.mark.parametrize(
    "fmt,dtype,width", [FORMATS[0], FORMATS[5], FORMATS[-1]], ids=[FORMAT_IDS[0], FORMAT_IDS[5], FORMAT_IDS[-1]]
)
def test_cuda_graph_replay_with_new_inputs(backend, fmt, dtype, width, monkeypatch):
    """Captured once; replayed with new request lengths, tables, starts, scale and cache contents."""
    monkeypatch.delenv("JITKV_DEBUG", raising=False)
    bs, nb, rows = 16, 96, 700

    def inputs():
        lens = torch.randint(0, 200, (4,)).tolist()
        return _requests(lens, bs, nb, "cuda", max_blocks=24, starts=torch.randint(0, 150, (4,)).tolist())

    table, cu, seq_starts = inputs()
    cache = _cache(fmt, dtype, width, nb, bs, "cuda")
    scale = torch.tensor([0.5], device="cuda") if fmt in FP8 else None
    out = rand(_out_shape(fmt, width, rows), _out_dtype(fmt, dtype), "cuda")

    def call():
        jitkv.gather_mla_cache(
            out, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype=fmt, scale=scale, backend=backend
        )

    call()  # build / compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        for t, new in zip((table, cu, seq_starts), inputs()):
            t.copy_(new)
        cache.copy_(_cache(fmt, dtype, width, nb, bs, "cuda"))
        if scale is not None:
            scale.fill_(float(torch.rand(())) + 0.01)
        want = out.clone()
        reference.gather_mla_cache(want, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype=fmt, scale=scale)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, want)


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_side_stream(backend):
    table, cu, seq_starts = _requests([300, 500], 16, 64, "cuda", starts=[4, 0])
    cache = _cache("fp8_ds_mla", torch.uint8, DsMla.BYTES, 64, 16, "cuda")
    out = rand((800, 576), torch.bfloat16, "cuda")
    want = out.clone()
    reference.gather_mla_cache(want, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype="fp8_ds_mla")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        jitkv.gather_mla_cache(
            out, cache, table, cu, seq_starts=seq_starts, kv_cache_dtype="fp8_ds_mla", backend=backend
        )
    torch.cuda.current_stream().wait_stream(side)
    assert_bitwise(out, want)


@gpu
def test_unaligned_views_fall_back_from_jit(monkeypatch):
    """Views the CUDA kernel's vectors cannot take (an out row stride of 577 elements, a cache entry
    at an odd byte) run on Triton, recorded in backend_info and warned about; forcing jit raises."""
    monkeypatch.setattr(jitkv.ops._op, "_WARNED", set())
    jitkv.ops.reset()
    table, cu, _ = _requests([30, 30], 8, 16, "cuda")
    cache = _cache("auto", torch.bfloat16, 576, 16, 8, "cuda")
    out = rand((60, 577), torch.bfloat16, "cuda")[:, :576]
    odd = rand((16 * 8 * 576 + 1,), torch.uint8, "cuda")[1:].view(16, 8, 576)
    with pytest.warns(jitkv.JitkvFallbackWarning, match="aligned"):
        _check(out, cache, table, cu, None, "auto", None, None)
        _check(rand((60, 576), torch.uint8, "cuda"), odd, table, cu, None, "auto", None, None)
    assert jitkv.backend_info(OP)["cuda:0"]["backend"] == "triton"
    before = out.clone()
    with pytest.raises(jitkv.BackendUnavailable, match="aligned"):
        jitkv.gather_mla_cache(out, cache, table, cu, backend="jit")
    assert_bitwise(out, before)


@gpu
@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"])
def test_module_for_another_format_refuses(fmt):
    """A module's binding refuses arguments of another kv_cache_dtype or row width (ValueError), before
    anything runs."""
    from jitkv.codes import KV_FORMATS as CODES
    from jitkv.jit import cuda_arch, get_function
    from jitkv.ops.mla_gather import cuda_spec

    other = "fp8_e4m3" if fmt == "auto" else "auto"
    fn = get_function(cuda_spec(cuda_arch(torch.device("cuda")), int(CODES[other]), 1152), OP)
    table, cu, _ = _requests([5], 8, 4, "cuda")
    cache = _cache(
        fmt,
        FP8.get(fmt, torch.uint8 if fmt == "fp8_ds_mla" else torch.bfloat16),
        DsMla.BYTES if fmt == "fp8_ds_mla" else 576,
        4,
        8,
        "cuda",
    )
    out = rand((5, 576), torch.bfloat16, "cuda")
    before = out.clone()
    with pytest.raises(ValueError, match=r"gather_mla_cache: out: this module was compiled for"):
        fn(out, cache, table, cu, None, int(CODES[fmt]), None, 0.5 if fmt in FP8 else -1.0)
    assert_bitwise(out, before)


def test_triton_kernel_under_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 against the reference (CI has no GPU)."""
    run_under_interpreter(f"{__name__}:triton_interpreter_cases")


def triton_interpreter_cases():
    """Run by test_triton_kernel_under_interpreter in a process with TRITON_INTERPRET=1."""
    from jitkv.triton.mla_gather import gather_mla_cache_triton

    for fmt, dtype, width in (
        ("auto", torch.bfloat16, 576),
        ("auto", torch.uint8, 100),
        ("fp8_e4m3", torch.float8_e4m3fn, 576),
        ("fp8_e5m2", torch.uint8, 576),
        ("fp8_ds_mla", torch.uint8, 656),
    ):
        bs, nb = 8, 24
        table, cu, starts = _requests([21, 0, 30, 9], bs, nb, "cpu", max_blocks=4, starts=[3, 0, -2, 1])
        table[0, 1] = -1
        table[3, 0] = nb
        cache = _cache(fmt, dtype, width, nb, bs, "cpu", pad=16)
        d = 576 if fmt != "auto" else width
        out = rand((64, d), dtype if fmt == "auto" else torch.bfloat16)[:55]
        cu += 3  # rows 0..2 are no request's, rows past 55 are clipped: neither is written
        for scale in (0.37, torch.tensor([2.5])) if fmt.startswith("fp8_e") else (None,):
            got, want = out.clone(), out.clone()
            gather_mla_cache_triton(got, cache, table, cu, starts, fmt, scale)
            reference.gather_mla_cache(
                want, cache, table, cu, seq_starts=starts, kv_cache_dtype=fmt, scale=scale, strict=False
            )
            assert_bitwise(got, want)
