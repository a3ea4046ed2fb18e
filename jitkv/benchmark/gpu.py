"""GPU cases (docs/design.md §8): CUDA-graph replay over 8 layers of caches far larger than L2, random
unique slots; each row's bandwidth against a device-to-device copy measured in the same run."""

from __future__ import annotations

import time

import torch

import jitkv

from .common import Row

LAYERS = 8


def graph_us(step_for_layer, *, batches=15, batch_seconds=5e-4, passes=2) -> float:
    """µs per op: capture one op per layer into a graph, replay it, time with CUDA events: the median
    of ``batches`` batches of about ``batch_seconds`` each, after 2 ms of untimed replays so that the
    clocks have left idle; the least of ``passes`` such medians, taken back to back. A median over ~8 ms
    rides out a short disturbance of a shared GPU, the second pass a longer one (docs/performance.md,
    ``graph_us``)."""
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
    fraction of it is conservative (docs/performance.md, ``copy_gbps``)."""
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
    from jitkv.jit import JitSpec

    return JitSpec(
        "latency_floor_cuda",
        ("benchmark/latency_floor_cuda.cu",),
        target=arch,
        exports=(
            "latency_floor",
            "latency_floor_e4m3",
            "latency_floor_ds_mla",
            "latency_floor_rope",
            "latency_floor_rope_rows",
        ),
    )


def latency_floor_us(bufs, kernel="latency_floor", args=(), repeats=3) -> float:
    """The fastest KV write the contract allows, under the same graph replay: one thread, PDL wait ->
    slot and 16-byte source loads together -> trigger dependents -> store
    (csrc/benchmark/latency_floor_cuda.cu), into ``bufs[layer]`` (one [rows, >= 16 bytes] cache per
    layer); ``kernel`` and ``args`` (after dst, loc, src) pick one of that file's fp8 floors instead.
    The least of ``repeats`` timings (new slots each): a disturbed one would lower every row's "x
    floor" (docs/performance.md, ``latency_floor_us``)."""
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
    import triton

    @triton.jit
    def empty(x):
        pass

    x = torch.empty(1, device="cuda")
    return graph_us(lambda layer: empty[(1,)](x))


def _timed_rows(op, case, n, moved, cases, bw, floor_us, *, eager=()) -> list[Row]:
    """One row per (name, step) case, or (name, step, bytes) for a case that moves other bytes than
    ``moved`` (a reference write of another format); the first case is the torch baseline. Names in
    ``eager`` are timed per call with events instead of graph replay (they sync on the host), all of
    them in alternation (eager_us). ``x_floor``: µs over the latency floor's of the same run."""
    timed = eager_us({name: step for name, step, *_ in cases if name in eager})
    rows, base = [], None
    for name, step, *case_moved in cases:
        if name in eager and name not in timed:
            continue  # eager_us has said why
        try:
            us = timed[name] if name in eager else graph_us(step)
        except (RuntimeError, ValueError) as e:  # BackendUnavailable is a RuntimeError
            print(f"  skipped {name} at n={n}: {str(e)[:200]}")
            continue
        base = us if base is None else base
        label = name + (" (eager)" if name in eager else "")
        rows.append(
            Row(
                op,
                case,
                n,
                label,
                us,
                case_moved[0] if case_moved else moved,
                base,
                bw,
                {"x_floor": round(us / floor_us, 2)},
            )
        )
    return rows


EAGER_ROUNDS = 11  # rounds of each eager case, alternated
EAGER_ROUND_S = 2e-3  # a round's calls: about this long, 1 to 10 x LAYERS of them


