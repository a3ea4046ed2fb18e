"""Build ahead of time: ``prebuild`` fills the cache for targets (no GPU needed for CUDA targets);
``warmup`` builds and loads what one device needs, before CUDA-graph capture."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from .jit import JitSpec, JitUnavailable, ensure_built, get_module
from .jit.toolchain import cuda_arch, normalize_cuda_arch
from .ops import OPS


def specs_for(target: str) -> list[JitSpec]:
    """Every module jitkv prebuilds for a target ("cpu" or a CUDA arch such as "9.0a"): each op's
    declared specs, once each, and on CUDA the FlashInfer shims' page_slots module."""
    from .compat.flashinfer import page_slots_spec

    target = target if target == "cpu" else normalize_cuda_arch(target)
    compat = [] if target == "cpu" else [page_slots_spec(target)]
    return list(dict.fromkeys([*(spec for op in OPS.values() for spec in op.specs(target)), *compat]))


def prebuild(targets=("cpu",), *, jobs: int | None = None, progress: bool = False) -> dict[str, str]:
    """Build (not load) every module for ``targets``; returns {spec description: "ok" or the reason}.

    CUDA targets build with nvcc alone, so a machine without a GPU can fill a shared cache."""
    return build_specs([s for t in targets for s in specs_for(t)], jobs=jobs, progress=progress)


def build_specs(specs: list[JitSpec], *, jobs: int | None = None, progress: bool = False) -> dict[str, str]:
    """Build (not load) ``specs``, ``jobs`` at a time (default: half the CPUs); returns {spec
    description: "ok" or the reason}."""
    jobs = jobs or max(1, min(len(specs), (os.cpu_count() or 2) // 2))
    results: dict[str, str] = {}

    def one(spec: JitSpec) -> tuple[str, str]:
        try:
            ensure_built(spec)
            return spec.describe(), "ok"
        except JitUnavailable as e:
            return spec.describe(), f"failed: {e}"

    with _progress(len(specs)) if progress else contextlib.nullcontext() as bar, ThreadPoolExecutor(jobs) as pool:
        for desc, status in pool.map(one, specs):
            results[desc] = status
            if bar is not None:
                bar.set_postfix_str(desc[:40])
                bar.update()
    return results


@contextlib.contextmanager
def _progress(total: int):
    """A tqdm bar on stderr; while it is shown, jitkv's log lines to the terminal go through tqdm.write,
    which prints them above the bar instead of into it."""
    from tqdm import tqdm

    logger = logging.getLogger("jitkv")
    swaps = {h: _AboveBars(h.stream, h.formatter, h.level) for h in logger.handlers if _on_terminal(h)}
    with tqdm(total=total, desc="jitkv prebuild", unit="module") as bar:
        _replace(logger, swaps)
        try:
            yield bar
        finally:
            _replace(logger, {new: old for old, new in swaps.items()})


def _on_terminal(handler: logging.Handler) -> bool:
    """A handler writing where the bar is drawn (a file handler or an app's own handler is left alone)."""
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.stdout)


def _replace(logger: logging.Logger, swaps: dict[logging.Handler, logging.Handler]) -> None:
    """Each handler of ``logger`` that is a key of ``swaps`` replaced by its value, in the same place."""
    logger.handlers = [swaps.get(h, h) for h in logger.handlers]


class _AboveBars(logging.Handler):
    """Writes each record with tqdm.write: the bars on the stream are cleared, the line written, the bars
    redrawn below it."""

    def __init__(self, stream, formatter: logging.Formatter | None, level: int):
        super().__init__(level)
        self.stream = stream
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


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
