"""python -m jitkv.benchmark [--device cpu|cuda] [--op NAME] [--json FILE] [--plot FILE.png]

A saved report plots anywhere: python -m jitkv.benchmark.plot REPORT.json OUT.png
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from .common import print_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jitkv.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present, else cpu")
    p.add_argument("--op", choices=["store_cache", "set_mla_kv_buffer", "dsv4", "indexer", "gather_mla_cache", "build"],
                   action="append", default=None)
    p.add_argument("--json", metavar="FILE", help="write every row and the machine description here")
    p.add_argument("--plot", metavar="FILE.png", help="plot GB/s and µs against n per op (needs matplotlib)")
    args = p.parse_args(argv)
    if args.plot:
        _require_matplotlib(p)  # before minutes of benchmarking, not after
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ops = set(args.op or ["store_cache", "set_mla_kv_buffer", "dsv4", "indexer", "gather_mla_cache", "build"])
    report = {"device": _describe(device), "torch": torch.__version__, "rows": [], "build": {}}
    rows = _cpu(ops, report) if device == "cpu" else _gpu(ops, report)
    report["rows"] = [r.as_dict() for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        return _plot(report, args.plot)
    return 0


def _require_matplotlib(parser) -> None:
    from . import plot  # noqa: PLC0415

    try:
        plot.require_matplotlib()
    except ImportError as e:
        parser.error(str(e))


def _plot(report, path) -> int:
    from . import plot  # noqa: PLC0415

    try:
        plot.save(report, path)
    except ValueError as e:
        print(f"no plot: {e}", file=sys.stderr)
        return 1
    print(f"\nplot: {path}")
    return 0


def _describe(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{_cpu_model()}, {torch.get_num_threads()} threads"


def _cpu_model() -> str:
    """The CPU's marketing name where Linux gives one (platform.processor() is empty there)."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def _cpu(ops, report):
    from . import cpu  # noqa: PLC0415

    print(f"# jitkv CPU benchmark ({_describe('cpu')}, torch {torch.__version__})")
    rows = []
    if ops & {"store_cache", "set_mla_kv_buffer"}:
        report["copy_gbps"] = cpu.copy_gbps()
        print(f"memory copy: {report['copy_gbps']:.1f} GB/s (read + write, a copy_ far larger than the LLC)")
    if "store_cache" in ops:
        part = cpu.store_cache_rows() + cpu.store_cache_fp8_rows()
        print_table("store_cache", part)
        big = cpu.large_cache_rows()
        print_table("store_cache, cache far larger than the LLC (fraction of copy_ bandwidth)", big)
        rows += part + big
    if "set_mla_kv_buffer" in ops:
        part = cpu.mla_rows() + cpu.mla_fp8_rows()
        print_table("set_mla_kv_buffer", part)
        rows += part
    if "indexer" in ops:
        part = cpu.indexer_rows()
        print_table("DeepSeek-V3.2 indexer K cache", part)
        rows += part
    if "gather_mla_cache" in ops:
        part = cpu.mla_gather_rows()
        print_table("gather_mla_cache", part)
        rows += part
    if "build" in ops:
        report["build"] = cpu.build_timings()
        _print_build(report["build"])
    return rows


def _gpu(ops, report):
    from . import gpu  # noqa: PLC0415

    bw = gpu.copy_gbps()
    floor, rows = gpu.floor_rows(bw, gpu.empty_kernel_us())
    report["copy_gbps"], report["floor_us"] = bw, floor
    print(f"# jitkv GPU benchmark ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print(f"device-to-device copy: {bw:.0f} GB/s (read + write); latency floor under graph replay: {floor:.2f} µs")
    print_table("floor (CUDA graph, 8 layers)", rows)
    graph = "(CUDA graph, 8 layers, caches >> L2)"
    sections = (  # (op selecting it or None for always, title, rows)
        ("set_mla_kv_buffer", f"set_mla_kv_buffer {graph}", lambda: gpu.mla_rows(bw, floor)),
        ("set_mla_kv_buffer", f"set_mla_kv_buffer fp8 {graph}; vs torch: the bf16 copy's µs / the row's",
         lambda: gpu.mla_fp8_rows(bw, floor)),
        ("store_cache", f"store_cache {graph}", lambda: gpu.store_cache_rows(bw, floor)),
        (None, "host cost per eager call (n = 1)", gpu.host_overhead_rows),
        ("dsv4", f"DeepSeek-V4 FP8 K cache {graph}", lambda: gpu.dsv4_rows(bw, floor)),
        ("indexer", f"DeepSeek-V3.2 indexer K cache {graph}", lambda: gpu.indexer_rows(bw, floor)),
        ("gather_mla_cache", f"gather_mla_cache {graph}", lambda: gpu.mla_gather_rows(bw, floor)),
    )
    for op, title, run in sections:
        if op is None or op in ops:
            part = run()
            print_table(title, part)
            rows += part
    if "build" in ops:
        from .warm_start import warm_start  # noqa: PLC0415

        report["build"] = warm_start("cuda")
        _print_build(report["build"])
    return rows


def _print_build(build: dict) -> None:
    print("\n## build")
    for k, v in build.items():
        print(f"- {k}: {v}")


if __name__ == "__main__":
    raise SystemExit(main())
