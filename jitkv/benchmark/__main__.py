"""python -m jitkv.benchmark [--device cpu|cuda] [--op NAME] [--json FILE] [--plot FILE.png]

A saved report plots anywhere: python -m jitkv.benchmark.plot REPORT.json OUT.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from .common import print_table


def _choices() -> dict[str, set[str]]:
    """``--op`` names: each op and each family (its module), mapped to the families they select."""
    from jitkv.ops import OPS

    choices = {}
    for op in OPS.values():
        if op.bench_cpu or op.bench_gpu:
            choices.setdefault(op.name, set()).add(op.family)
            choices.setdefault(op.family, set()).add(op.family)
    return choices


def main(argv=None) -> int:
    choices = _choices()
    p = argparse.ArgumentParser(
        prog="python -m jitkv.benchmark", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present, else cpu")
    p.add_argument(
        "--op",
        choices=[*sorted(choices), "build"],
        action="append",
        default=None,
        help="an op or a family (its module under jitkv/ops); repeatable; default: all, and build",
    )
    p.add_argument("--quick", action="store_true", help="the smallest case of each sweep, short timings (a smoke run)")
    p.add_argument("--json", metavar="FILE", help="write every row and the machine description here")
    p.add_argument("--plot", metavar="FILE.png", help="plot GB/s and µs against n per op (needs matplotlib)")
    args = p.parse_args(argv)
    if args.plot:
        _require_matplotlib(p)  # before minutes of benchmarking, not after
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    picked = args.op or [*choices, "build"]
    families = set().union(*(choices[name] for name in picked if name != "build"))
    report = {"device": _describe(device), "torch": torch.__version__, "rows": [], "build": {}}
    rows = (_cpu if device == "cpu" else _gpu)(families, report, args.quick)
    if "build" in picked:
        report["build"] = _build(device)
        _print_build(report["build"])
    report["rows"] = [r.as_dict() for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        return _plot(report, args.plot)
    return 0


def _sections(families, kind):
    """(title, op, its bench function) of every selected family's cases, in declaration order."""
    from jitkv.ops import OPS

    for op in OPS.values():
        bench = getattr(op, f"bench_{kind}")
        if bench is not None and op.family in families:
            yield op.family, bench


def _require_matplotlib(parser) -> None:
    from . import plot

    try:
        plot.require_matplotlib()
    except ImportError as e:
        parser.error(str(e))


def _plot(report, path) -> int:
    from . import plot

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
    return f"{_cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def _cpu_model() -> str:
    """The CPU's marketing name where Linux gives one (platform.processor() is empty there)."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def _cpu(families, report, quick=False):
    from jitkv.jit.toolchain import cpu_isa, host_cache_bytes

    from . import cpu

    report["isa"] = cpu_isa()
    # The caches the kernels' streaming rule reads (jitkv/cpu/caches.h): whether a case's caches pass them.
    report["cache_bytes"] = {f"L{level}": host_cache_bytes(level) for level in (2, 3)}
    caches = ", ".join(f"{k} {_mib(v)}" for k, v in report["cache_bytes"].items() if v) or "caches unknown"
    print(
        f"# jitkv CPU benchmark ({_describe('cpu')}, kernel path {report['isa']}, {caches}, torch {torch.__version__})"
    )
    rows = []
    if families:
        report["copy_gbps"] = cpu.copy_gbps(8 << 20) if quick else cpu.copy_gbps()
        print(f"memory copy: {report['copy_gbps']:.1f} GB/s (read + write, a copy_ far larger than the LLC)")
    harness = cpu.Harness(report.get("copy_gbps"), quick=quick)
    for family, bench in _sections(families, "cpu"):
        part = bench(harness)
        print_table(family, part)
        rows += part
    return rows


def _gpu(families, report, quick=False):
    from jitkv.ops import OPS

    from . import gpu

    bw = gpu.copy_gbps()
    floors, rows = gpu.floor_rows(bw, gpu.empty_kernel_us())
    floor = floors["copy"]
    report["copy_gbps"], report["floor_us"], report["rope_floor_us"] = bw, floor, floors["rope"]
    print(f"# jitkv GPU benchmark ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print(f"device-to-device copy: {bw:.0f} GB/s (read + write); latency floor under graph replay: {floor:.2f} µs")
    print_table("floor (CUDA graph, 8 layers)", rows)
    harness = gpu.Harness(bw, floors, quick=quick)
    for family, bench in _sections(families, "gpu"):
        part = bench(harness)
        print_table(f"{family} (CUDA graph, 8 layers, caches >> L2)", part)
        rows += part
    part = gpu.host_overhead_rows([op for op in OPS.values() if op.family in families])
    print_table("host cost per eager call (sample call)", part)
    return rows + part


def _build(device: str) -> dict:
    if device == "cpu":
        from .cpu import build_timings

        return build_timings()
    from .warm_start import warm_start

    return warm_start("cuda")


def _print_build(build: dict) -> None:
    print("\n## build")
    for k, v in build.items():
        print(f"- {k}: {v}")


if __name__ == "__main__":
    raise SystemExit(main())
