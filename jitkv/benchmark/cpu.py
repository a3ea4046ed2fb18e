"""CPU cases (docs/design.md §8): jit kernels against torch indexing, timed in the same process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from .common import Row, time_us
from .warm_start import warm_start


def copy_gbps(nbytes=256 << 20) -> float:
    """Host memory copy bandwidth, bytes read + written, of a copy_ far larger than the LLC: the best
    of 5, so that a fraction of it is conservative (the GPU benchmark's rule)."""
    src = torch.full((nbytes,), 7, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = min(_seconds(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * nbytes / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Harness:
    """What a family's CPU cases (``Op.bench_cpu``) use: ``rows`` times a case list in this process,
    the first case the baseline ("vs torch"), every row against the run's one copy bandwidth;
    ``sizes`` and ``quick`` cut a run to its smallest cases (``--quick``: a smoke run)."""

    def __init__(self, copy_gbps: float | None, *, quick: bool = False):
        self.copy_gbps, self.quick = copy_gbps, quick

    def sizes(self, ns):
        return ns[:1] if self.quick else ns

    def rows(self, op, case, n, moved, cases, *, min_time=0.2) -> list[Row]:
        """One row per (name, fn[, bytes]) of ``cases``."""
        rows, base = [], None
        for name, fn, *case_moved in cases:
            us = time_us(fn, min_time=0.002 if self.quick else min_time)
            base = us if base is None else base
            rows.append(Row(op, case, n, name, us, case_moved[0] if case_moved else moved, base, self.copy_gbps))
        return rows


def build_timings() -> dict:
    """Cold build of each CPU module in an empty cache, then new processes that find them published."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JITKV_CACHE_DIR": cache, "JITKV_LOG_LEVEL": "WARNING"}
        res = subprocess.run([sys.executable, "-m", "jitkv", "prebuild"], capture_output=True, text=True, env=env)
        if res.returncode != 0:
            return {"error": res.stderr[-2000:]}
        for d in sorted(os.listdir(cache)):
            m = os.path.join(cache, d, "manifest.json")
            if os.path.isfile(m):
                with open(m) as f:
                    man = json.load(f)
                out[f"cold build {man['op']} (s)"] = man["seconds"]
        out.update(warm_start("cpu", env=env))
    return out
