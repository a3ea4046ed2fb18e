"""python -m jitkv.benchmark [--device cpu|cuda] [--op NAME] [--json FILE] [--quick]"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from .common import print_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jitkv.benchmark", description=__doc__)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present, else cpu")
    p.add_argument("--op", choices=["store_cache", "set_mla_kv_buffer", "dsv4", "build"], action="append", default=None)
    p.add_argument("--json", metavar="FILE", help="write every row and the machine description here")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ops = set(args.op or ["store_cache", "set_mla_kv_buffer", "dsv4", "build"])
    report = {"device": _describe(device), "torch": torch.__version__, "rows": [], "build": {}}
    rows = _cpu(ops, report) if device == "cpu" else _gpu(ops)
    report["rows"] = [r.as_dict() for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _describe(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def _cpu(ops, report):
    from . import cpu  # noqa: PLC0415

    print(f"# jitkv CPU benchmark ({_describe('cpu')}, torch {torch.__version__})")
    rows = []
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
    if "build" in ops:
        report["build"] = cpu.build_timings()
        print("\n## build")
        for k, v in report["build"].items():
            print(f"- {k}: {v}")
    return rows


def _gpu(ops):
    from . import gpu  # noqa: PLC0415

    bw = gpu.copy_gbps()
    floor, rows = gpu.floor_rows(bw, gpu.empty_kernel_us())
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
    )
    for op, title, run in sections:
        if op is None or op in ops:
            part = run()
            print_table(title, part)
            rows += part
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
