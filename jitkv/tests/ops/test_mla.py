"""set_mla_kv_buffer: whole-buffer bitwise equality with the torch reference on every backend."""

from __future__ import annotations

import pytest
import torch

import jitkv
from jitkv import reference
from jitkv.tests.conftest import BACKENDS, DEV_BACKENDS, HAS_CUDA, assert_bitwise, gpu, rand, slots
from jitkv.tests.triton.interpreter import run_under_interpreter

SHAPES = [
    (torch.bfloat16, 512, 64),
    (torch.float16, 512, 64),
    (torch.bfloat16, 512, 32),
    (torch.float16, 256, 64),
    (torch.bfloat16, 128, 64),
    (torch.uint8, 528, 128),
    (torch.float8_e4m3fn, 512, 64),
]


def _case(dtype, nope, rope, n, device, *, num_slots=4096, extra=0, three_d=True, width=None):
    width = width or nope + rope
    buf = rand((num_slots, 1, width) if three_d else (num_slots, width), dtype, device)
    k_nope = rand((n + extra, 1, nope) if three_d else (n + extra, nope), dtype, device)
    k_rope = rand((n + extra, 1, rope) if three_d else (n + extra, rope), dtype, device)
    return buf, k_nope, k_rope


def _check(buf, loc, k_nope, k_rope, backend, **kw):
    got, ref = buf.clone(), buf.clone()
    jitkv.set_mla_kv_buffer(got, loc, k_nope, k_rope, backend=backend, **kw)
    reference.set_mla_kv_buffer(ref, loc, k_nope, k_rope, **kw)
    assert_bitwise(got, ref)
    return got


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("dtype,nope,rope", SHAPES)
@pytest.mark.parametrize("n", [0, 1, 7, 64, 257, 1024])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_shapes(device, backend, dtype, nope, rope, n, idx_dtype):
    buf, k_nope, k_rope = _case(dtype, nope, rope, n, device, three_d=n % 2 == 1)
    _check(buf, slots(buf.shape[0], n, idx_dtype, device), k_nope, k_rope, backend)


@gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_odd_widths_take_the_cuda_kernel(kv_cache_dtype, recwarn):
    """sglang's own test widths, 13 + 8 bf16 values (no 16-byte vector divides either part), run the
    jit backend: the copy's bulk kernel and the generic fp8 kernel take any width, so nothing is left
    to a failing build and a fallback."""
    fp8 = kv_cache_dtype != "auto"
    buf = rand((64, 21), torch.uint8 if fp8 else torch.bfloat16, "cuda")
    k_nope, k_rope = rand((5, 13), torch.bfloat16, "cuda"), rand((5, 8), torch.bfloat16, "cuda")
    jitkv.ops.reset()
    kw = dict(kv_cache_dtype=kv_cache_dtype, scale=0.5) if fp8 else {}
    _check(buf, slots(64, 5, torch.int64, "cuda"), k_nope, k_rope, None, **kw)
    assert jitkv.backend_info("set_mla_kv_buffer")["cuda:0"]["backend"] == "jit"
    assert not [w for w in recwarn if issubclass(w.category, jitkv.JitkvFallbackWarning)]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_large_batch(device, backend):
    buf, k_nope, k_rope = _case(torch.bfloat16, 512, 64, 16384, device, num_slots=32768)
    _check(buf, slots(32768, 16384, torch.int64, device), k_nope, k_rope, backend)


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("dtype,nope,rope", [(torch.bfloat16, 512, 64), (torch.uint8, 528, 128)])
def test_wider_row_keeps_tail(device, backend, dtype, nope, rope):
    buf, k_nope, k_rope = _case(dtype, nope, rope, 100, device, width=nope + rope + 40, three_d=False)
    got = _check(buf, slots(buf.shape[0], 100, torch.int32, device), k_nope, k_rope, backend)
    assert_bitwise(got[:, nope + rope :], buf[:, nope + rope :])


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_padding_skip_and_extra_rows(device, backend):
    buf, k_nope, k_rope = _case(torch.bfloat16, 512, 64, 300, device, extra=17)
    loc = slots(buf.shape[0], 300, torch.int64, device)
    loc[::7] = -1
    loc[5] = 0
    got = _check(buf, loc, k_nope, k_rope, backend, skip_slot=0)
    assert_bitwise(got[0], buf[0])


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
def test_strided_sources(device, backend):
    n = 129
    fused = rand((n, 2 * 576 + 16), torch.bfloat16, device)  # nope and rope are column slices: row stride 1168
    k_nope, k_rope = fused[:, 16:528], fused[:, 600:664]
    buf = rand((2048, 3 * 576), torch.bfloat16, device)[:, :576]  # destination row stride 1728 elements
    _check(buf, slots(2048, n, torch.int32, device), k_nope, k_rope, backend)


