"""python -m jitkv {prebuild,info,cache}: fill, inspect, verify and clear the kernel cache."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jitkv", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    pb = sub.add_parser("prebuild", help="build kernels into JITKV_CACHE_DIR ahead of time")
    pb.add_argument("--arch", action="append", default=[], help="CUDA target, e.g. 9.0a (repeatable); no GPU needed")
    pb.add_argument("--no-cpu", action="store_true", help="skip the CPU kernels")
    pb.add_argument("--jobs", type=int, default=None, help="modules built in parallel")
    pb.add_argument("--out", help="write a relocatable cache to this dir instead (to ship in an image)")
    sub.add_parser("info", help="toolchain, cache dir and contents, backend per op")
    cache = sub.add_parser("cache", help="manage the cache dir")
    cache.add_argument("action", choices=["clear", "verify"], help="clear the write layer, or check every artifact")
    args = parser.parse_args(argv)
    return {"prebuild": _prebuild, "info": _info, "cache": _cache}[args.cmd](args)


def _prebuild(args) -> int:
    from . import prebuild
    from .jit import cache_dir

    targets = ([] if args.no_cpu else ["cpu"]) + list(args.arch)
    if not targets:
        print("nothing to build: --no-cpu and no --arch", file=sys.stderr)
        return 2
    if args.out and not _use_out_dir(os.path.abspath(args.out)):
        print(f"--out {args.out}: not a writable directory this user may use", file=sys.stderr)
        return 2
    results = prebuild(targets, jobs=args.jobs, progress=True)
    for desc, status in results.items():
        print(f"{status:>6.6}  {desc}" if status == "ok" else f"FAILED  {desc}: {status}")
    print(f"cache: {cache_dir()}")
    return 0 if all(s == "ok" for s in results.values()) else 1


def _use_out_dir(out: str) -> bool:
    """Make ``out`` the one cache layer of this process (built into and looked up alone)."""
    from .jit import JitUnavailable, cache_dir

    os.environ["JITKV_CACHE_DIR"] = out
    try:
        os.makedirs(out, mode=0o755, exist_ok=True)  # readable by the users of the image it ships in
        return cache_dir() == out
    except (OSError, JitUnavailable):
        return False


def _info(args) -> int:
    import torch

    import jitkv

    from .jit import is_built, toolchain
    from .prebuild import specs_for

    print(f"jitkv {jitkv.__version__}  torch {torch.__version__}")
    print(f"c++:  {toolchain.compiler_version(toolchain.cxx())}")
    home = toolchain.cuda_home()
    print(
        f"nvcc: {toolchain.compiler_version(toolchain.nvcc()) if home else 'not found'}"
        + (f" ({home})" if home else "")
    )
    print(f"cpu target: {toolchain.cpu_target()}")
    _print_layers()
    targets = ["cpu"] + [toolchain.cuda_arch(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    print("backend per op (prebuilt variants; the op picks at call time):")
    for target in dict.fromkeys(targets):
        for spec in specs_for(target):
            state = "built" if is_built(spec) else "not built yet (builds on first call)"
            print(f"  jit {spec.describe()}: {state}")
    print(json.dumps(jitkv.backend_info(), indent=1) if jitkv.backend_info() else "  (no op called in this process)")
    return 0


def _print_layers() -> None:
    from .jit import JitUnavailable, cache_dir, configured_layers
    from .jit.cache_dir import lookup_layers

    print("cache layers (looked up in order): " + os.pathsep.join(configured_layers()))
    try:
        print(f"builds go to: {cache_dir()}")
    except JitUnavailable as e:
        print(f"builds go to: nowhere ({e})")
    for layer in lookup_layers():
        _print_contents(str(layer))


def _print_contents(root: str) -> None:
    from .jit.build import published_artifacts

    entries = published_artifacts(Path(root))
    failed = sorted(os.listdir(os.path.join(root, "failed"))) if os.path.isdir(os.path.join(root, "failed")) else []
    print(f"  {root}: {len(entries)} built module(s), {len(failed)} remembered failure(s)")
    for e in entries:
        with open(e / "manifest.json") as f:
            m = json.load(f)
        built_by = "; ".join(f"{c['version']} ({c['path']})" for c in m.get("compilers", {}).values()) or "?"
        print(f"    {e.name}  ({m.get('seconds', '?')} s to build with {built_by})")
    for e in failed:
        with open(os.path.join(root, "failed", e)) as f:
            print(f"    FAILED {e[:-5]}: {json.load(f).get('reason')}")


def _cache(args) -> int:
    return _verify() if args.action == "verify" else _clear()


def _clear() -> int:
    from .jit import cache_dir

    root = cache_dir()
    for entry in os.listdir(root):
        if entry == "locks":  # lock files are never unlinked: a concurrent builder may hold one
            continue
        path = os.path.join(root, entry)
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    print(f"cleared {root}")
    return 0


def _verify() -> int:
    """One line per artifact of every layer; exit status 1 when any is damaged or untrusted."""
    from .jit.build import ArtifactProblem, published_artifacts, verify_artifact
    from .jit.cache_dir import lookup_layers

    bad = 0
    for layer in lookup_layers():
        for final in published_artifacts(layer):
            try:
                verify_artifact(final)
                print(f"ok       {final}")
            except ArtifactProblem as e:
                bad += 1
                print(f"{'DAMAGED' if e.damaged else 'REFUSED':<8} {final}: {e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
