"""set_mla_kv_buffer quantizing on write (kv_cache_dtype "fp8"/"fp8_e4m3"/"fp8_e5m2" with a per-tensor
scale, and vLLM's "fp8_ds_mla" record): whole-buffer bitwise equality with the torch reference on
every backend, the reference against torch's own float8 conversion, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

import jitkv
from jitkv import reference
from jitkv.codes import DsMla
from jitkv.tests.conftest import (
    BACKENDS,
    DEV_BACKENDS,
    HAS_CUDA,
    QUICK_WINDOW_SCALES,
    assert_bitwise,
    every_16_bit_value,
    gpu,
    rand,
    slots,
)
from jitkv.tests.triton.interpreter import run_under_interpreter

# (kv_cache_dtype, buffer dtype): every buffer dtype each format writes.
FORMATS = [
    ("fp8_e4m3", torch.float8_e4m3fn),
    ("fp8", torch.uint8),
    ("fp8_e5m2", torch.float8_e5m2),
    ("fp8_e5m2", torch.uint8),
    ("fp8_ds_mla", torch.uint8),
]
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SRC_DTYPES = [torch.bfloat16, torch.float16]


def values(shape, dtype, gen=None):
    """Random values over many binades (1e-4 ... 1e3: saturation, fp8 subnormals and zeros appear
    after dividing by the scales used here), never all zero."""
    x = torch.randn(shape, generator=gen) * 10 ** torch.empty(shape).uniform_(-4, 3, generator=gen)
    return x.to(dtype)


def with_specials(x):
    """x with IEEE special values spread over it: ±0, ±inf, NaN, the dtype's max and smallest
    subnormal, a whole zero tile (row 0, dims 128..255) and a tile whose only finite value is tiny."""
    x = x.clone()
    info = torch.finfo(x.dtype)
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan, info.max, -info.max, info.smallest_normal / 4, 1e-30]
    flat = x.view(-1)
    idx = torch.randperm(flat.numel())[: 4 * len(specials)]
    for i, v in enumerate(specials * 4):
        flat[idx[i]] = v
    if x.shape[1] >= 256:
        x[0, 128:256] = 0
        if x.shape[0] > 1:
            x[1, 256:384] = math.nan
            x[1, 300] = 3e-38 if x.dtype == torch.bfloat16 else 6e-8
    return x


def _case(
    fmt,
    buf_dtype,
    src,
    n,
    device,
    *,
    nope=512,
    rope=64,
    num_slots=4096,
    extra=0,
    three_d=False,
    width=None,
    specials=False,
):
    width = width or (DsMla.BYTES if fmt == "fp8_ds_mla" else nope + rope)
    buf = rand((num_slots, 1, width) if three_d else (num_slots, width), buf_dtype, device)
    x = values((n + extra, nope + rope), src)
    if specials:
        x = with_specials(x)
    x = x.to(device)
    k_nope, k_rope = x[:, :nope], x[:, nope:]  # strided views of one tensor
    if three_d:
        k_nope, k_rope = k_nope.unsqueeze(1), k_rope.unsqueeze(1)
    return buf, k_nope, k_rope


def _scale(fmt, device, as_tensor):
    if fmt == "fp8_ds_mla":
        return None
    return torch.tensor([0.37], device=device) if as_tensor else 0.37


def _check(buf, loc, k_nope, k_rope, backend, **kw):
    got, ref = buf.clone(), buf.clone()
    jitkv.set_mla_kv_buffer(got, loc, k_nope, k_rope, backend=backend, **kw)
    reference.set_mla_kv_buffer_fp8(ref, loc, k_nope, k_rope, **kw)
    assert_bitwise(got, ref)
    return got


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("fmt,buf_dtype", FORMATS)
@pytest.mark.parametrize("src", SRC_DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 64, 257, 1024])
def test_formats(device, backend, fmt, buf_dtype, src, n):
    buf, k_nope, k_rope = _case(fmt, buf_dtype, src, n, device, three_d=n % 2 == 1, extra=n % 3)
    loc = slots(buf.shape[0], n, torch.int32 if n % 2 else torch.int64, device)
    _check(buf, loc, k_nope, k_rope, backend, kv_cache_dtype=fmt, scale=_scale(fmt, device, n % 2 == 0))


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("fmt,buf_dtype", FORMATS)
@pytest.mark.parametrize("src", SRC_DTYPES)
def test_special_values(device, backend, fmt, buf_dtype, src):
    """±0, ±inf, NaN, max, subnormals, zero and NaN tiles; for the per-tensor formats also scales far
    from 1 (every value then leaves the CUDA kernels' branch-free division window)."""
    buf, k_nope, k_rope = _case(fmt, buf_dtype, src, 96, device, specials=True)
    loc = slots(buf.shape[0], 96, torch.int64, device)
    for scale in [None] if fmt == "fp8_ds_mla" else [0.37, 3e-30, 7e29, torch.tensor([1e-20], device=device)]:
        _check(buf, loc, k_nope, k_rope, backend, kv_cache_dtype=fmt, scale=scale)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("src", SRC_DTYPES)
def test_ds_mla_every_tile_amax(device, backend, src):
    """A tile whose largest magnitude is each finite positive value of the source dtype (and inf): the
    tile scale max(amax / 448, FLT_MIN) is the correctly rounded quotient for every one (the CUDA
    kernel computes it without a division)."""
    top = 0x7F80 if src == torch.bfloat16 else 0x7C00  # inf
    amax = torch.arange(top + 1, dtype=torch.int32).to(torch.int16).view(src).float()
    tiles = -(-amax.numel() // 4) * 4
    amax = torch.cat([amax, amax[: tiles - amax.numel()]])
    x = (amax[:, None] * torch.rand(tiles, 128)).to(src)  # never above amax
    x[:, 5] = amax.to(src)
    x = x.view(-1, 512)
    rope = values((x.shape[0], 64), src)
    n = x.shape[0]
    buf = rand((n + 5, DsMla.BYTES), torch.uint8, device)
    loc = torch.randperm(n + 5)[:n].to(device)
    got = _check(buf, loc, x.to(device), rope.to(device), backend, kv_cache_dtype="fp8_ds_mla")
    scales = got[loc.long()].cpu()[:, 512:528].contiguous().view(torch.float32).reshape(-1)
    expect = torch.tensor([max(a / 448, 2.0**-126) for a in amax.double().tolist()]).float()  # float64, rounded once
    assert_bitwise(scales, expect)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("nope,rope", [(128, 32), (100, 20), (512, 0)])
def test_per_tensor_other_widths(device, backend, fmt, nope, rope):
    """Rows that are not 16-byte vectors (100 + 20: CUDA's generic kernel) and a row without rope."""
    buf, k_nope, k_rope = _case(fmt, FP8[fmt], torch.bfloat16, 33, device, nope=nope, rope=rope, width=nope + rope + 9)
    got = _check(
        buf, slots(buf.shape[0], 33, torch.int64, device), k_nope, k_rope, backend, kv_cache_dtype=fmt, scale=0.5
    )
    assert_bitwise(got[:, nope + rope :], buf[:, nope + rope :])


def test_reference_matches_torch_float8_cast():
    """The per-tensor formats are torch's own ``(x.float() / scale).clamp(±max).to(float8)`` of the
    nope then rope values; the fp8_ds_mla record decodes to the values within e4m3 precision, its
    scales are amax / 448 rounded once and its nope bytes torch's e4m3 cast of x / scale."""
    n = 40
    for src in SRC_DTYPES:
        x = with_specials(values((n, 576), src))
        loc = slots(64, n)
        for fmt in ("fp8_e4m3", "fp8_e5m2"):
            buf = rand((64, 576), FP8[fmt])
            jitkv.set_mla_kv_buffer(buf, loc, x[:, :512], x[:, 512:], kv_cache_dtype=fmt, scale=0.37, backend="jit")
            m = torch.finfo(FP8[fmt]).max
            expect = (x.float() / torch.tensor(0.37)).clamp(-m, m).to(FP8[fmt])
            assert_bitwise(buf[loc], expect)
        x = values((n, 576), src)
        buf = rand((64, DsMla.BYTES), torch.uint8)
        jitkv.set_mla_kv_buffer(buf, loc, x[:, :512], x[:, 512:], kv_cache_dtype="fp8_ds_mla", backend="jit")
        rec = buf[loc]
        tiles = x[:, :512].float().view(n, 4, 128)
        scales = torch.tensor([[max(t.abs().max().item() / 448, 2.0**-126) for t in row] for row in tiles])
        assert_bitwise(rec[:, 512:528].contiguous().view(torch.float32), scales)
        assert_bitwise(rec[:, :512], (tiles / scales[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, 512))
        assert_bitwise(rec[:, 528:], x[:, 512:].contiguous().view(torch.uint8))
        decoded = rec[:, :512].view(torch.float8_e4m3fn).float().view(n, 4, 128) * scales[..., None]
        torch.testing.assert_close(decoded, tiles, rtol=2**-4, atol=scales.max().item() * 2**-9)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("fmt,buf_dtype", [("fp8_e4m3", torch.uint8), ("fp8_ds_mla", torch.uint8)])
def test_padding_skip_extra_rows_wider_rows(device, backend, fmt, buf_dtype):
    width = (DsMla.BYTES if fmt == "fp8_ds_mla" else 576) + 40
    buf, k_nope, k_rope = _case(fmt, buf_dtype, torch.bfloat16, 300, device, extra=17, width=width)
    loc = slots(buf.shape[0], 300, torch.int64, device)
    loc[::7] = -1
    loc[5] = 0
    got = _check(buf, loc, k_nope, k_rope, backend, kv_cache_dtype=fmt, scale=_scale(fmt, device, True), skip_slot=0)
    assert_bitwise(got[0], buf[0])
    assert_bitwise(got[:, width - 40 :], buf[:, width - 40 :])


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("fmt", ["fp8_e5m2", "fp8_ds_mla"])
@pytest.mark.parametrize("offset", [0, 1])
def test_strided_and_unaligned_views(device, backend, fmt, offset):
    """Sources are column slices of a fused tensor, the destination a column slice of a wider buffer;
    offset 1 makes both only 2- and 1-byte aligned (CUDA's generic kernel)."""
    n = 129
    fused = values((n, 2 * 576 + 16), torch.float16).to(device)
    k_nope, k_rope = fused[:, 8 + offset : 520 + offset], fused[:, 600 + offset : 664 + offset]
    width = DsMla.BYTES if fmt == "fp8_ds_mla" else 576
    buf = rand((2048, 3 * width), torch.uint8, device)[:, offset : offset + width]
    _check(
        buf,
        slots(2048, n, torch.int32, device),
        k_nope,
        k_rope,
        backend,
        kv_cache_dtype=fmt,
        scale=_scale(fmt, device, False),
    )


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_large_batch(device, backend, fmt):
    buf, k_nope, k_rope = _case(fmt, torch.uint8, torch.bfloat16, 16384, device, num_slots=32768)
    _check(
        buf,
        slots(32768, 16384, torch.int64, device),
        k_nope,
        k_rope,
        backend,
        kv_cache_dtype=fmt,
        scale=_scale(fmt, device, True),
    )


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_out_of_range_raises_before_writing_cpu(backend, fmt):
    buf, k_nope, k_rope = _case(fmt, torch.uint8, torch.bfloat16, 9, "cpu", num_slots=64)
    before = buf.clone()
    loc = slots(64, 9)
    loc[4] = 64
    with pytest.raises(IndexError, match=r"loc: position 4 has slot 64"):
        jitkv.set_mla_kv_buffer(
            buf, loc, k_nope, k_rope, kv_cache_dtype=fmt, scale=_scale(fmt, "cpu", False), backend=backend
        )
    assert_bitwise(buf, before)


def _bad_args(device, fmt="fp8_e4m3"):
    width = DsMla.BYTES if fmt == "fp8_ds_mla" else 576
    return dict(
        kv_buffer=rand((64, width), torch.uint8, device),
        loc=slots(64, 8, torch.int64, device),
        cache_k_nope=values((8, 512), torch.bfloat16).to(device),
        cache_k_rope=values((8, 64), torch.bfloat16).to(device),
        kv_cache_dtype=fmt,
        scale=None if fmt == "fp8_ds_mla" else 0.5,
    )


def _set(a, **kw):
    a.update(kw)


BAD = [  # (id, format, mutation, exception, argument named)
    ("unknown format", "fp8_e4m3", lambda a: _set(a, kv_cache_dtype="fp8_e3m4"), ValueError, "kv_cache_dtype"),
    (
        "format not a string",
        "fp8_e4m3",
        lambda a: _set(a, kv_cache_dtype=torch.float8_e4m3fn),
        ValueError,
        "kv_cache_dtype",
    ),
    ("scale missing", "fp8_e4m3", lambda a: _set(a, scale=None), ValueError, "scale"),
    ("scale 0", "fp8_e5m2", lambda a: _set(a, scale=0.0), ValueError, "scale"),
    ("scale negative", "fp8_e4m3", lambda a: _set(a, scale=-2.0), ValueError, "scale"),
    ("scale nan", "fp8_e4m3", lambda a: _set(a, scale=math.nan), ValueError, "scale"),
    ("scale inf", "fp8_e4m3", lambda a: _set(a, scale=math.inf), ValueError, "scale"),
    ("scale underflows float32", "fp8_e4m3", lambda a: _set(a, scale=1e-50), ValueError, "scale"),
    (
        "scale 2 elements",
        "fp8_e4m3",
        lambda a: _set(a, scale=torch.ones(2, device=a["loc"].device)),
        ValueError,
        "scale",
    ),
    (
        "scale float64",
        "fp8_e4m3",
        lambda a: _set(a, scale=torch.ones(1, dtype=torch.float64, device=a["loc"].device)),
        TypeError,
        "scale",
    ),
    ("scale string", "fp8_e4m3", lambda a: _set(a, scale="0.5"), TypeError, "scale"),
    ("cpu scale tensor 0", "fp8_e4m3", lambda a: _set(a, scale=torch.zeros(1)), ValueError, "scale"),
    ("scale for ds_mla", "fp8_ds_mla", lambda a: _set(a, scale=0.5), ValueError, "scale"),
    (
        "scale tensor for ds_mla",
        "fp8_ds_mla",
        lambda a: _set(a, scale=torch.ones(1, device=a["loc"].device)),
        ValueError,
        "scale",
    ),
    (
        "fp32 sources",
        "fp8_e4m3",
        lambda a: _set(a, cache_k_nope=a["cache_k_nope"].float(), cache_k_rope=a["cache_k_rope"].float()),
        TypeError,
        "cache_k_nope",
    ),
    (
        "fp32 sources ds_mla",
        "fp8_ds_mla",
        lambda a: _set(a, cache_k_nope=a["cache_k_nope"].float(), cache_k_rope=a["cache_k_rope"].float()),
        TypeError,
        "cache_k_nope",
    ),
    (
        "rope dtype differs",
        "fp8_e4m3",
        lambda a: _set(a, cache_k_rope=a["cache_k_rope"].half()),
        TypeError,
        "cache_k_rope",
    ),
    (
        "buffer bf16",
        "fp8_e4m3",
        lambda a: _set(a, kv_buffer=rand((64, 576), torch.bfloat16, a["loc"].device)),
        ValueError,
        "kv_buffer",
    ),
    (
        "buffer e5m2 for e4m3",
        "fp8_e4m3",
        lambda a: _set(a, kv_buffer=a["kv_buffer"].view(torch.float8_e5m2)),
        ValueError,
        "kv_buffer",
    ),
    (
        "buffer float8 for ds_mla",
        "fp8_ds_mla",
        lambda a: _set(a, kv_buffer=a["kv_buffer"].view(torch.float8_e4m3fn)),
        ValueError,
        "kv_buffer",
    ),
    ("buffer too narrow", "fp8_e4m3", lambda a: _set(a, kv_buffer=a["kv_buffer"][:, :575]), ValueError, "kv_buffer"),
    (
        "buffer too narrow ds_mla",
        "fp8_ds_mla",
        lambda a: _set(a, kv_buffer=a["kv_buffer"][:, :655]),
        ValueError,
        "kv_buffer",
    ),
    (
        "ds_mla nope 256",
        "fp8_ds_mla",
        lambda a: _set(a, cache_k_nope=a["cache_k_nope"][:, :256]),
        ValueError,
        "cache_k_nope",
    ),
    (
        "ds_mla rope 32",
        "fp8_ds_mla",
        lambda a: _set(a, cache_k_rope=a["cache_k_rope"][:, :32]),
        ValueError,
        "cache_k_rope",
    ),
    (
        "rope too few rows",
        "fp8_e4m3",
        lambda a: _set(a, cache_k_rope=a["cache_k_rope"][:4]),
        ValueError,
        "cache_k_rope",
    ),
    ("loc float", "fp8_ds_mla", lambda a: _set(a, loc=a["loc"].float()), TypeError, "loc"),
    ("nope not a tensor", "fp8_e4m3", lambda a: _set(a, cache_k_nope=3), TypeError, "cache_k_nope"),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(device, backend, case):
    _, fmt, mutate, exc, name = case
    args = _bad_args(device, fmt)
    mutate(args)
    before = args["kv_buffer"].clone() if isinstance(args["kv_buffer"], torch.Tensor) else None
    with pytest.raises(exc, match=rf"set_mla_kv_buffer: {name}\b"):
        jitkv.set_mla_kv_buffer(
            *list(args.values())[:4], kv_cache_dtype=args["kv_cache_dtype"], scale=args["scale"], backend=backend
        )
    assert_bitwise(args["kv_buffer"], before)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("name", ["kv_buffer", "loc", "cache_k_nope", "cache_k_rope", "scale"])
def test_meta_tensor_named(device, backend, name):
    args = _bad_args(device)
    args["scale"] = torch.tensor([0.5], device=device)
    before = args["kv_buffer"].clone()
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"set_mla_kv_buffer: {name}: expected a .*, got one on meta$"):
        jitkv.set_mla_kv_buffer(
            *list(args.values())[:4], kv_cache_dtype="fp8_e4m3", scale=args["scale"], backend=backend
        )
    if name != "kv_buffer":
        assert_bitwise(args["kv_buffer"], before)


def test_torch_compile_fullgraph():
    device = "cuda" if HAS_CUDA else "cpu"
    for fmt, scale in (("fp8_e4m3", 0.37), ("fp8_e5m2", torch.tensor([0.25], device=device)), ("fp8_ds_mla", None)):
        buf, k_nope, k_rope = _case(fmt, torch.uint8, torch.bfloat16, 33, device)
        loc = slots(buf.shape[0], 33, torch.int64, device)
        ref = buf.clone()
        reference.set_mla_kv_buffer_fp8(ref, loc, k_nope, k_rope, kv_cache_dtype=fmt, scale=scale)

        @torch.compile(fullgraph=True, backend="eager")
        def step(b, loc, n, r, fmt=fmt, scale=scale):
            jitkv.set_mla_kv_buffer(b, loc, n, r, kv_cache_dtype=fmt, scale=scale)

        step(buf, loc, k_nope, k_rope)
        assert_bitwise(buf, ref)


# ------------------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_out_of_range_never_written_gpu(backend, fmt, monkeypatch):
    monkeypatch.delenv("JITKV_DEBUG", raising=False)
    buf, k_nope, k_rope = _case(fmt, torch.uint8, torch.bfloat16, 64, "cuda", num_slots=128)
    loc = slots(128, 64, torch.int64, "cuda")
    loc[10] = 128
    loc[20] = 1 << 40
    kw = dict(kv_cache_dtype=fmt, scale=_scale(fmt, "cuda", True))
    got = buf.clone()
    jitkv.set_mla_kv_buffer(got, loc, k_nope, k_rope, backend=backend, **kw)
    keep = torch.ones(64, dtype=torch.bool, device="cuda")
    keep[[10, 20]] = False
    ref = buf.clone()
    reference.set_mla_kv_buffer_fp8(ref, loc[keep], k_nope[keep], k_rope[keep], **kw)
    assert_bitwise(got, ref)


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_debug_checks_cuda_scale_and_slots(backend, monkeypatch):
    """JITKV_DEBUG=1 reads a CUDA scale tensor and the slots on the host: a zero scale and an
    out-of-range slot raise before anything is written."""
    monkeypatch.setenv("JITKV_DEBUG", "1")
    jitkv.ops.reset()  # JITKV_DEBUG is read when a backend is resolved
    try:
        buf, k_nope, k_rope = _case("fp8_e4m3", torch.uint8, torch.bfloat16, 8, "cuda", num_slots=16)
        loc = slots(16, 8, torch.int64, "cuda")
        before = buf.clone()
        with pytest.raises(ValueError, match=r"set_mla_kv_buffer: scale\b"):
            jitkv.set_mla_kv_buffer(
                buf,
                loc,
                k_nope,
                k_rope,
                kv_cache_dtype="fp8_e4m3",
                scale=torch.zeros(1, device="cuda"),
                backend=backend,
            )
        loc[3] = 16
        with pytest.raises(IndexError, match=r"loc: position 3 has slot 16"):
            jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope, kv_cache_dtype="fp8_e4m3", scale=0.5, backend=backend)
        assert_bitwise(buf, before)
    finally:
        monkeypatch.undo()
        jitkv.ops.reset()


@gpu
@pytest.mark.parametrize("backend", ["jit", "triton"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("n", [1, 64, 4096])
def test_cuda_graph_replay_with_new_inputs(backend, fmt, n):
    """Slots, sources and the scale tensor's value change between replays."""
    buf, k_nope, k_rope = _case(fmt, torch.uint8, torch.bfloat16, n, "cuda", num_slots=8192)
    loc = slots(8192, n, torch.int32, "cuda")
    scale = _scale(fmt, "cuda", True)
    kw = dict(kv_cache_dtype=fmt, scale=scale, backend=backend)
    jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope, **kw)  # build/compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope, **kw)
    for step in range(3):
        loc.copy_(slots(8192, n, torch.int32, "cuda"))
        fresh = values((n, 576), torch.bfloat16).cuda()
        k_nope.copy_(fresh[:, :512])
        k_rope.copy_(fresh[:, 512:])
        if scale is not None:
            scale.fill_(0.1 + step)
        ref = buf.clone()
        reference.set_mla_kv_buffer_fp8(ref, loc, k_nope, k_rope, kv_cache_dtype=fmt, scale=scale)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(buf, ref)


@gpu
@pytest.mark.parametrize("fmt,buf_dtype", FORMATS)
@pytest.mark.parametrize("src", SRC_DTYPES)
def test_every_backend_same_bytes(fmt, buf_dtype, src):
    buf, k_nope, k_rope = _case(fmt, buf_dtype, src, 777, "cuda", specials=True)
    loc = slots(buf.shape[0], 777, torch.int64, "cuda")
    outs = []
    for backend in BACKENDS["cuda"]:
        out = buf.clone()
        jitkv.set_mla_kv_buffer(
            out, loc, k_nope, k_rope, kv_cache_dtype=fmt, scale=_scale(fmt, "cuda", True), backend=backend
        )
        outs.append(out)
    for out in outs[1:]:
        assert_bitwise(out, outs[0])


def _fp8_module(fmt, src, kernel, pdl=True):
    from jitkv.codes import KV_FORMATS as CODES
    from jitkv.jit import cuda_arch, get_function
    from jitkv.ops.mla import FP8_ENTRY, cuda_spec

    spec = cuda_spec(
        cuda_arch(torch.device("cuda")),
        1024,
        128,
        kernel=kernel,
        pdl=pdl,
        kv_format=int(CODES[fmt]),
        src_dtype=1 if src == torch.bfloat16 else 2,
    )
    return get_function(spec, FP8_ENTRY)


# (kernel, pdl, fmt) of the forced-kernel matrix: the lanes kernel writes e4m3 / e5m2 rows only
# (test_forced_lanes_kernel_refuses_what_it_cannot_write).
KERNEL_PDL_FORMATS = [
    (kernel, pdl, fmt)
    for kernel, pdl in (
        ("auto", True),
        ("auto", False),
        ("split", True),
        ("row", True),
        ("lanes", True),
        ("generic", True),
    )
    for fmt in ("fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")
    if (kernel, fmt) != ("lanes", "fp8_ds_mla")
]


@gpu
@pytest.mark.parametrize("kernel,pdl,fmt", KERNEL_PDL_FORMATS)
@pytest.mark.parametrize("src", SRC_DTYPES)
@pytest.mark.parametrize("n", [1, 5, 133, 3000])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("skip", [17, -1])
def test_every_cuda_kernel_keeps_the_contract(kernel, pdl, fmt, src, n, idx_dtype, skip):
    """Each CUDA fp8 kernel, forced by its module's build arguments, writes exactly the reference's rows:
    padding (-1), skip_slot and out-of-range slots are never written, extra source rows never read
    into the buffer, strided sources, special values; PDL on and off. skip_slot 17 (a slot of the
    buffer) runs the fast kernel with its 64-bit parameter block, -1 with the compact one."""
    from jitkv.codes import KV_FORMATS as CODES

    fn = _fp8_module(fmt, src, kernel, pdl)
    num_slots = 4096
    width = DsMla.BYTES if fmt == "fp8_ds_mla" else 576
    buf = rand((num_slots, width + 16), torch.uint8, "cuda")
    src_rows = with_specials(values((n + 3, 1200), src)).cuda()  # strided views, extra rows
    k_nope, k_rope = src_rows[:, 8:520], src_rows[:, 600:664]
    loc = slots(num_slots, n, idx_dtype, "cuda")
    loc[::7] = -1
    if skip >= 0:
        loc[3::11] = skip  # rows that write no slot (unique slots otherwise: no two rows race)
    loc[5::13] = num_slots + 5
    keep = (loc >= 0) & (loc < num_slots) & (loc != skip)
    scale = _scale(fmt, "cuda", n % 2 == 0)
    ref, got = buf.clone(), buf.clone()
    reference.set_mla_kv_buffer_fp8(ref, loc[keep], k_nope[:n][keep], k_rope[:n][keep], kv_cache_dtype=fmt, scale=scale)
    tensor_scale, value = (scale, -1.0) if isinstance(scale, torch.Tensor) else (None, -1.0 if scale is None else scale)
    fn(got, loc, k_nope, k_rope, skip, int(CODES[fmt]), tensor_scale, value)
    assert_bitwise(got, ref)


@gpu
@pytest.mark.parametrize("kernel", ["split", "row", "lanes"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("src", SRC_DTYPES)
def test_every_16_bit_value_around_the_quick_division_window(kernel, fmt, src):
    """The fast kernels divide without a branch, a scale outside the quick window first brought into it
    (jitkv/cuda/fp8.cuh Divider): torch's bytes for every bf16/fp16 value
    at scales outside, on the edges of and inside that window, as a float and as a device tensor."""
    from jitkv.codes import KV_FORMATS as CODES

    fn = _fp8_module(fmt, src, kernel)
    x = every_16_bit_value(src, 576).cuda()
    n = x.shape[0]
    buf = rand((n + 3, 576), torch.uint8, "cuda")
    loc = torch.randperm(n + 3, device="cuda")[:n]
    for i, scale in enumerate(QUICK_WINDOW_SCALES):
        ref, got = buf.clone(), buf.clone()
        reference.set_mla_kv_buffer_fp8(ref, loc, x[:, :512], x[:, 512:], kv_cache_dtype=fmt, scale=scale)
        tensor_scale = torch.tensor([scale], device="cuda") if i % 2 else None
        fn(got, loc, x[:, :512], x[:, 512:], -1, int(CODES[fmt]), tensor_scale, -1.0 if i % 2 else scale)
        assert_bitwise(got, ref)


@gpu
@pytest.mark.parametrize("kernel", ["split", "row"])
def test_forced_fast_kernel_that_cannot_run_raises(kernel):
    """A module forced to a fast fp8 kernel refuses views its 16-byte vectors do not fit, before writing."""
    fn = _fp8_module("fp8_ds_mla", torch.bfloat16, kernel)
    buf = rand((64, 700), torch.uint8, "cuda")[:, 8:664]  # rows 8-byte aligned: fp8_ds_mla needs 16
    x = values((4, 576), torch.bfloat16).cuda()
    loc = slots(64, 4, torch.int64, "cuda")
    before = buf.clone()
    with pytest.raises(ValueError, match="16-byte aligned"):
        fn(buf, loc, x[:, :512], x[:, 512:], -1, 3, None, -1.0)
    assert_bitwise(buf, before)


@gpu
def test_forced_lanes_kernel_refuses_what_it_cannot_write():
    """A module forced to the lanes kernel refuses fp8_ds_mla records and sources that are not 16-byte
    aligned, before writing."""
    x = values((5, 600), torch.bfloat16).cuda()
    loc = slots(64, 4, torch.int64, "cuda")
    record = rand((64, 656), torch.uint8, "cuda")
    before = record.clone()
    with pytest.raises(ValueError, match="lanes fp8 kernel writes e4m3 / e5m2"):
        _fp8_module("fp8_ds_mla", torch.bfloat16, "lanes")(record, loc, x[:4, :512], x[:4, 512:576], -1, 3, None, -1.0)
    assert_bitwise(record, before)
    buf = rand((64, 576), torch.uint8, "cuda").view(torch.float8_e4m3fn)
    before = buf.clone()
    with pytest.raises(ValueError, match="16-byte aligned"):  # rows start 8 bytes into 16-byte lines
        _fp8_module("fp8_e4m3", torch.bfloat16, "lanes")(buf, loc, x[:4, 4:516], x[:4, 516:580], -1, 1, None, 0.5)
    assert_bitwise(buf, before)


def test_triton_kernel_under_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 against the reference (CI has no GPU)."""
    run_under_interpreter(f"{__name__}:triton_interpreter_cases")


def triton_interpreter_cases():
    """Run by test_triton_kernel_under_interpreter in a process with TRITON_INTERPRET=1."""
    from jitkv.triton.mla import set_mla_kv_buffer_triton

    for fmt, src, cdt, width in (
        ("fp8_e4m3", torch.bfloat16, torch.float8_e4m3fn, 600),
        ("fp8_e5m2", torch.float16, torch.uint8, 576),
        ("fp8_ds_mla", torch.bfloat16, torch.uint8, 660),
        ("fp8_ds_mla", torch.float16, torch.uint8, 656),
    ):
        buf = rand((300, width), cdt)
        x = with_specials(values((40, 700), src))
        k_nope, k_rope = x[:, 16:528], x[:, 600:664]  # strided views, extra rows
        loc = slots(300, 37, torch.int64)
        loc[::5] = -1
        loc[3] = 7
        loc[4] = 300  # out of range: never written
        scale = None if fmt == "fp8_ds_mla" else torch.tensor([0.37])
        got, ref = buf.clone(), buf.clone()
        set_mla_kv_buffer_triton(got, loc, k_nope, k_rope, fmt, scale, 7)
        keep = torch.ones(37, dtype=torch.bool)
        keep[4] = False
        reference.set_mla_kv_buffer_fp8(
            ref, loc[keep], k_nope[:37][keep], k_rope[:37][keep], kv_cache_dtype=fmt, scale=scale, skip_slot=7
        )
        assert_bitwise(got, ref)