@pytest.mark.parametrize("backend", BACKENDS["cpu"])
def test_out_of_range_raises_before_writing_cpu(backend):
    buf, k_nope, k_rope = _case(torch.bfloat16, 512, 64, 9, "cpu", num_slots=64)
    before = buf.clone()
    loc = slots(64, 9)
    loc[4] = 64
    with pytest.raises(IndexError, match=r"loc: position 4 has slot 64"):
        jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope, backend=backend)
    assert_bitwise(buf, before)


BAD = [
    ("loc float", lambda a: a.update(loc=a["loc"].float()), TypeError, "loc"),
    ("loc 2-D", lambda a: a.update(loc=a["loc"].view(2, 4)), ValueError, "loc"),
    ("nope dtype", lambda a: a.update(cache_k_nope=a["cache_k_nope"].half()), TypeError, "cache_k_nope"),
    (
        "buffer dtype int32",
        lambda a: a.update(kv_buffer=torch.zeros(64, 576, dtype=torch.int32, device=a["loc"].device)),
        TypeError,
        "kv_buffer",
    ),
    ("buffer too narrow", lambda a: a.update(kv_buffer=a["kv_buffer"][:, :500]), ValueError, "kv_buffer"),
    ("buffer rank", lambda a: a.update(kv_buffer=a["kv_buffer"].view(64, 2, 288)), ValueError, "kv_buffer"),
    ("rope too few rows", lambda a: a.update(cache_k_rope=a["cache_k_rope"][:4]), ValueError, "cache_k_rope"),
    (
        "nope noncontiguous",
        lambda a: a.update(cache_k_nope=rand((512, 8), torch.bfloat16, a["loc"].device).t()),
        ValueError,
        "cache_k_nope",
    ),
    ("kv_buffer not tensor", lambda a: a.update(kv_buffer=3), TypeError, "kv_buffer"),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(device, backend, case):
    _, mutate, exc, name = case
    args = dict(
        kv_buffer=rand((64, 576), torch.bfloat16, device),
        loc=slots(64, 8, torch.int64, device),
        cache_k_nope=rand((8, 512), torch.bfloat16, device),
        cache_k_rope=rand((8, 64), torch.bfloat16, device),
    )
    mutate(args)
    with pytest.raises(exc, match=rf"set_mla_kv_buffer: {name}\b"):
        jitkv.set_mla_kv_buffer(*args.values(), backend=backend)


# ------------------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_out_of_range_never_written_gpu(backend, monkeypatch):
    monkeypatch.delenv("JITKV_DEBUG", raising=False)
    buf, k_nope, k_rope = _case(torch.bfloat16, 512, 64, 64, "cuda", num_slots=128)
    loc = slots(128, 64, torch.int64, "cuda")
    loc[10] = 128
    loc[20] = 1 << 40
    got = buf.clone()
    jitkv.set_mla_kv_buffer(got, loc, k_nope, k_rope, backend=backend)
    ref = buf.clone()
    keep = torch.ones(64, dtype=torch.bool, device="cuda")
    keep[[10, 20]] = False
    reference.set_mla_kv_buffer(ref, loc[keep], k_nope[keep], k_rope[keep])
    assert_bitwise(got, ref)


@gpu
def test_out_of_range_debug_raises(monkeypatch):
    monkeypatch.setenv("JITKV_DEBUG", "1")
    jitkv.ops.reset()  # JITKV_DEBUG is read when a backend is resolved
    buf, k_nope, k_rope = _case(torch.bfloat16, 512, 64, 8, "cuda", num_slots=16)
    loc = slots(16, 8, torch.int64, "cuda")
    loc[3] = 16
    before = buf.clone()
    try:
        with pytest.raises(IndexError, match=r"loc: position 3 has slot 16"):
            jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope, backend="jit")
    finally:
        monkeypatch.undo()
        jitkv.ops.reset()
    assert_bitwise(buf, before)


