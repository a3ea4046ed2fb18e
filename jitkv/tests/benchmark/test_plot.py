"""python -m jitkv.benchmark --plot and python -m jitkv.benchmark.plot: a PNG per report, lines grouped
as the benchmark's rows mean them."""

from __future__ import annotations

import json
import sys

import pytest

from jitkv.benchmark import __main__ as bench_main
from jitkv.benchmark import cpu, plot
from jitkv.benchmark.common import Row
from jitkv.ops import OPS
from jitkv.tests.conftest import gpu

NS = (1, 4, 16, 64, 256, 2048, 16384, 262144)
BW, FLOOR = 3000.0, 2.1


def _op_rows(op, case, backends, ns=NS, bytes_per_n=2304):
    """Rows shaped as the GPU benchmark writes them: µs grows from the floor towards the copy time."""
    rows = []
    for n in ns:
        for i, backend in enumerate(backends):
            moved = n * bytes_per_n
            us = FLOOR * (1.2 + 0.3 * i) + moved / (BW * 1e3) * (1.1 + 0.2 * i)
            rows.append(Row(op, case, n, backend, us, moved, None, BW, {"x_floor": us / FLOOR}).as_dict())
    return rows


def gpu_like_report() -> dict:
    """Every kind of row the GPU benchmark writes: reference rows, host-cost rows (no bytes), an op
    with two swept cases, an op whose cases are single points, and a modifier (", paged slots")."""
    mla = (
        "torch index",
        "jitkv auto",
        "jit latency",
        "jit vector (bulk)",
        "jit TMA",
        "triton",
        "jitkv auto, L2-warm source",
        "triton, L2-warm source",
    )
    rows = [
        Row("empty kernel", "triton, graph", 0, "—", 1.8, 0, None, BW).as_dict(),
        Row("latency floor", "1 thread", 1, "jit", FLOOR, 32, None, BW).as_dict(),
        *_op_rows("set_mla_kv_buffer", "512+64 bf16", mla),
        *_op_rows("set_mla_kv_buffer", "512+64 bf16", ("contiguous copy_ of the same bytes (eager)",), ns=NS[-2:]),
        *_op_rows("store_cache", "H8 D128 K+V bf16", ("torch index", "jitkv auto", "triton"), bytes_per_n=8192),
        *_op_rows(
            "store_cache", "H8 D128 K+V bf16->fp8 e4m3", ("torch index", "jitkv auto", "triton"), bytes_per_n=6144
        ),
        Row("set_mla_kv_buffer", "eager host cost per call", 1, "jitkv", 4.0, 0).as_dict(),
        *_op_rows("quantize_and_insert_k_cache", "block_size 64", ("jitkv auto", "jitkv auto, paged slots")),
    ]
    for k_len in (512, 2048, 32768):
        rows += _op_rows(
            "dequantize_and_gather_k_cache",
            f"1 req x {k_len}",
            ("torch reference (eager)", "jitkv auto"),
            ns=(k_len,),
            bytes_per_n=1608,
        )
    return {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "rows": rows, "build": {}}


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # four rows of panels with lines and legends, not an empty canvas


def test_series_split_swept_cases_and_join_single_points():
    panels = plot.op_rows(gpu_like_report()["rows"])
    assert list(panels) == [
        "set_mla_kv_buffer",
        "store_cache",
        "quantize_and_insert_k_cache",
        "dequantize_and_gather_k_cache",
    ]  # no floor, empty kernel or host-cost panel
    assert all(r["bytes_moved"] > 0 for r in panels["set_mla_kv_buffer"])
    store = plot.series(panels["store_cache"])
    assert ("triton", "H8 D128 K+V bf16->fp8 e4m3") in store and len(store) == 6
    gather = plot.series(panels["dequantize_and_gather_k_cache"])
    assert [r["n"] for r in gather[("jitkv auto", "")]] == [512, 2048, 32768]
    assert len(plot.series(panels["set_mla_kv_buffer"])) == 9


def test_cpu_fp8_rows_join_the_store_cache_panel():
    rows = [
        *_op_rows("store_cache", "[4096,8,128] bf16", ("torch index", "jitkv jit")),
        *_op_rows("store_cache fp8", "[4096,8,128] bf16->e4m3", ("jitkv jit",)),
    ]
    lines = plot.series(plot.op_rows(rows)["store_cache"])
    assert set(lines) == {
        ("torch index", "[4096,8,128] bf16"),
        ("jitkv jit", "[4096,8,128] bf16"),
        ("jitkv jit", "fp8 [4096,8,128] bf16->e4m3"),
    }