def eager_us(steps: dict) -> dict:
    """µs per call of each step(layer) called back to back, between two events: EAGER_ROUNDS rounds in
    which the steps take turns, the median of each step's rounds. Eager timings follow the host's speed
    of the minute, which moves them more than the steps differ (a 64-page transfer: up to 1.5x between
    minutes on one H200 host), so every step is timed in the same minutes; one event pair per round
    of calls, so a host-bound step's row is its host cost per call. A step that raises on its first
    call is left out (its name missing from the result), with the reason printed."""
    calls = {}
    for name, step in steps.items():
        try:
            calls[name] = max(1, min(10 * LAYERS, int(EAGER_ROUND_S / _one_call_s(step))))
        except (RuntimeError, ValueError) as e:  # BackendUnavailable is a RuntimeError
            print(f"  skipped {name}: {str(e)[:200]}")
    times = {name: [] for name in calls}
    for _ in range(EAGER_ROUNDS):
        for name, count in calls.items():
            step = steps[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(count):
                step(i % LAYERS)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / count)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _one_call_s(step) -> float:
    """Seconds of one call of step(0) after a first (warming) one, on the host's clock, synced."""
    step(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(0)
    torch.cuda.synchronize()
    return max(time.perf_counter() - t0, 1e-6)


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


ROPE_FLOOR = "rope: PDL wait -> position + slot + 16 B -> trigger -> cos/sin -> rotate -> store, 1 thread"


def floor_rows(bw: float, empty_us: float) -> tuple[dict, list[Row]]:
    """The latency floors (µs: "copy", and "rope" for the fused prologue) and their rows, measured into 8
    layers of 2^19-row caches, with the fp8 floors beside the copy's (their "x floor" is over the copy's:
    what a conversion, or RoPE's dependent cos/sin load, adds at the least)."""
    bufs = [torch.empty(1 << 19, 576, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    floor_us = latency_floor_us(bufs)
    rows = [
        Row("empty kernel", "triton, graph", 0, "—", empty_us, 0, None, bw, {"x_floor": round(empty_us / floor_us, 2)}),
        Row(
            "latency floor",
            "PDL wait -> slot + 16 B loads -> trigger -> store, 1 thread",
            1,
            "jit",
            floor_us,
            32,
            None,
            bw,
            {"x_floor": 1.0},
        ),
    ]
    del bufs
    # The fp8 floors: the least an fp8 write of one row must do at n = 1, dividing exactly as the
    # contract does, and by x * rcp.approx(scale) (less than any exact writer).
    scale = torch.tensor([0.37], device="cuda")
    for label, width, kernel, args in (
        ("fp8 e4m3, exact division", 576, "latency_floor_e4m3", (scale, True)),
        ("fp8 e4m3, x * rcp.approx(scale)", 576, "latency_floor_e4m3", (scale, False)),
        ("fp8_ds_mla 2 tiles, exact division", 656, "latency_floor_ds_mla", (512, True)),
        ("fp8_ds_mla 2 tiles, x * rcp.approx(scale)", 656, "latency_floor_ds_mla", (512, False)),
    ):
        bufs = [torch.empty(1 << 19, width, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
        us = latency_floor_us(bufs, kernel, args)
        rows.append(Row("latency floor", label, 1, "jit", us, 0, None, bw, {"x_floor": round(us / floor_us, 2)}))
        del bufs
    bufs = [torch.empty(1 << 19, 576, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    positions = torch.randint(0, 4096, (1,), device="cuda")
    cos_sin = torch.randn(4096, 128, device="cuda")
    rope_us = latency_floor_us(bufs, "latency_floor_rope", (positions, cos_sin))
    rows.append(
        Row("latency floor", ROPE_FLOOR, 1, "jit", rope_us, 0, None, bw, {"x_floor": round(rope_us / floor_us, 2)})
    )
    return {"copy": floor_us, "rope": rope_us}, rows


class Harness:
    """What a family's GPU cases (``Op.bench_gpu``) use: the layer count, ``sizes``, and ``rows``, which
    times a case list under graph replay against the copy bandwidth and latency floor of this run."""

    layers = LAYERS

    def __init__(self, bw: float, floors: dict, *, quick: bool = False):
        self.bw, self.floors, self.quick = bw, floors, quick

    def sizes(self, ns):
        """``ns``, or its first size in a quick run (``--quick``: a smoke run)."""
        return ns[:1] if self.quick else ns

    def rows(self, op, case, n, moved, cases, *, eager=(), floor="copy", ceiling=True) -> list[Row]:
        """One row per (name, step_for_layer[, bytes]) of ``cases``, the first the baseline ("vs
        torch"); for large ops also the device copy of the same bytes (``with_ceiling``; not for a
        transfer over the link, whose ceiling is its own first case). Names in ``eager`` are timed per
        call with events (they sync on the host). ``floor``: the latency floor "x floor" is over
        ("copy", or "rope" for the fused prologue)."""
        cases = with_ceiling(cases, moved) if ceiling else cases
        return _timed_rows(op, case, n, moved, cases, self.bw, self.floors[floor], eager=(*eager, CEILING))

    def contiguous_copies(self, moved: int, e4m3_rows: int = 0) -> list:
        """Graph-timed contiguous copies moving ``moved`` bytes (fresh buffers per layer), and with
        ``e4m3_rows`` the bf16 -> e4m3 conversion copy_ of that many 576-value rows."""
        src = [torch.empty(moved // 2, dtype=torch.uint8, device="cuda").random_() for _ in range(LAYERS)]
        dst = [torch.empty_like(t) for t in src]
        cases = [(CEILING + " (graph)", lambda i: dst[i].copy_(src[i]))]
        if e4m3_rows:
            bf16 = [torch.randn(e4m3_rows, 576, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
            e4m3 = [torch.empty(e4m3_rows, 576, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(LAYERS)]
            cases.append(("contiguous bf16 -> e4m3 copy_ (graph)", lambda i: e4m3[i].copy_(bf16[i])))
        return cases


def rope_rows_floor(layers_args: list) -> list:
    """The fused prologue's floor at n tokens (csrc/benchmark/latency_floor_cuda.cu
    ``latency_floor_rope_rows``) beside a rope_store_cache case, one call per layer on that layer's
    slot_mapping, positions, cos/sin table and caches (viewed as byte rows): its q, k and v bytes read
    from a fresh source row per token, q's stored contiguous at q_out's width, k's and v's at their slots
    at the caches' width, every q and k store behind its cos/sin load. It does less than the op, so where
    latency bounds both (small n) its row is what the op's row cannot beat (docs/performance.md "rope's
    floor at n tokens"); at large n its one 16-byte piece per thread is not the fastest way to move the
    bytes, and the contiguous copy is the bound."""
    fn = jitkv.jit.get_function(
        latency_floor_spec(jitkv.jit.cuda_arch(torch.device("cuda"))), "latency_floor_rope_rows"
    )
    calls = []
    for a in layers_args:
        q, k = a["q"], a["k"]
        n, q_bytes, kv_bytes = q.shape[0], q[0].numel() * q.element_size(), k[0].numel() * k.element_size()
        src = torch.empty(n, q_bytes + 2 * kv_bytes, dtype=torch.uint8, device="cuda").random_()
        q_dst = torch.empty(
            n, q_bytes * a["q_out"].element_size() // q.element_size(), dtype=torch.uint8, device="cuda"
        )
        caches = [c.view(torch.uint8).view(c.shape[0], -1) for c in (a["k_cache"], a["v_cache"])]
        calls.append((q_dst, *caches, a["slot_mapping"], src, a["positions"], a["cos_sin_cache"], q_bytes, 128))
    return [("fused-prologue floor at this n (latency_floor_rope_rows)", lambda i: fn(*calls[i]))]


def host_overhead_rows(ops, calls=1000, rounds=25) -> list[Row]:
    """Eager host cost per call of each op's sample call: the public function, and its resolved runner
    called directly (no public function, no dispatch: the argument encoding and the binding), each
    op's best batch of ``calls`` back-to-back calls over ``rounds`` rounds that take every op in turn
    (a host whose speed drifts between seconds slows every op of a round alike), never synchronizing
    in between (the GPU queue never drains, so no batch waits on it and none pays a cold start)."""
    import time

    device = torch.device("cuda", torch.cuda.current_device())
    calls_of = {}
    for op in ops:
        kw = op.sample(device, torch.Generator().manual_seed(0))
        args = op.args_of(kw)
        op.fn(**kw)  # resolves the backend
        key = op.variant(*args) if op.variant else ()
        runner = op.runner(device, None, key)
        calls_of[op.name] = lambda op=op, kw=kw: op.fn(**kw)
        calls_of[f"{op.name} (runner)"] = lambda runner=runner, args=args: runner(*args)
    best = dict.fromkeys(calls_of, float("inf"))
    for fn in calls_of.values():
        for _ in range(200):
            fn()
    for _ in range(rounds):
        for name, fn in calls_of.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return [Row(name, "eager host cost per call (sample call)", 0, "jitkv", us * 1e6, 0) for name, us in best.items()]
