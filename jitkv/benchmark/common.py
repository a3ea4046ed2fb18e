"""Result rows and the printed table shared by the CPU and GPU benchmarks; the CPU cases' timing."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

# A CPU row whose slowest batch took more than WIDE x its fastest was disturbed (another process on
# its cores, a page fault, a clock change): its case is timed again, up to RETIMES more times, and
# keeps the narrowest timing; a row still wide is marked. Re-measure a marked row on an idle machine:
# python -m jitkv.benchmark --device cpu --op OP.
WIDE = 1.5
RETIMES = 3


@dataclass(frozen=True)
class Timing:
    """Per-call µs of the batches of one timing: their median, fastest and slowest."""

    median_us: float
    min_us: float
    max_us: float

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        return cls(statistics.median(samples), min(samples), max(samples))

    @property
    def wide(self) -> bool:
        return self.max_us > WIDE * self.min_us


@dataclass
class Row:
    """One result. ``us`` and ``baseline_us`` may be given as Timings: each becomes its median, and the
    spread of ``us`` goes to ``extra`` (min_us, max_us, wide)."""

    op: str
    case: str
    n: int
    backend: str
    us: float | Timing
    bytes_moved: int  # read + written
    baseline_us: float | Timing | None = None  # torch on the same case, same run
    copy_gbps: float | None = None  # device copy bandwidth (read + write), same run
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.us, Timing):
            self.extra.update(min_us=self.us.min_us, max_us=self.us.max_us, wide=self.us.wide)
            self.us = self.us.median_us
        if isinstance(self.baseline_us, Timing):
            self.baseline_us = self.baseline_us.median_us

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.us / 1e3 if self.us > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = round(self.gbps, 2)
        d["speedup_vs_torch"] = round(self.baseline_us / self.us, 2) if self.baseline_us else None
        d["frac_of_copy"] = round(self.gbps / self.copy_gbps, 3) if self.copy_gbps else None
        return d


def time_alternating(fns, *, min_time=0.2, repeats=7) -> list[list[float]]:
    """Per-call µs of each fn in `repeats` rounds, a round one batch of each fn in turn, each batch sized
    to take about min_time / repeats: a change in the machine's speed (another tenant on its cores, a
    clock change) lands on the fns of a round alike, so their ratios within a round hold where separate
    timings would not. Rounds with a wide fn (see WIDE) are timed again and the set whose widest fn is
    narrowest is returned."""
    calls = [_calls_per_batch(fn, min_time / repeats) for fn in fns]
    best = _rounds(fns, calls, repeats)
    for _ in range(RETIMES):
        if not any(Timing.of(s).wide for s in best):
            break
        best = min(best, _rounds(fns, calls, repeats), key=lambda ss: max(max(s) / min(s) for s in ss))
    return best


def paired_ratio(samples: list[float], floor: list[float]) -> float:
    """The median over rounds of a fn's batch over the floor fn's batch of the same round."""
    return statistics.median(a / b for a, b in zip(samples, floor))


def _calls_per_batch(fn, batch_s: float) -> int:
    """Calls of fn() that take about batch_s, from loops of doubling length until one takes a tenth of
    it; each loop length is timed twice and the faster kept, so that one stall does not size the
    batches."""
    fn()  # the first call may load a kernel or fault pages in
    calls = 1
    while (took := min(_loop_s(fn, calls), _loop_s(fn, calls))) < batch_s / 10:
        calls *= 2
    return max(1, round(calls * batch_s / took))


def _rounds(fns, calls: list[int], repeats: int) -> list[list[float]]:
    out = [[] for _ in fns]
    for _ in range(repeats):
        for samples, fn, c in zip(out, fns, calls):
            samples.append(_loop_s(fn, c) / c * 1e6)
    return out


def _loop_s(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n## {title}")
    print("| op | case | n | backend | µs | spread | GB/s | vs torch | of copy bw | × floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r.as_dict()
        sp = f"{d['speedup_vs_torch']:.2f}x" if d["speedup_vs_torch"] else "—"
        fr = f"{100 * d['frac_of_copy']:.1f} %" if d["frac_of_copy"] else "—"
        xe = f"{r.extra['x_floor']:.2f}" if "x_floor" in r.extra else "—"
        cells = [r.op, r.case, r.n, r.backend, f"{r.us:.2f}", _spread(r), f"{r.gbps:.1f}", sp, fr, xe]
        print("| " + " | ".join(map(str, cells)) + " |")
    if any(r.extra.get("wide") for r in rows):
        print(f"\n(wide): the slowest batch took more than {WIDE}x the fastest in each of {1 + RETIMES} timings")


def _spread(row: Row) -> str:
    """min-max µs of a row's batches, marked when wide; "—" for a row timed otherwise (GPU)."""
    if "min_us" not in row.extra:
        return "—"
    return f"{row.extra['min_us']:.2f}-{row.extra['max_us']:.2f}" + (" (wide)" if row.extra["wide"] else "")
