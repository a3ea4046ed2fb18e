"""CUDA-graph capture with the torch backend (forced here; also what an op falls back to): every op
captures, replays with new slots and sources, and writes what an eager call writes, over whole
destinations. JITKV_DEBUG=1 host checks refuse a capture before any CUDA work, and the process can
capture again afterwards (its CUDA RNG included). GPU only."""

from __future__ import annotations

import pytest
import torch

import jitkv
from jitkv import DSV4_K_CACHE, INDEXER_K_CACHE
from jitkv.tests.conftest import assert_bitwise, gpu, rand, slots

pytestmark = gpu
N, SLOTS = 96, 1024


def _slot_values(num_slots, n, dtype=torch.int64):
    """Unique slots with padding (-1), the skip slot 3, and two slots past the cache (skipped on CUDA)."""
    s = slots(num_slots, n, dtype)
    s[::5] = -1
    s[1] = 3
    s[2], s[7] = num_slots, 2**31 - 1
    return s.cuda()


def _mla():
    dst = [rand((SLOTS, 600), torch.bfloat16, "cuda")]
    src = [rand((N + 4, 512), torch.bfloat16, "cuda"), rand((N + 4, 64), torch.bfloat16, "cuda")]
    idx = [_slot_values(SLOTS, N, torch.int32)]

    def call(d, backend):
        jitkv.set_mla_kv_buffer(d[0], idx[0], src[0], src[1], skip_slot=3, backend=backend)

    def renew():
        idx[0].copy_(_slot_values(SLOTS, N, torch.int32))
        src[0].copy_(rand(src[0].shape, torch.bfloat16, "cuda"))

    return dst, call, renew


