"""python -m jitkv {prebuild,info,cache}: fill, inspect and clear the kernel cache."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jitkv", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    pb = sub.add_parser("prebuild", help="build kernels into JITKV_CACHE_DIR ahead of time")
    pb.add_argument("--arch", action="append", default=[], help="CUDA target, e.g. 9.0a (repeatable); no GPU needed")
    pb.add_argument("--no-cpu", action="store_true", help="skip the CPU kernels")
    pb.add_argument("--jobs", type=int, default=None, help="modules built in parallel")
    sub.add_parser("info", help="toolchain, cache dir and contents, backend per op")
    cache = sub.add_parser("cache", help="manage the cache dir")
    cache.add_argument("action", choices=["clear"])
    args = parser.parse_args(argv)
    return {"prebuild": _prebuild, "info": _info, "cache": _cache}[args.cmd](args)


def _prebuild(args) -> int:
    from . import prebuild  # noqa: PLC0415
    from .jit import cache_dir  # noqa: PLC0415

    targets = ([] if args.no_cpu else ["cpu"]) + list(args.arch)
    if not targets:
        print("nothing to build: --no-cpu and no --arch", file=sys.stderr)
        return 2
    results = prebuild(targets, jobs=args.jobs, progress=True)
    for desc, status in results.items():
        print(f"{status:>6.6}  {desc}" if status == "ok" else f"FAILED  {desc}: {status}")
    print(f"cache: {cache_dir()}")
    return 0 if all(s == "ok" for s in results.values()) else 1


def _info(args) -> int:
    import torch  # noqa: PLC0415

    import jitkv  # noqa: PLC0415
    from .jit import cache_dir, configured_cache_dir, is_built  # noqa: PLC0415
    from .jit import toolchain  # noqa: PLC0415
    from .prebuild import specs_for  # noqa: PLC0415

    print(f"jitkv {jitkv.__version__}  torch {torch.__version__}")
    print(f"c++:  {toolchain.compiler_version(toolchain.cxx())}")
    home = toolchain.cuda_home()
    print(f"nvcc: {toolchain.compiler_version(toolchain.nvcc()) if home else 'not found'}" + (f" ({home})" if home else ""))
    print(f"cpu target: {toolchain.cpu_target()}")
    print(f"cache dir: {cache_dir()}" + ("" if cache_dir() == configured_cache_dir() else f" (configured {configured_cache_dir()} not writable)"))
    _print_contents(cache_dir())
    targets = ["cpu"] + [toolchain.cuda_arch(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    print("backend per op (prebuilt variants; the op picks at call time):")
    for target in dict.fromkeys(targets):
        for spec in specs_for(target):
            state = "built" if is_built(spec) else "not built yet (builds on first call)"
            print(f"  jit {spec.describe()}: {state}")
    print(json.dumps(jitkv.backend_info(), indent=1) if jitkv.backend_info() else "  (no op called in this process)")
    return 0


def _print_contents(root: str) -> None:
    entries = sorted(e for e in os.listdir(root) if os.path.isfile(os.path.join(root, e, "manifest.json")))
    failed = sorted(os.listdir(os.path.join(root, "failed"))) if os.path.isdir(os.path.join(root, "failed")) else []
    print(f"  {len(entries)} built module(s), {len(failed)} remembered failure(s)")
    for e in entries:
        with open(os.path.join(root, e, "manifest.json")) as f:
            m = json.load(f)
        built_by = "; ".join(f"{c['version']} ({c['path']})" for c in m.get("compilers", {}).values()) or "?"
        print(f"    {e}  ({m.get('seconds', '?')} s to build with {built_by})")
    for e in failed:
        with open(os.path.join(root, "failed", e)) as f:
            print(f"    FAILED {e[:-5]}: {json.load(f).get('reason')}")


def _cache(args) -> int:
    from .jit import cache_dir  # noqa: PLC0415

    root = cache_dir()
    for entry in os.listdir(root):
        if entry == "locks":  # lock files are never unlinked: a concurrent builder may hold one
            continue
        path = os.path.join(root, entry)
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    print(f"cleared {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
