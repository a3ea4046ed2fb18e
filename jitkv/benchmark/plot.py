"""Plot a benchmark report: per op, GB/s against n (log-log) under the copy bandwidth of the same run,
and µs against small n over the latency floor of the same run.

python -m jitkv.benchmark.plot REPORT.json OUT.png   (REPORT.json written by ``--json``)

Needs matplotlib (``pip install 'jitkv[plot]'``) and no GPU: a GPU run's report plots on any machine.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

SMALL_N = 2048  # the latency panel's range: decode-sized batches, where launch and latency dominate
# Rows that measure the machine rather than an op: drawn as reference lines, never as panels.
REFERENCE_OPS = {"copy_", "latency floor", "empty kernel"}
# One color per implementation across panels; variants of one (", L2-warm source", a second case)
# share its color and differ in line style.
COLORS = {
    "jitkv auto": "tab:blue",
    "jitkv jit": "tab:blue",
    "triton": "tab:orange",
    "torch index": "tab:gray",
    "torch reference": "tab:gray",
    "jit latency": "tab:green",
    "jit vector (bulk)": "tab:purple",
    "jit TMA": "tab:brown",
}
CEILING_COLOR = "black"  # the eager copy_ of an op's own bytes
OTHER_COLORS = ("tab:red", "tab:pink", "tab:olive", "tab:cyan")
LINESTYLES = ("-", "--", ":", "-.")
MISSING = "plotting needs matplotlib: pip install 'jitkv[plot]' (or pip install matplotlib)"


def require_matplotlib() -> None:
    """Raise ImportError with the install hint unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(MISSING) from None


def save(report: dict, path: str) -> None:
    """Write the report's plot to ``path`` (PNG, or any format matplotlib infers from the name)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    panels = op_rows(report["rows"])
    if not panels:
        raise ValueError("the report has no op rows to plot (only build timings?)")
    fig = Figure(figsize=(15, 4.2 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 2, squeeze=False)
    copy, floor = copy_gbps(report), floor_us(report)
    for (op, rows), (ax_bw, ax_us) in zip(panels.items(), axes):
        lines = series(rows)
        _bandwidth_panel(ax_bw, op, lines, copy)
        _latency_panel(ax_us, op, lines, floor)
        _legend(ax_bw, ax_us)
    fig.suptitle(f"jitkv benchmark: {report.get('device', '?')}, torch {report.get('torch', '?')}")
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------ the data


def panel_name(op: str) -> str:
    """The public op a row belongs to: CPU names FP8 store_cache rows "store_cache fp8"."""
    return op.split(" ")[0]


def op_rows(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows that time an op moving bytes, by public op, in the report's order. Host-cost rows
    (no bytes moved) and the machine's reference rows are left out."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r["op"] not in REFERENCE_OPS and r["bytes_moved"] > 0 and r["n"] > 0 and r["us"] > 0:
            out.setdefault(panel_name(r["op"]), []).append(r)
    return out


def series(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """One op's rows as lines: (implementation, variant) -> rows sorted by n. When some case sweeps
    n and the op has several cases (bf16 and FP8 caches), the variant names the case. When every case
    is a single n, the case names the point (DeepSeek-V4 gathers: "16 req x 4096"), so an
    implementation's points make one line."""
    cases = {(r["op"], r["case"]) for r in rows}
    sweeps = any(len({r["n"] for r in rows if (r["op"], r["case"]) == c}) > 1 for c in cases)
    by_case = sweeps and len(cases) > 1
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        variant = _case_label(r["op"], r["case"]) if by_case else ""
        out.setdefault((r["backend"], variant), []).append(r)
    return {k: sorted(v, key=lambda r: r["n"]) for k, v in out.items()}


def _case_label(op: str, case: str) -> str:
    suffix = op[len(panel_name(op)) :].strip()
    return f"{suffix} {case}".strip()


def gbps(row: dict) -> float:
    """Bytes read + written per second, unrounded (the report's "gbps" keeps 2 decimals)."""
    return row["bytes_moved"] / row["us"] / 1e3


def copy_gbps(report: dict) -> float | None:
    """The device copy bandwidth (read + write) of the run: the report's own figure, else the one
    its rows carry (reports written before it had one)."""
    if report.get("copy_gbps"):
        return report["copy_gbps"]
    seen = Counter(r["copy_gbps"] for r in report["rows"] if r.get("copy_gbps"))
    return seen.most_common(1)[0][0] if seen else None


