"""GPU cases (docs/design.md §8): CUDA-graph replay over 8 layers of caches far larger than L2, random
unique slots; each row's bandwidth against a device-to-device copy measured in the same run."""

from __future__ import annotations

import torch

import jitkv

from .common import Row

LAYERS = 8
MLA_NS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 2048, 4096, 16384, 65536, 262144)


def graph_us(step_for_layer, *, batches=15, batch_seconds=5e-4, passes=2) -> float:
    """µs per op: capture one op per layer into a graph, replay it, time with CUDA events: the median
    of ``batches`` batches of about ``batch_seconds`` each, after 2 ms of untimed replays so that the
    clocks have left idle; the least of ``passes`` such medians, taken back to back. A median over ~8 ms
    rides out a short disturbance of a shared GPU, the second pass a longer one (single passes on one
    H100 host read 1.23-1.44 us for rows of 0.92-0.94)."""
    for layer in range(LAYERS):  # compile / build outside capture
        step_for_layer(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            step_for_layer(layer)
    replays = max(1, int(batch_seconds / _warm_replays(graph)))
    return min(_median_us(graph, replays, batches) for _ in range(passes))


def _median_us(graph, replays, batches) -> float:
    """The median over ``batches`` batches of ``replays`` replays of ``graph``, in µs per op."""
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * LAYERS))
    return sorted(times)[len(times) // 2]


def _warm_replays(graph, seconds=2e-3) -> float:
    """Replays ``graph`` for about ``seconds``; returns the seconds of one replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) * 1e-3, 1e-6)
    for _ in range(int(seconds / once) + 1):
        graph.replay()
    torch.cuda.synchronize()
    return once


def copy_gbps(nbytes=2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written: the best of 10 copies, so that every
    fraction of it is conservative (the median moved by 2-3 % between runs on one H200)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / min(times) / 1e9


def latency_floor_spec(arch: str):
    """The benchmark-only CUDA module of ``latency_floor_us``."""
    from jitkv.jit import JitSpec  # noqa: PLC0415

    return JitSpec("latency_floor_cuda", ("benchmark/latency_floor_cuda.cu",), target=arch,
                   exports=("latency_floor", "latency_floor_e4m3", "latency_floor_ds_mla"))


def latency_floor_us(bufs, kernel="latency_floor", args=(), repeats=3) -> float:
    """The fastest KV write the contract allows, under the same graph replay: one thread, PDL wait ->
    slot and 16-byte source loads together -> trigger dependents -> store
    (csrc/benchmark/latency_floor_cuda.cu), into ``bufs[layer]`` (one [rows, >= 16 bytes] cache per
    layer); ``kernel`` and ``args`` (after dst, loc, src) pick one of that file's fp8 floors instead.
    The least of ``repeats`` timings (new slots each): a disturbed one would lower every row's "x
    floor" (single timings of it ranged 0.84-0.95 us over runs on one H100)."""
    fn = jitkv.jit.get_function(latency_floor_spec(jitkv.jit.cuda_arch(torch.device("cuda"))), kernel)
    srcs = [torch.randn(1, 576, device="cuda").bfloat16() for _ in range(LAYERS)]
    times = []
    for _ in range(repeats):
        locs = [torch.randint(0, b.shape[0], (1,), device="cuda") for b in bufs]
        times.append(graph_us(lambda i: fn(bufs[i], locs[i], srcs[i], *args)))
    return min(times)


def empty_kernel_us() -> float:
    """An empty Triton kernel under the same graph replay (triton imported here: the rest of this
    module, e.g. ``latency_floor_spec`` for the compile-only test, needs none)."""
    import triton  # noqa: PLC0415

    @triton.jit
    def empty(x):
        pass

    x = torch.empty(1, device="cuda")
    return graph_us(lambda layer: empty[(1,)](x))


def _timed_rows(op, case, n, moved, cases, bw, floor_us, *, eager=()) -> list[Row]:
    """One row per (name, step) case, or (name, step, bytes) for a case that moves other bytes than
    ``moved`` (a reference write of another format); the first case is the torch baseline. Names in
    ``eager`` are timed per call with events instead of graph replay (they sync on the host).
    ``x_floor``: µs over the latency floor's of the same run."""
    from jitkv.ops._dispatch import BackendUnavailable  # noqa: PLC0415

    rows, base = [], None
    for name, step, *case_moved in cases:
        try:
            us = eager_us(step) if name in eager else graph_us(step)
        except (BackendUnavailable, RuntimeError, ValueError) as e:
            print(f"  skipped {name} at n={n}: {str(e)[:200]}")
            continue
        base = us if base is None else base
        label = name + (" (eager)" if name in eager else "")
        rows.append(Row(op, case, n, label, us, case_moved[0] if case_moved else moved, base, bw,
                        {"x_floor": round(us / floor_us, 2)}))
    return rows


def eager_us(step_for_layer, reps=5) -> float:
    step_for_layer(0)
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for layer in range(LAYERS):
            step_for_layer(layer)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return sorted(times)[len(times) // 2]


CEILING = "contiguous copy_ of the same bytes"
CEILING_MIN_BYTES = 32 << 20  # smaller copies would time the eager launches, not the copy


def with_ceiling(cases, moved: int):
    """cases plus, for large ops, an eager device-to-device ``copy_`` of moved / 2 bytes per layer
    (fresh buffers per layer): the practical ceiling for an op that moves ``moved`` bytes (r + w)."""
    if moved < CEILING_MIN_BYTES:
        return cases
    src = [torch.empty(moved // 2, dtype=torch.uint8, device="cuda").random_() for _ in range(LAYERS)]
    dst = [torch.empty_like(t) for t in src]
    return cases + [(CEILING, lambda i: dst[i].copy_(src[i]))]


def floor_rows(bw: float, empty_us: float) -> tuple[float, list[Row]]:
    """The latency floor (µs) and its rows, measured into 8 layers of 2^19-row caches, with the fp8
    floors beside it (their "x floor" is over the copy's: what a conversion adds at the least)."""
    bufs = [torch.empty(1 << 19, 576, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    floor_us = latency_floor_us(bufs)
    rows = [
        Row("empty kernel", "triton, graph", 0, "—", empty_us, 0, None, bw, {"x_floor": round(empty_us / floor_us, 2)}),
        Row("latency floor", "PDL wait -> slot + 16 B loads -> trigger -> store, 1 thread", 1, "jit", floor_us, 32,
            None, bw, {"x_floor": 1.0}),
    ]
    del bufs
    # The fp8 floors: the least an fp8 write of one row must do at n = 1, dividing exactly as the
    # contract does, and by x * rcp.approx(scale) (less than any exact writer).
    scale = torch.tensor([0.37], device="cuda")
    for label, width, kernel, args in (
            ("fp8 e4m3, exact division", 576, "latency_floor_e4m3", (scale, True)),
            ("fp8 e4m3, x * rcp.approx(scale)", 576, "latency_floor_e4m3", (scale, False)),
            ("fp8_ds_mla 2 tiles, exact division", 656, "latency_floor_ds_mla", (512, True)),
            ("fp8_ds_mla 2 tiles, x * rcp.approx(scale)", 656, "latency_floor_ds_mla", (512, False))):
        bufs = [torch.empty(1 << 19, width, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
        us = latency_floor_us(bufs, kernel, args)
        rows.append(Row("latency floor", label, 1, "jit", us, 0, None, bw, {"x_floor": round(us / floor_us, 2)}))
        del bufs
    return floor_us, rows


def mla_rows(bw: float, floor_us: float, ns=MLA_NS) -> list[Row]:
    from jitkv.ops import mla  # noqa: PLC0415

    rows_per_layer = 1 << 19  # 8 layers x 2^19 slots x 1152 B = 4.8 GB of caches
    bufs = [torch.empty(rows_per_layer, 576, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(LAYERS)]
    arch = jitkv.jit.cuda_arch(torch.device("cuda"))
    kernel = {k: jitkv.jit.get_function(mla.cuda_spec(arch, 1024, 128, kernel=k), "set_mla_kv_buffer")
              for k in ("latency", "vector", "tma")}
    rows = []
    for n in ns:
        # Fresh sources per layer (read from DRAM), and one shared source (L2-warm, as when the
        # previous kernel of the layer has just produced it).
        nope = [torch.randn(n, 512, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        rope = [torch.randn(n, 64, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        # The last slot is never written, so that passing it as skip_slot changes no byte: the kernel
        # then takes its 64-bit parameter block (MlaArgs) instead of the compact one.
        locs = [torch.randperm(rows_per_layer - 1, device="cuda")[:n] for _ in range(LAYERS)]
        skip = rows_per_layer - 1

        def torch_index(i):
            bufs[i][locs[i], :512] = nope[i]
            bufs[i][locs[i], 512:] = rope[i]

        cases = [
            ("torch index", torch_index),
            ("jitkv auto", lambda i: jitkv.set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i])),
            ("jit latency", lambda i: kernel["latency"](bufs[i], locs[i], nope[i], rope[i], -1)),
            ("jit latency, 80-byte block", lambda i: kernel["latency"](bufs[i], locs[i], nope[i], rope[i], skip)),
            ("jit vector (bulk)", lambda i: kernel["vector"](bufs[i], locs[i], nope[i], rope[i], -1)),
            ("jit TMA", lambda i: kernel["tma"](bufs[i], locs[i], nope[i], rope[i], -1)),
            ("triton", lambda i: jitkv.set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i], backend="triton")),
            ("jitkv auto, L2-warm source", lambda i: jitkv.set_mla_kv_buffer(bufs[i], locs[i], nope[0], rope[0])),
            ("triton, L2-warm source", lambda i: jitkv.set_mla_kv_buffer(bufs[i], locs[i], nope[0], rope[0], backend="triton")),
        ]
        rows += _timed_rows("set_mla_kv_buffer", "512+64 bf16", n, 2 * n * 1152, with_ceiling(cases, 2 * n * 1152),
                            bw, floor_us, eager=(CEILING,))
        del nope, rope, locs
    return rows


FP8_CEILING_N = 16384  # where the fp8 rows also get graph-timed contiguous copies (below CEILING_MIN_BYTES)


def mla_fp8_rows(bw: float, floor_us: float, ns=MLA_NS) -> list[Row]:
    """bf16 512+64 rows quantized to e4m3 (a device scale) and to the 656-byte fp8_ds_mla record. The
    first row of each n is the bf16 copy at the same n, so "vs torch" reads bf16 µs / fp8 µs; at
    FP8_CEILING_N also contiguous copies of the same bytes: uint8 (read = write = half the bytes) and,
    for e4m3, the bf16 -> e4m3 conversion copy_ (read 1152 B, write 576 B per row), both under graph
    replay like the rows."""
    from jitkv.ops import mla  # noqa: PLC0415

    rows_per_layer = 1 << 19
    copy_bufs = [torch.empty(rows_per_layer, 576, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(LAYERS)]
    arch = jitkv.jit.cuda_arch(torch.device("cuda"))
    scale = torch.tensor([0.37], device="cuda")
    rows = []
    for fmt, width, buf_dtype in (("fp8_e4m3", 576, torch.float8_e4m3fn), ("fp8_ds_mla", 656, torch.uint8)):
        bufs = [torch.empty(rows_per_layer, width, dtype=torch.uint8, device="cuda").random_(0, 256).view(buf_dtype)
                for _ in range(LAYERS)]
        code, fmt_scale = mla.FORMATS[fmt], None if fmt == "fp8_ds_mla" else scale
        kinds = ("split", "row", "generic") if fmt == "fp8_ds_mla" else ("lanes", "split", "row", "generic")
        kernel = {k: jitkv.jit.get_function(mla.cuda_spec(arch, 1024, 128, kernel=k, kv_format=code, src_dtype=1),
                                            mla.FP8_ENTRY) for k in kinds}
        for n in ns:
            nope = [torch.randn(n, 512, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
            rope = [torch.randn(n, 64, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
            locs = [torch.randperm(rows_per_layer, device="cuda")[:n] for _ in range(LAYERS)]
            moved = n * (1152 + width)
            kw = dict(kv_cache_dtype=fmt, scale=fmt_scale)
            cases = [
                ("bf16 copy (jitkv auto)", lambda i: jitkv.set_mla_kv_buffer(copy_bufs[i], locs[i], nope[i], rope[i]),
                 n * 2 * 1152),
                ("jitkv auto", lambda i: jitkv.set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i], **kw)),
            ] + [(f"jit {k}", lambda i, k=k: kernel[k](bufs[i], locs[i], nope[i], rope[i], -1, code, fmt_scale, -1.0))
                 for k in kernel] + [
                ("triton", lambda i: jitkv.set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i], backend="triton", **kw)),
            ]
            if n == FP8_CEILING_N:
                cases += _fp8_ceilings(n, moved, fmt)
            rows += _timed_rows("set_mla_kv_buffer", f"512+64 bf16 -> {fmt}", n, moved,
                                with_ceiling(cases, moved), bw, floor_us, eager=(CEILING,))
            del nope, rope, locs
        del bufs
    return rows


def _fp8_ceilings(n: int, moved: int, fmt: str) -> list:
    """Graph-timed contiguous copies moving the bytes of n fp8 rows (fresh buffers per layer)."""
    src = [torch.empty(moved // 2, dtype=torch.uint8, device="cuda").random_() for _ in range(LAYERS)]
    dst = [torch.empty_like(t) for t in src]
    cases = [(CEILING + " (graph)", lambda i: dst[i].copy_(src[i]))]
    if fmt == "fp8_e4m3":
        bf16 = [torch.randn(n, 576, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        e4m3 = [torch.empty(n, 576, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(LAYERS)]
        cases.append(("contiguous bf16 -> e4m3 copy_ (graph)", lambda i: e4m3[i].copy_(bf16[i])))
    return cases


STORE_NS = (1, 2, 4, 16, 64, 256, 1024, 4096, 16384, 131072)


def store_cache_rows(bw: float, floor_us: float, ns=STORE_NS) -> list[Row]:
    """H=8, D=128 K and V rows into flat caches: bf16 copies, then bf16 -> e4m3 with one scale per side or
    one per head (vLLM's per-head quantization, its own kernels). The fp8 sweeps time the bf16 copy of
    the same rows in the same case list ("bf16 copy (jitkv auto)", with its own bytes), the reference
    their ratio is taken against."""
    slots_per_layer = 1 << 18  # K and V caches of 8 heads x 128 bf16: 1 GB per layer, 8 GB (+ 4 GB fp8)

    def caches(dtype):
        return [torch.empty(slots_per_layer, 8, 128, device="cuda").normal_().to(dtype) for _ in range(2 * LAYERS)]

    bf16_caches = caches(torch.bfloat16)
    rows = []
    for label, cache_dtype, kv_dtype, scales in (("bf16", torch.bfloat16, "auto", 0),
                                                 ("bf16->fp8 e4m3", torch.float8_e4m3fn, "fp8_e4m3", 1),
                                                 ("bf16->fp8 e4m3 per-head", torch.float8_e4m3fn, "fp8_e4m3", 8)):
        both = bf16_caches if kv_dtype == "auto" else caches(cache_dtype)
        kcs, vcs = both[:LAYERS], both[LAYERS:]
        kw = {} if kv_dtype == "auto" else dict(kv_cache_dtype=kv_dtype,
                                                k_scale=torch.linspace(0.5, 1.5, scales, device="cuda"),
                                                v_scale=torch.linspace(0.25, 2.0, scales, device="cuda"))
        for n in ns:
            ks = [torch.randn(n, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
            vs = [torch.randn(n, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
            sms = [torch.randperm(slots_per_layer, device="cuda")[:n] for _ in range(LAYERS)]
            moved = 2 * n * 1024 * (2 + kcs[0].element_size())

            def torch_index(i):
                if kv_dtype == "auto":
                    kcs[i][sms[i]] = ks[i]
                    vcs[i][sms[i]] = vs[i]
                else:
                    kcs[i][sms[i]] = (ks[i].float() / kw["k_scale"].view(-1, 1)).clamp(-448, 448).to(cache_dtype)
                    vcs[i][sms[i]] = (vs[i].float() / kw["v_scale"].view(-1, 1)).clamp(-448, 448).to(cache_dtype)

            cases = [("torch index", torch_index)]
            if kv_dtype != "auto":
                cases.append(("bf16 copy (jitkv auto)", lambda i: jitkv.store_cache(
                    ks[i], vs[i], bf16_caches[i], bf16_caches[LAYERS + i], sms[i]), 2 * n * 1024 * 4))
            cases += [
                (name, lambda i, b=b: jitkv.store_cache(ks[i], vs[i], kcs[i], vcs[i], sms[i], backend=b, **kw))
                for name, b in (("jitkv auto", None), ("triton", "triton"))
            ]
            rows += _timed_rows("store_cache", f"H8 D128 K+V {label}", n, moved, with_ceiling(cases, moved), bw,
                                floor_us, eager=(CEILING,))
            del ks, vs, sms
        del both, kcs, vcs
    return rows


def _paged_slots(n: int, block_size: int, num_blocks: int) -> torch.Tensor:
    """n slots filling whole blocks (in random block order) position by position."""
    blocks = torch.randperm(num_blocks, device="cuda")[: (n + block_size - 1) // block_size]
    return (blocks[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()[:n]


def dsv4_rows(bw: float, floor_us: float) -> list[Row]:
    from jitkv import DSV4_K_CACHE, reference  # noqa: PLC0415

    bs, blocks_per_layer = 64, 8192  # 307 MB of cache per layer
    caches = [DSV4_K_CACHE.allocate(blocks_per_layer, bs, "cuda").random_(0, 256) for _ in range(LAYERS)]
    rows = []
    for reqs, k_len in ((1, 512), (1, 2048), (1, 8192), (1, 32768), (16, 4096)):
        nblk = k_len // bs
        tables = [torch.randperm(blocks_per_layer, device="cuda")[: reqs * nblk].view(reqs, nblk).int() for _ in range(LAYERS)]
        seq = torch.full((reqs,), k_len, dtype=torch.int32, device="cuda")
        outs = [torch.empty(reqs, k_len, 512, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        moved = reqs * k_len * (584 + 1024) + reqs * nblk * 4
        cases = [("torch reference", lambda i: reference.dequantize_and_gather_k_cache(outs[i], caches[i], seq, None, tables[i], bs))] + [
            (name, lambda i, b=b: jitkv.dequantize_and_gather_k_cache(outs[i], caches[i], seq, None, tables[i], bs, backend=b))
            for name, b in (("jitkv auto", None), ("triton", "triton"))
        ]
        rows += _timed_rows("dequantize_and_gather_k_cache", f"{reqs} req x {k_len}", reqs * k_len, moved,
                            with_ceiling(cases, moved), bw, floor_us, eager=("torch reference", CEILING))
        del outs, tables
    for n in (1, 16, 128, 4096, 65536):
        ks = [torch.randn(n, 512, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        # Random unique token slots (the worst case: most 8-byte scale writes share their 32-byte
        # sector with no other write), and whole pages in random order (a prefill's paged slots).
        token_slots = [torch.randperm(blocks_per_layer * bs, device="cuda")[:n] for _ in range(LAYERS)]
        page_slots = [_paged_slots(n, bs, blocks_per_layer) for _ in range(LAYERS)]
        cases = [("torch reference", lambda i: reference.quantize_and_insert_k_cache(ks[i], caches[i], token_slots[i], block_size=bs))]
        for kind, sms in (("", token_slots), (", paged slots", page_slots)):
            cases += [(name + kind, lambda i, b=b, sms=sms: jitkv.quantize_and_insert_k_cache(ks[i], caches[i], sms[i], block_size=bs, backend=b))
                      for name, b in (("jitkv auto", None), ("triton", "triton"))]
        moved = n * (1024 + 584)
        rows += _timed_rows("quantize_and_insert_k_cache", "block_size 64", n, moved, with_ceiling(cases, moved), bw,
                            floor_us, eager=("torch reference", CEILING))
        del ks, token_slots, page_slots
    return rows


def indexer_rows(bw: float, floor_us: float) -> list[Row]:
    """DeepSeek-V3.2 indexer K cache: the writer (bf16 keys, ue8m0 scales as the model runs it, and plain
    fp32 scales) into random unique token slots, and the gather of whole requests."""
    from jitkv import INDEXER_K_CACHE, reference  # noqa: PLC0415

    bs, blocks_per_layer = 64, 16384  # 138 MB of cache per layer
    caches = [INDEXER_K_CACHE.allocate(blocks_per_layer, bs, "cuda").random_(0, 256) for _ in range(LAYERS)]
    rows = []
    for n in (1, 2, 16, 128, 1024, 4096, 65536):
        ks = [torch.randn(n, 128, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        sms = [torch.randperm(blocks_per_layer * bs, device="cuda")[:n] for _ in range(LAYERS)]

        def write(i, backend=None, fmt="ue8m0"):
            jitkv.indexer_k_quant_and_cache(ks[i], caches[i], sms[i], block_size=bs, scale_fmt=fmt, backend=backend)

        cases = [("torch reference", lambda i: reference.indexer_k_quant_and_cache(ks[i], caches[i], sms[i], block_size=bs,
                                                                                   scale_fmt="ue8m0")),
                 ("jitkv auto", write), ("triton", lambda i: write(i, "triton")),
                 ("jitkv auto, fp32 scales", lambda i: write(i, fmt=None))]
        moved = n * (2 * 128 + 132)
        rows += _timed_rows("indexer_k_quant_and_cache", "bf16, block_size 64, ue8m0", n, moved,
                            with_ceiling(cases, moved), bw, floor_us, eager=("torch reference", CEILING))
        del ks, sms
    for reqs, length in ((1, 2048), (1, 32768), (16, 4096)):
        nblk, tokens = length // bs, reqs * length
        tables = [torch.randperm(blocks_per_layer, device="cuda")[: reqs * nblk].view(reqs, nblk).int() for _ in range(LAYERS)]
        cu = (torch.arange(reqs + 1, device="cuda") * length).int()
        dst_k = [torch.empty(tokens, 128, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(LAYERS)]
        dst_scale = [torch.empty(tokens, 4, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]

        def gather(i, backend=None):
            jitkv.gather_indexer_k_quant_cache(caches[i], dst_k[i], dst_scale[i], tables[i], cu, block_size=bs,
                                               backend=backend)

        cases = [("torch reference", lambda i: reference.gather_indexer_k_quant_cache(caches[i], dst_k[i], dst_scale[i],
                                                                                      tables[i], cu, block_size=bs)),
                 ("jitkv auto", gather), ("triton", lambda i: gather(i, "triton"))]
        moved = tokens * 2 * 132 + reqs * nblk * 4
        rows += _timed_rows("gather_indexer_k_quant_cache", f"{reqs} req x {length}", tokens, moved,
                            with_ceiling(cases, moved), bw, floor_us, eager=("torch reference", CEILING))
        del tables, dst_k, dst_scale
    return rows


def mla_gather_rows(bw: float, floor_us: float) -> list[Row]:
    """gather_mla_cache, 16 requests x 4096 tokens (a chunked prefill's cached prefix) from random
    blocks of 64 tokens: 576 bf16 copied, and the fp8_ds_mla record dequantized to 576 bf16."""
    from jitkv import reference  # noqa: PLC0415
    from jitkv.layouts import DS_MLA_NOPE, DS_MLA_RECORD_BYTES, DS_MLA_ROPE, DS_MLA_ROPE_OFFSET, DS_MLA_SCALE_OFFSET  # noqa: PLC0415

    reqs, tokens, bs, blocks_per_layer = 16, 4096, 64, 2048  # 2 x the gathered tokens per layer
    nblk, dims = tokens // bs, DS_MLA_NOPE + DS_MLA_ROPE
    cu = torch.arange(0, (reqs + 1) * tokens, tokens, dtype=torch.int32, device="cuda")
    rows = []
    for label, fmt, width in ((f"{dims} bf16 -> bf16", "auto", 2 * dims),
                              (f"fp8_ds_mla -> {dims} bf16", "fp8_ds_mla", DS_MLA_RECORD_BYTES)):
        caches = [torch.empty(blocks_per_layer, bs, width, dtype=torch.uint8, device="cuda").random_(0, 256) for _ in range(LAYERS)]
        if fmt == "auto":
            caches = [c.view(torch.bfloat16) for c in caches]
        else:  # finite tile scales (random bytes would hold NaNs and infinities)
            for c in caches:
                scales = torch.rand(blocks_per_layer, bs, (DS_MLA_ROPE_OFFSET - DS_MLA_SCALE_OFFSET) // 4, device="cuda")
                c[..., DS_MLA_SCALE_OFFSET:DS_MLA_ROPE_OFFSET] = scales.view(torch.uint8)
        tables = [torch.randperm(blocks_per_layer, device="cuda")[: reqs * nblk].view(reqs, nblk).int() for _ in range(LAYERS)]
        outs = [torch.empty(reqs * tokens, dims, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        moved = reqs * tokens * (width + 2 * dims) + reqs * nblk * 4
        cases = [("torch reference", lambda i: reference.gather_mla_cache(outs[i], caches[i], tables[i], cu, kv_cache_dtype=fmt))]
        cases += [(name, lambda i, b=b: jitkv.gather_mla_cache(outs[i], caches[i], tables[i], cu, kv_cache_dtype=fmt, backend=b))
                  for name, b in (("jitkv auto", None), ("triton", "triton"))]
        rows += _timed_rows("gather_mla_cache", f"{reqs} req x {tokens}, {label}", reqs * tokens, moved,
                            with_ceiling(cases, moved), bw, floor_us, eager=("torch reference", CEILING))
        del caches, tables, outs
    return rows


def host_overhead_rows(calls=1000, rounds=25) -> list[Row]:
    """Eager host cost per call at n = 1: each op's best batch of ``calls`` back-to-back calls over
    ``rounds`` rounds that take every op in turn (a host whose speed drifts between seconds slows every
    op of a round alike), never synchronizing in between (the GPU queue never drains, so no batch
    waits on it and none pays a cold start)."""
    import time  # noqa: PLC0415

    buf = torch.empty(4096, 576, dtype=torch.bfloat16, device="cuda")
    nope, rope = torch.randn(1, 512, device="cuda").bfloat16(), torch.randn(1, 64, device="cuda").bfloat16()
    kc = torch.empty(4096, 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 8, 128, device="cuda").bfloat16()
    loc = torch.tensor([7], device="cuda")
    from jitkv.ops import mla, store_cache  # noqa: PLC0415

    arch = jitkv.jit.cuda_arch(torch.device("cuda"))
    raw = jitkv.jit.get_function(mla.cuda_spec(arch, 1024, 128), "set_mla_kv_buffer")
    raw_sc = jitkv.jit.get_function(store_cache.cuda_spec(arch, 256, 256, 0, 0), store_cache.COPY_ENTRY)
    ops = {
        "set_mla_kv_buffer": lambda: jitkv.set_mla_kv_buffer(buf, loc, nope, rope),
        "set_mla_kv_buffer (bare tvm-ffi binding)": lambda: raw(buf, loc, nope, rope, -1),
        "store_cache": lambda: jitkv.store_cache(k, k, kc, kc, loc),
        "store_cache (bare tvm-ffi binding)": lambda: raw_sc(k, k, kc, kc, loc, None, -1),
        "torch index (MLA)": lambda: buf.__setitem__((loc, slice(0, 512)), nope),
    }
    best = dict.fromkeys(ops, float("inf"))
    for fn in ops.values():
        for _ in range(200):
            fn()
    for _ in range(rounds):
        for name, fn in ops.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return [Row(name, "eager host cost per call", 1, "torch" if name.startswith("torch") else "jitkv", us * 1e6, 0)
            for name, us in best.items()]
