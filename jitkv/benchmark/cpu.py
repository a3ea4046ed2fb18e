"""CPU cases (docs/design.md §8): jit kernels against torch indexing, timed in the same process."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from .common import Row, Timing, paired_ratio, time_alternating
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

    @staticmethod
    def fresh_slots(num_slots, n):
        """A callable giving each call the next n of one random permutation of num_slots (disjoint
        windows, at most 2^16 of them, cycled): each call writes rows no call has touched for that many
        calls, cold as an engine's new tokens are once those rows pass the LLC. The same slots on every
        call would time lines the last call left in the caches instead."""
        perm = torch.randperm(num_slots)
        windows = itertools.cycle([perm[i : i + n] for i in range(0, min(num_slots, n << 16) - n + 1, n)])
        return lambda: next(windows)

    def rows(self, op, case, n, moved, cases, *, min_time=0.2, floor=None) -> list[Row]:
        """One row per (name, fn[, bytes]) of ``cases``, all timed in alternating batches
        (time_alternating); ``floor``: the name of the case each row's "× floor" is taken against, the
        median of the rounds' ratios."""
        names = [name for name, *_ in cases]
        samples = time_alternating([fn for _, fn, *_ in cases], min_time=0.002 if self.quick else min_time)
        base = Timing.of(samples[0])
        rows = []
        for (name, _, *case_moved), s in zip(cases, samples):
            extra = {} if floor is None else {"x_floor": round(paired_ratio(s, samples[names.index(floor)]), 2)}
            bytes_moved = case_moved[0] if case_moved else moved
            rows.append(Row(op, case, n, name, Timing.of(s), bytes_moved, base, self.copy_gbps, extra))
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
