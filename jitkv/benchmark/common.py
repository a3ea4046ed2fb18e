"""Result rows and the printed table shared by the CPU and GPU benchmarks."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    op: str
    case: str
    n: int
    backend: str
    us: float
    bytes_moved: int  # read + written
    baseline_us: float | None = None  # torch on the same case, same run
    copy_gbps: float | None = None  # device copy bandwidth (read + write), same run
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.us / 1e3 if self.us > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = round(self.gbps, 2)
        d["speedup_vs_torch"] = round(self.baseline_us / self.us, 2) if self.baseline_us else None
        d["frac_of_copy"] = round(self.gbps / self.copy_gbps, 3) if self.copy_gbps else None
        return d


def median_us(fn, *, min_time=0.2, repeats=7) -> float:
    """Median per-call µs of fn() over `repeats` batches, each batch sized to take ~min_time/repeats."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    per_batch = max(1, int(min_time / repeats / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - t0) / per_batch)
    return statistics.median(samples) * 1e6


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n## {title}")
    print("| op | case | n | backend | µs | GB/s | vs torch | of copy bw | × floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r.as_dict()
        sp = f"{d['speedup_vs_torch']:.2f}x" if d["speedup_vs_torch"] else "—"
        fr = f"{100 * d['frac_of_copy']:.1f} %" if d["frac_of_copy"] else "—"
        xe = f"{r.extra['x_floor']:.2f}" if "x_floor" in r.extra else "—"
        print(f"| {r.op} | {r.case} | {r.n} | {r.backend} | {r.us:.2f} | {r.gbps:.1f} | {sp} | {fr} | {xe} |")