def test_styles_color_by_implementation_and_dash_its_variants():
    keys = list(plot.series(plot.op_rows(gpu_like_report()["rows"])["set_mla_kv_buffer"]))
    auto, warm = plot.style(("jitkv auto", ""), keys), plot.style(("jitkv auto, L2-warm source", ""), keys)
    assert auto["color"] == warm["color"] and auto["linestyle"] != warm["linestyle"]
    assert plot.style(("triton", ""), keys)["color"] != auto["color"]


def test_roofline_and_floor_from_the_report_or_its_rows():
    report = gpu_like_report()
    assert (plot.copy_gbps(report), plot.floor_us(report)) == (BW, FLOOR)
    report.update(copy_gbps=2900.0, floor_us=2.0)
    assert (plot.copy_gbps(report), plot.floor_us(report)) == (2900.0, 2.0)
    assert plot.floor_us({"rows": []}) is None and plot.copy_gbps({"rows": []}) is None


def test_plot_from_saved_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    report, png = tmp_path / "report.json", tmp_path / "out.png"
    report.write_text(json.dumps(gpu_like_report()))
    assert plot.main([str(report), str(png)]) == 0
    _assert_png(png)
    assert str(png) in capsys.readouterr().out


def test_report_without_op_rows_is_refused(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no op rows"):
        plot.save({"rows": [], "build": {"cold build mla_cpu (s)": 2.0}}, str(tmp_path / "x.png"))


def test_cpu_run_with_plot_and_json(tmp_path):
    """The CPU benchmark end to end through the CLI, cut to its smallest cases (--quick)."""
    pytest.importorskip("matplotlib")
    png, js = tmp_path / "cpu.png", tmp_path / "cpu.json"
    argv = ["--device", "cpu", "--quick", "--op", "set_mla_kv_buffer", "--plot", str(png), "--json", str(js)]
    assert bench_main.main(argv) == 0
    _assert_png(png)
    report = json.loads(js.read_text())
    assert report["copy_gbps"] > 0
    copy = {(r["backend"], r["n"]) for r in report["rows"] if r["case"] == "512+64 bf16"}
    assert copy == {("torch index", 1), ("jitkv jit", 1)}


def test_missing_matplotlib_fails_before_benchmarking(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setattr(cpu, "copy_gbps", lambda *a: pytest.fail("benchmarked before checking for matplotlib"))
    with pytest.raises(SystemExit) as e:
        bench_main.main(["--device", "cpu", "--op", "set_mla_kv_buffer", "--plot", "x.png"])
    assert e.value.code == 2
    assert "pip install 'jitkv[plot]'" in capsys.readouterr().err


@gpu
@pytest.mark.parametrize("op", ["rope_store_cache", "transfer_pages"])
def test_gpu_run_quick(tmp_path, op):
    """The GPU benchmark of one op through the CLI, cut to its smallest cases: every row timed something,
    and each rope_store_cache case has the fused-prologue floor beside its CUDA kernel's row."""
    js = tmp_path / "gpu.json"
    assert bench_main.main(["--device", "cuda", "--quick", "--op", op, "--json", str(js)]) == 0
    rows = [r for r in json.loads(js.read_text())["rows"] if r["op"] == op]
    assert rows and all(r["us"] > 0 for r in rows)
    if op == "rope_store_cache":
        cases = {r["case"] for r in rows if r["backend"] == "jitkv jit" and "eager" not in r["case"]}
        floors = {r["case"] for r in rows if r["backend"].startswith("fused-prologue floor")}
        assert cases and floors == cases


@pytest.mark.parametrize("op", [op for op in OPS.values() if op.bench_cpu], ids=lambda op: op.name)
def test_every_cpu_section_returns_rows(op):
    """Each op's CPU cases, cut to their smallest, return rows that timed something."""
    rows = op.bench_cpu(cpu.Harness(None, quick=True))
    assert isinstance(rows, list) and rows and all(r.us > 0 for r in rows)


def test_op_choices_name_every_benchmarked_op_and_family():
    choices = bench_main._choices()
    for op in OPS.values():
        if op.bench_cpu or op.bench_gpu:
            assert choices[op.name] == {op.family} and op.family in choices[op.family]
