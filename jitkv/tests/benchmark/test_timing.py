"""The CPU benchmark's timing: each row keeps its spread; a stalled case is timed again, and marked when
it stays wide; a case's implementations alternate batch by batch, so their ratio survives a machine
whose speed changes; fresh slots come in disjoint windows. A fake clock makes the stalls exact."""

from __future__ import annotations

import types

import pytest

from jitkv.benchmark import common
from jitkv.benchmark.common import Row, Timing, print_table, time_alternating


class FakeFn:
    """A call takes 10 µs of a fake clock, the calls numbered in ``stalls`` (from 1) take 10 ms."""

    def __init__(self, stalls=()):
        self.now, self.calls, self.stalls = 0.0, 0, set(stalls)

    def __call__(self):
        self.calls += 1
        self.now += 10e-3 if self.calls in self.stalls else 10e-6


@pytest.fixture
def fake_clock(monkeypatch):
    """Makes a FakeFn the clock of the timing, with batches of 100 calls: 7 batches are calls 1-700."""

    def use(fn: FakeFn) -> FakeFn:
        monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: fn.now))
        monkeypatch.setattr(common, "_calls_per_batch", lambda fn, batch_s: 100)
        return fn

    return use


def _us(timing: Timing) -> tuple:
    return pytest.approx((timing.median_us, timing.min_us, timing.max_us))


def test_steady_row_is_timed_once(fake_clock):
    fn = fake_clock(FakeFn())
    timing = Timing.of(time_alternating([fn])[0])
    assert (10, 10, 10) == _us(timing) and not timing.wide
    assert fn.calls == 700


def test_stalled_row_is_timed_again(fake_clock):
    fn = fake_clock(FakeFn(stalls=[250]))  # the third batch of the first timing: 109.9 µs a call
    timing = Timing.of(time_alternating([fn])[0])
    assert (10, 10, 10) == _us(timing) and not timing.wide
    assert fn.calls == 1400


def test_row_that_stays_wide_is_marked(fake_clock, capsys):
    fn = fake_clock(FakeFn(stalls=[250, 950, 1650, 2350]))  # one stall in each of the 4 timings
    timing = Timing.of(time_alternating([fn])[0])
    assert (10, 10, 109.9) == _us(timing) and timing.wide and fn.calls == 2800
    row = Row("store_cache", "case", 7, "torch index", timing, 1_000_000, timing)
    assert (row.us, row.baseline_us) == (timing.median_us, timing.median_us)
    assert row.as_dict()["extra"] == {"min_us": timing.min_us, "max_us": timing.max_us, "wide": True}
    print_table("t", [row])
    lines = capsys.readouterr().out.splitlines()
    assert lines[4] == "| store_cache | case | 7 | torch index | 10.00 | 10.00-109.90 (wide) | 100.0 | 1.00x | — | — |"
    assert lines[6] == "(wide): the slowest batch took more than 1.5x the fastest in each of 4 timings"


def test_batches_are_sized_past_a_stall(monkeypatch):
    fn = FakeFn(stalls=[2])  # the first timed call
    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: fn.now))
    assert common._calls_per_batch(fn, 0.2 / 7) == round(0.2 / 7 / 10e-6)


def test_gpu_rows_have_no_spread(capsys):
    print_table(
        "gpu", [Row("set_mla_kv_buffer", "512+64 bf16", 1, "jitkv auto", 2.5, 2304000, None, 3000.0, {"x_floor": 1.2})]
    )
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| op | case | n | backend | µs | spread | GB/s | vs torch | of copy bw | × floor |"
    assert out[4] == "| set_mla_kv_buffer | 512+64 bf16 | 1 | jitkv auto | 2.50 | — | 921.6 | — | 30.7 % | 1.20 |"
    assert len(out) == 5


class Machine:
    """A fake clock whose speed halves and recovers every 200 calls (a round of two batches of 100), as
    a shared host's does."""

    def __init__(self):
        self.now, self.calls = 0.0, 0

    def fn(self, us):
        def call():
            self.calls += 1
            self.now += us * 1e-6 * (2 if (self.calls - 1) // 200 % 2 else 1)

        return call


def test_alternating_batches_keep_the_ratio_of_a_changing_machine(monkeypatch):
    """Batches of 100 calls of a 10 µs and a 15 µs function in turn on a machine whose speed changes
    between rounds: each round's ratio is 1.5, whatever the spread of each function alone."""
    from jitkv.benchmark.cpu import Harness

    m = Machine()
    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: m.now))
    monkeypatch.setattr(common, "_calls_per_batch", lambda fn, batch_s: 100)
    rows = Harness(None).rows("op", "case", 1, 1000, [("copy", m.fn(10)), ("fp8", m.fn(15))], floor="copy")
    assert [r.extra["x_floor"] for r in rows] == [1.0, 1.5]
    assert rows[1].extra["min_us"] == pytest.approx(15) and rows[1].extra["max_us"] == pytest.approx(30)
    assert rows[1].baseline_us == pytest.approx(rows[0].us) and round(rows[0].us) in (10, 20)


def test_fresh_slots_are_disjoint_windows_of_one_permutation():
    from jitkv.benchmark.cpu import Harness

    nxt = Harness.fresh_slots(64, 5)
    windows = [nxt().tolist() for _ in range(12)]  # 12 windows of 5 fit in 64: then the cycle restarts
    assert sorted(sum(windows[:12], [])) == sorted(set(sum(windows[:12], [])))
    assert all(0 <= s < 64 for w in windows for s in w)
    assert nxt().tolist() == windows[0]
