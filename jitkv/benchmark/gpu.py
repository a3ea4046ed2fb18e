"""GPU cases (DESIGN §8): CUDA-graph replay over 8 layers of caches far larger than L2, random
unique slots; each row's bandwidth against a device-to-device copy measured in the same run."""

from __future__ import annotations

import torch

import jitkv

from .common import Row

LAYERS = 8
MLA_NS = (1, 8, 32, 128, 512, 768, 2048, 4096, 16384, 65536, 262144)


def graph_us(step_for_layer, *, replays=20) -> float:
    """µs per op: capture one op per layer into a graph, replay it, time with CUDA events."""
    for layer in range(LAYERS):  # compile / build outside capture
        step_for_layer(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            step_for_layer(layer)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * LAYERS))
    return sorted(times)[len(times) // 2]


def copy_gbps(nbytes=2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written."""
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
    return 2 * nbytes / sorted(times)[len(times) // 2] / 1e9


def empty_kernel_us() -> float:
    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415

    @triton.jit
    def _empty(x, BLOCK: tl.constexpr):
        pass

    x = torch.empty(1, device="cuda")
    return graph_us(lambda layer: _empty[(1,)](x, BLOCK=1))


def mla_rows(bw: float, empty_us: float, ns=MLA_NS) -> list[Row]:
    from jitkv.ops import mla  # noqa: PLC0415
    from jitkv.ops._common import jit_function  # noqa: PLC0415
    from jitkv.ops._dispatch import BackendUnavailable  # noqa: PLC0415

    rows_per_layer = (2 << 20) // LAYERS  # 2 Mi slots x 1152 B = 2.4 GB of caches
    bufs = [torch.empty(rows_per_layer, 576, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(LAYERS)]
    spec = mla.cuda_spec(jitkv.jit.toolchain.cuda_arch(torch.device("cuda")), 1024, 128)
    fn, _ = jit_function(spec, "set_mla_kv_buffer")
    rows = [Row("empty kernel", "triton, graph", 0, "—", empty_us, 0, None, bw)]
    for n in ns:
        nope = [torch.randn(n, 512, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        rope = [torch.randn(n, 64, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        locs = [torch.randperm(rows_per_layer, device="cuda")[:n] for _ in range(LAYERS)]
        moved = 2 * n * 1152

        def torch_index(i):
            bufs[i][locs[i], :512] = nope[i]
            bufs[i][locs[i], 512:] = rope[i]

        base = graph_us(torch_index)
        cases = [("torch index", torch_index)]
        cases.append(("jitkv auto", lambda i: jitkv.set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i])))
        cases.append(("jit TMA", lambda i: fn(bufs[i], locs[i], nope[i], rope[i], -1, 1)))
        cases.append(("jit vector", lambda i: fn(bufs[i], locs[i], nope[i], rope[i], -1, 2)))
        cases.append(("triton", lambda i: jitkv.set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i], backend="triton")))
        for name, step in cases:
            try:
                us = base if name == "torch index" else graph_us(step)
            except (BackendUnavailable, RuntimeError, ValueError) as e:
                print(f"  skipped {name} at n={n}: {e}")
                continue
            rows.append(Row("set_mla_kv_buffer", "512+64 bf16, 8 layers", n, name, us, moved, base, bw,
                            {"x_empty": round(us / empty_us, 2)}))
        del nope, rope, locs
    return rows