def _store_cache(kv_cache_dtype):
    fp8 = kv_cache_dtype != "auto"
    cdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    dst = [
        rand((SLOTS // 16, 8, 16, 64), cdt, "cuda").permute(0, 2, 1, 3),
        rand((SLOTS, 8, 64), cdt, "cuda"),
    ]  # HND, flat
    k, v = rand((N, 8, 64), torch.bfloat16, "cuda") * 50, rand((N, 8 * 64), torch.bfloat16, "cuda")
    idx = [_slot_values(SLOTS, N)]
    loc_map = torch.randperm(SLOTS, device="cuda")
    scales = dict(k_scale=torch.tensor([0.37], device="cuda"), v_scale=0.5) if fp8 else {}

    def call(d, backend):
        jitkv.store_cache(
            k,
            v,
            d[0],
            d[1],
            idx[0],
            kv_cache_dtype=kv_cache_dtype,
            loc_map=loc_map,
            skip_slot=3,
            backend=backend,
            **scales,
        )

    def renew():
        idx[0].copy_(_slot_values(SLOTS, N))
        k.copy_(rand(k.shape, torch.bfloat16, "cuda") * 50)
        loc_map.copy_(torch.randperm(SLOTS, device="cuda"))
        if fp8:
            scales["k_scale"].fill_(2.5)

    return dst, call, renew


def _dsv4_write():
    dst = [DSV4_K_CACHE.allocate(SLOTS // 64, 64, "cuda").random_(0, 256)]
    k = rand((N, 512), torch.bfloat16, "cuda")
    idx = [_slot_values(SLOTS, N)]

    def call(d, backend):
        jitkv.quantize_and_insert_k_cache(k, d[0], idx[0], block_size=64, backend=backend)

    def renew():
        idx[0].copy_(_slot_values(SLOTS, N))
        k.copy_(rand(k.shape, torch.bfloat16, "cuda"))

    return dst, call, renew


def _dsv4_gather():
    cache = DSV4_K_CACHE.allocate(16, 64, "cuda").random_(0, 256)
    dst = [rand((3, 200, 512), torch.bfloat16, "cuda")]

    def lens():
        seq = torch.randint(0, 300, (3,), dtype=torch.int32)
        return seq.cuda(), torch.minimum(seq, torch.randint(0, 200, (3,), dtype=torch.int32)).cuda()

    seq, gl = lens()
    table = torch.randint(-1, 17, (3, 5), dtype=torch.int32, device="cuda")  # -1 and 16: zero rows

    def call(d, backend):
        jitkv.dequantize_and_gather_k_cache(d[0], cache, seq, gl, table, 64, 4, backend=backend)

    def renew():
        for t, new in zip((seq, gl), lens()):
            t.copy_(new)
        table.copy_(torch.randint(-1, 17, (3, 5), dtype=torch.int32, device="cuda"))

    return dst, call, renew


def _indexer_write():
    dst = [INDEXER_K_CACHE.allocate(SLOTS // 64, 64, "cuda").random_(0, 256)]
    k = rand((N, 128), torch.bfloat16, "cuda")
    idx = [_slot_values(SLOTS, N)]

    def call(d, backend):
        jitkv.indexer_k_quant_and_cache(k, d[0], idx[0], block_size=64, scale_fmt="ue8m0", backend=backend)

    def renew():
        idx[0].copy_(_slot_values(SLOTS, N))
        k.copy_(rand(k.shape, torch.bfloat16, "cuda"))

    return dst, call, renew


def _indexer_gather():
    cache = INDEXER_K_CACHE.allocate(16, 64, "cuda").random_(0, 256)
    dst = [rand((400, 128), torch.uint8, "cuda"), rand((400, 4), torch.uint8, "cuda")]

    def cu_seq_lens():
        return torch.randint(0, 200, (4,), dtype=torch.int32).sort().values.cuda()  # 3 requests

    cu = cu_seq_lens()
    table = torch.randint(-1, 17, (3, 4), dtype=torch.int32, device="cuda")  # -1 and 16: zero bytes

    def call(d, backend):
        jitkv.gather_indexer_k_quant_cache(cache, d[0], d[1], table, cu, block_size=64, backend=backend)

    def renew():
        cu.copy_(cu_seq_lens())
        table.copy_(torch.randint(-1, 17, (3, 4), dtype=torch.int32, device="cuda"))

    return dst, call, renew


CASES = {
    "set_mla_kv_buffer": _mla,
    "store_cache auto": lambda: _store_cache("auto"),
    "store_cache fp8": lambda: _store_cache("fp8_e4m3"),
    "quantize_and_insert_k_cache": _dsv4_write,
    "dequantize_and_gather_k_cache": _dsv4_gather,
    "indexer_k_quant_and_cache": _indexer_write,
    "gather_indexer_k_quant_cache": _indexer_gather,
}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_replays_like_eager(case, monkeypatch):
    monkeypatch.delenv("JITKV_DEBUG", raising=False)
    dst, call, renew = CASES[case]()
    call(dst, "torch")  # resolve the backend and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(dst, "torch")
    for _ in range(3):
        renew()
        eager = [d.clone() for d in dst]
        call(eager, "torch")
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(dst, eager):
            assert_bitwise(got, want)


def _reset():
    jitkv.ops.reset()  # JITKV_DEBUG is read when a backend is resolved


@pytest.mark.parametrize("backend", ["jit", "triton", "torch"])
def test_refused_capture_leaves_the_process_able_to_capture(backend, monkeypatch):
    dst, call, renew = _mla()
    call([d.clone() for d in dst], backend)  # build / compile outside the capture
    monkeypatch.setenv("JITKV_DEBUG", "1")
    _reset()
    try:
        before = dst[0].clone()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match=r"set_mla_kv_buffer: JITKV_DEBUG=1 checks loc on the host"):
            with torch.cuda.graph(graph):
                call(dst, backend)
        torch.cuda.synchronize()
        assert_bitwise(dst[0], before)
    finally:
        monkeypatch.undo()
        _reset()
    noise = torch.empty(4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a later capture, with the CUDA RNG in it, works
        noise.uniform_()
        call(dst, backend)
    renew()
    eager = [d.clone() for d in dst]
    call(eager, backend)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(dst[0], eager[0])
    first = noise.clone()
    graph.replay()
    assert not torch.equal(noise, first)  # the captured RNG advances per replay