@gpu
@pytest.mark.parametrize("backend", BACKENDS["cuda"])
def test_side_stream(backend):
    buf, k_nope, k_rope = _case(torch.bfloat16, 512, 64, 4096, "cuda", num_slots=8192)
    loc = slots(8192, 4096, torch.int64, "cuda")
    ref = buf.clone()
    reference.set_mla_kv_buffer(ref, loc, k_nope, k_rope)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    assert_bitwise(buf, ref)


@gpu
@pytest.mark.parametrize("backend", ["jit", "triton"])
@pytest.mark.parametrize("n", [1, 64, 4096])
def test_cuda_graph_replay_with_new_inputs(backend, n):
    buf, k_nope, k_rope = _case(torch.bfloat16, 512, 64, n, "cuda", num_slots=8192)
    loc = slots(8192, n, torch.int32, "cuda")
    jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope, backend=backend)  # build/compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope, backend=backend)
    for _ in range(3):
        loc.copy_(slots(8192, n, torch.int32, "cuda"))
        k_nope.copy_(rand(k_nope.shape, torch.bfloat16, "cuda"))
        k_rope.copy_(rand(k_rope.shape, torch.bfloat16, "cuda"))
        ref = buf.clone()
        reference.set_mla_kv_buffer(ref, loc, k_nope, k_rope)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(buf, ref)


@gpu
@pytest.mark.parametrize("dtype,nope,rope", SHAPES)
def test_every_backend_same_bytes(dtype, nope, rope):
    buf, k_nope, k_rope = _case(dtype, nope, rope, 777, "cuda")
    loc = slots(buf.shape[0], 777, torch.int64, "cuda")
    outs = []
    for backend in BACKENDS["cuda"]:
        out = buf.clone()
        jitkv.set_mla_kv_buffer(out, loc, k_nope, k_rope, backend=backend)
        outs.append(out)
    for out in outs[1:]:
        assert_bitwise(out, outs[0])


@gpu
def test_build_while_capturing_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("JITKV_CACHE_DIR", str(tmp_path))
    from jitkv.jit import cache_dir, get_module
    from jitkv.jit.toolchain import cuda_arch
    from jitkv.ops.mla import cuda_spec

    spec = cuda_spec(cuda_arch(torch.device("cuda")), 1000, 48)  # a layout nobody built
    assert cache_dir() is not None
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(1, device="cuda")
    with pytest.raises(RuntimeError, match="warmup"):
        with torch.cuda.graph(graph):
            x += 1
            get_module(spec)


def test_torch_compile_fullgraph():
    if HAS_CUDA:
        device = "cuda"
    else:
        device = "cpu"
    buf, k_nope, k_rope = _case(torch.bfloat16, 512, 64, 33, device, three_d=False)
    loc = slots(buf.shape[0], 33, torch.int64, device)
    ref = buf.clone()
    reference.set_mla_kv_buffer(ref, loc, k_nope, k_rope)

    @torch.compile(fullgraph=True, backend="eager")
    def step(b, loc, n, r):
        jitkv.set_mla_kv_buffer(b, loc, n, r)

    step(buf, loc, k_nope, k_rope)
    assert_bitwise(buf, ref)