def floor_us(report: dict) -> float | None:
    """The latency floor of the run (GPU only), from the report or its "latency floor" row."""
    if report.get("floor_us"):
        return report["floor_us"]
    return next((r["us"] for r in report["rows"] if r["op"] == "latency floor"), None)


# ------------------------------------------------------------------------------------ the axes


def style(key: tuple[str, str], keys: list[tuple[str, str]]) -> dict:
    """Color by implementation, line style by variant (a case or a ", ..." modifier such as
    "L2-warm source"), both in the order the report lists them, so that reruns draw alike."""
    backend, variant = key
    base = _base(backend)
    if "copy_" in base:
        return {"color": CEILING_COLOR, "linestyle": "-", "marker": "x", "linewidth": 1.0}
    others = [b for b in dict.fromkeys(_base(k[0]) for k in keys) if b not in COLORS]
    color = COLORS.get(base) or OTHER_COLORS[others.index(base) % len(OTHER_COLORS)]
    variants = list(dict.fromkeys((_modifier(k[0]), k[1]) for k in keys))  # the report's first case: solid
    linestyle = LINESTYLES[variants.index((_modifier(backend), variant)) % len(LINESTYLES)]
    return {"color": color, "linestyle": linestyle, "marker": "o", "markersize": 3.5, "linewidth": 1.4}


def _base(backend: str) -> str:
    """The implementation a label names: "triton, L2-warm source (eager)" -> "triton"."""
    return backend.partition(",")[0].removesuffix(" (eager)")


def _modifier(backend: str) -> str:
    return backend.partition(",")[2].strip()


def _label(key: tuple[str, str]) -> str:
    return f"{key[0]} — {key[1]}" if key[1] else key[0]


def _bandwidth_panel(ax, op: str, lines: dict, copy: float | None) -> None:
    keys = list(lines)
    for key, rows in lines.items():
        ax.plot([r["n"] for r in rows], [gbps(r) for r in rows], label=_label(key), **style(key, keys))
    if copy:
        ax.axhline(
            copy, color="black", linestyle="--", linewidth=1.0, label=f"copy bandwidth, same run ({copy:.0f} GB/s)"
        )
    _n_axis(ax)
    _log_y(ax)
    ax.set_title(f"{op}: bandwidth (bytes read + written)")
    ax.set_ylabel("GB/s")
    ax.grid(True, which="major", alpha=0.3)


def _latency_panel(ax, op: str, lines: dict, floor: float | None) -> None:
    keys, drawn = list(lines), []
    for key, rows in lines.items():
        small = [r for r in rows if r["n"] <= SMALL_N]
        drawn += [r["us"] for r in small]
        # A line with no small n is drawn empty, so that the row's legend (beside this panel) lists it.
        ax.plot([r["n"] for r in small], [r["us"] for r in small], label=_label(key), **style(key, keys))
    if floor:
        ax.axhline(
            floor, color="tab:red", linestyle="--", linewidth=1.0, label=f"latency floor, same run ({floor:.2f} µs)"
        )
        drawn.append(floor)
    _n_axis(ax)
    ax.set_xlim(0.8, SMALL_N * 1.25)  # the same range on every op, whatever n it was timed at
    # Linear µs reads best near the floor; a slow eager reference would flatten everything else.
    if drawn and max(drawn) > 20 * min(drawn):
        _log_y(ax)
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(f"{op}: latency, n ≤ {SMALL_N}")
    ax.set_ylabel("µs per call")
    ax.grid(True, which="major", alpha=0.3)


def _n_axis(ax) -> None:
    """log2 n, ticks written as engine developers say batch sizes: 1, 16, 256, 4K, 64K."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _count(x)))
    ax.set_xlabel("n (rows per call)")


def _log_y(ax) -> None:
    """log y with plain numbers (3000, not 3 x 10^3); minor ticks labelled only on short ranges."""
    from matplotlib.ticker import FuncFormatter, LogFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))


def _count(x: float) -> str:
    n = round(x)
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _legend(ax_bw, ax_us) -> None:
    """One legend per op, right of its latency panel: every line of both panels, each once."""
    entries = {}
    for ax in (ax_bw, ax_us):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    ax_us.legend(
        entries.values(), entries.keys(), loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jitkv.benchmark.plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("report", help="a report written by python -m jitkv.benchmark --json FILE")
    p.add_argument("out", help="image to write, e.g. benchmark.png")
    args = p.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    try:
        save(report, args.out)
    except (ImportError, ValueError) as e:
        p.error(str(e))
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
