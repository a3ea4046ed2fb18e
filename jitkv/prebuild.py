"""Build ahead of time: ``prebuild`` fills the cache for targets (no GPU needed for CUDA targets);
``warmup`` builds and loads what one device needs, before CUDA-graph capture."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .jit import JitSpec, JitUnavailable, ensure_built, get_module
from .jit.toolchain import cuda_arch, normalize_cuda_arch
from .ops import OPS


def specs_for(target: str) -> list[JitSpec]:
    """Every module jitkv prebuilds for a target ("cpu" or a CUDA arch such as "9.0a"): each op's
    declared specs, once each."""
    target = target if target == "cpu" else normalize_cuda_arch(target)
    return list(dict.fromkeys(spec for op in OPS.values() for spec in op.specs(target)))


def prebuild(targets=("cpu",), *, jobs: int | None = None, progress: bool = False) -> dict[str, str]:
    """Build (not load) every module for ``targets``; returns {spec description: "ok" or the reason}.

    CUDA targets build with nvcc alone, so a machine without a GPU can fill a shared cache."""
    specs = [s for t in targets for s in specs_for(t)]
    jobs = jobs or max(1, min(len(specs), (os.cpu_count() or 2) // 2))
    results: dict[str, str] = {}

    def one(spec: JitSpec) -> tuple[str, str]:
        try:
            ensure_built(spec)
            return spec.describe(), "ok"
        except JitUnavailable as e:
            return spec.describe(), f"failed: {e}"

    bar = _progress(len(specs)) if progress else None
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for desc, status in pool.map(one, specs):
            results[desc] = status
            if bar is not None:
                bar.set_postfix_str(desc[:40])
                bar.update()
    if bar is not None:
        bar.close()
    return results


def _progress(total: int):
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc="jitkv prebuild", unit="module")


def warmup(device=None) -> dict[str, str]:
    """Build and load the jit modules a device needs (call before torch.cuda.graph capture).

    ``device``: a torch.device or string; default the current CUDA device if any, else CPU.
    Returns {spec description: "ok" or the failure reason}; failures fall back at call time."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    target = "cpu" if device.type == "cpu" else cuda_arch(device)
    results = {}
    for spec in specs_for(target):
        try:
            get_module(spec)
            results[spec.describe()] = "ok"
        except JitUnavailable as e:
            results[spec.describe()] = f"failed: {e}"
    return results