@gpu
@pytest.mark.parametrize(
    "kernel, pdl", [("auto", True), ("auto", False), ("tma", True), ("vector", True), ("latency", True)]
)
@pytest.mark.parametrize("n", [1, 5, 133, 3000])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("skip", [17, -1])
def test_every_cuda_kernel_keeps_the_contract(kernel, pdl, n, idx_dtype, skip):
    """Each CUDA kernel, forced by its module's build arguments, writes exactly the reference's rows:
    padding (-1), skip_slot and out-of-range slots are never written, extra source rows never read
    into the buffer, strided sources; PDL on and off. skip_slot 17 (a slot of the buffer) runs the
    latency kernel with its 64-bit parameter block, -1 with the compact one."""
    from jitkv.jit import cuda_arch, get_function
    from jitkv.ops.mla import cuda_spec

    spec = cuda_spec(cuda_arch(torch.device("cuda")), 1024, 128, kernel=kernel, pdl=pdl)
    fn = get_function(spec, "set_mla_kv_buffer")
    num_slots = 4096
    buf = rand((num_slots, 576), torch.bfloat16, "cuda")
    src = rand((n + 3, 1200), torch.bfloat16, "cuda")  # strided views, extra rows
    k_nope, k_rope = src[:, 8:520], src[:, 600:664]
    loc = slots(num_slots, n, idx_dtype, "cuda")
    loc[::7] = -1
    if skip >= 0:
        loc[3::11] = skip  # rows that write no slot (unique slots otherwise: no two rows race)
    loc[5::13] = num_slots + 5
    keep = (loc >= 0) & (loc < num_slots) & (loc != skip)
    ref, got = buf.clone(), buf.clone()
    reference.set_mla_kv_buffer(ref, loc[keep], k_nope[:n][keep], k_rope[:n][keep])
    fn(got, loc, k_nope, k_rope, skip)
    assert_bitwise(got, ref)


@gpu
@pytest.mark.parametrize("n", [1, 40])
def test_latency_kernel_beyond_its_compact_block(n):
    """Source rows 1 MiB + 16 bytes apart do not fit the latency kernel's compact parameter block (16-bit
    strides in 16-byte units): it takes the 64-bit one and writes the same bytes."""
    buf, _, _ = _case(torch.bfloat16, 512, 64, n, "cuda", three_d=False)
    wide = rand((n, (1 << 19) + 8), torch.bfloat16, "cuda")
    _check(buf, slots(buf.shape[0], n, torch.int64, "cuda"), wide[:, :512], wide[:, 1024:1088], "jit")


@gpu
def test_forced_kernel_that_cannot_run_raises():
    """A module forced to the TMA or latency kernel refuses a destination it cannot write (rows not
    16-byte aligned) with a ValueError naming the reason, before writing anything."""
    from jitkv.jit import cuda_arch, get_function
    from jitkv.ops.mla import cuda_spec

    buf = rand((64, 577), torch.bfloat16, "cuda")[:, 1:]  # 2-byte aligned rows
    k_nope, k_rope = rand((4, 512), torch.bfloat16, "cuda"), rand((4, 64), torch.bfloat16, "cuda")
    loc = slots(64, 4, torch.int64, "cuda")
    before = buf.clone()
    for kernel, why in (("tma", "not 16-byte aligned"), ("latency", "16-byte aligned rows")):
        fn = get_function(cuda_spec(cuda_arch(torch.device("cuda")), 1024, 128, kernel=kernel), "set_mla_kv_buffer")
        with pytest.raises(ValueError, match=why):
            fn(buf, loc, k_nope, k_rope, -1)
    assert_bitwise(buf, before)


def test_triton_kernel_under_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 against the reference (CI has no GPU)."""
    run_under_interpreter(f"{__name__}:triton_interpreter_cases")


def triton_interpreter_cases():
    """Run by test_triton_kernel_under_interpreter in a process with TRITON_INTERPRET=1."""
    from jitkv.triton.mla import set_mla_kv_buffer_triton

    for dtype, nope, rope, width in (
        (torch.bfloat16, 512, 64, 600),
        (torch.uint8, 528, 128, 656),
        (torch.float8_e4m3fn, 512, 64, 576),
    ):
        buf = rand((300, width), dtype)
        k_nope, k_rope = rand((40, nope), dtype), rand((40, rope), dtype)
        loc = slots(300, 37, torch.int32)
        loc[::5] = -1
        loc[3] = 7
        loc[4] = 300  # out of range: never written
        got, ref = buf.clone(), buf.clone()
        set_mla_kv_buffer_triton(got, loc, k_nope, k_rope, "auto", None, 7)
        keep = torch.ones(37, dtype=torch.bool)
        keep[4] = False
        reference.set_mla_kv_buffer(ref, loc[keep], k_nope[:37][keep], k_rope[:37][keep], skip_slot=7)
        assert_bitwise(got, ref)
