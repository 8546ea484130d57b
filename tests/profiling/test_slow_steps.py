"""Which phase moved when the step time moved: synthetic phase series, and a real Trainer under a
mocked clock whose loader, store or whole host slows down for a stretch of the epoch."""

from __future__ import annotations

from unittest import mock

import pytest
from _profiling_helpers import MS, BatchDataset, Cost, CostModel, FakeClock, LoopOverhead, loader, trainer
from lightning.pytorch.callbacks import Callback

from lightning_embcache import StepProfiler
from lightning_embcache.profiling import report
from lightning_embcache.profiling.slow_steps import BLOCK, PhaseBlocks, attribute
from lightning_embcache.profiling.timeline import PHASES

# data_wait, forward, backward, optimizer, store_io, other (ms)
BASE = [2.0, 5.0, 7.0, 4.0, 1.0, 1.0]


def _series(n: int, slow: range, change) -> list[list[float]]:
    """n steps of BASE phases (seconds, plus a validation column as the timeline gives), with
    ``change(phases)`` applied to the steps in ``slow``."""
    out = []
    for i in range(n):
        p = list(BASE)
        if i in slow:
            p = change(p)
        out.append([x * MS for x in p] + [0.0])
    return out


def _attribute(steps: list[list[float]], handover: int = 37) -> dict:
    blocks = PhaseBlocks()
    for i in range(0, len(steps), handover):  # handed over in batches, as the predictor does
        blocks.add(steps[i:i + handover])
    return attribute(blocks.segments())


def _with(phase: str, ms: float):
    def change(p):
        p[PHASES.index(phase)] = ms
        return p
    return change


@pytest.mark.parametrize("phase, cause", [("data_wait", "loader"), ("store_io", "store"),
                                          ("optimizer", "optimizer"), ("other", "other")])
def test_the_phase_that_moved_is_named_with_how_much(phase, cause):
    base = BASE[PHASES.index(phase)]
    a = _attribute(_series(1 + 20 * 4 * BLOCK, range(600, 1000), _with(phase, base + 10.0)))
    assert a["cause"] == cause
    assert a["typical_ms"] == pytest.approx(sum(BASE))
    assert a["slow_ms"] == pytest.approx(sum(BASE) + 10.0)
    assert a["delta_ms"][phase] == pytest.approx(10.0)
    assert all(abs(d) < 1e-9 for p, d in a["delta_ms"].items() if p != phase)


def test_every_phase_stretching_together_is_the_host_getting_slower():
    a = _attribute(_series(1 + 20 * 4 * BLOCK, range(600, 1000), lambda p: [1.4 * x for x in p]))
    assert a["cause"] == "host" and a["moved_pct"] == pytest.approx(40.0)
    # one phase alone, by the same total, is not the host
    b = _attribute(_series(1 + 20 * 4 * BLOCK, range(600, 1000), _with("backward", 7.0 + 0.4 * sum(BASE))))
    assert b["cause"] == "backward"


def test_a_steady_epoch_names_no_cause_and_too_few_steps_none():
    assert _attribute(_series(1 + 20 * BLOCK, range(0), None))["cause"] == "steady"
    assert _attribute(_series(3 * BLOCK, range(0), None)) is None


def test_the_first_step_is_left_out():
    # the loader's start-up in the first step does not make the first twentieth the slow one
    steps = _series(1 + 20 * BLOCK, range(0, 1), _with("data_wait", 500.0))
    assert _attribute(steps)["cause"] == "steady"


class Slowdown(Callback):
    """From batch 200 to 279 the loader (or the whole host) costs more, then recovers."""

    def __init__(self, ds, model, overhead, what: str) -> None:
        self.ds, self.model, self.overhead, self.what = ds, model, overhead, what
        self.base = (ds.data_s, model.fwd_s, model.bwd_s, model.opt_s, overhead.seconds)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # batch batch_idx + 1 is fetched while this one runs: its data cost is set now
        factor = 1.5 if 199 <= batch_idx < 279 else 1.0
        d, f, b, o, other = self.base
        if self.what == "loader":
            self.ds.data_s = d + (10 * MS if factor > 1 else 0.0)
        else:
            self.ds.data_s = d * factor
            self.model.fwd_s, self.model.bwd_s = f * factor, b * factor
            trainer.optimizers[0].seconds = o * factor  # CostSGD keeps its own cost
            self.overhead.seconds = other * factor


@pytest.mark.parametrize("what, cause", [("loader", "loader"), ("host", "host")])
def test_a_real_fit_names_what_slowed_down(what, cause):
    clock = FakeClock()
    cost = Cost(clock)
    sp = StepProfiler(report=False)
    with mock.patch("time.perf_counter", clock):
        model = CostModel(cost, 5 * MS, 7 * MS, 4 * MS)
        ds = BatchDataset(400, cost, 2 * MS)
        overhead = LoopOverhead(cost, 1 * MS)
        t = trainer(max_epochs=1, callbacks=[sp, overhead, Slowdown(ds, model, overhead, what)])
        t.fit(model, loader(ds))
    e = sp.summary()[0]
    a = e["slow_steps"]
    assert a["cause"] == cause, a
    assert a["typical_ms"] == pytest.approx(19.0, rel=1e-6)
    if what == "loader":
        assert a["delta_ms"]["data_wait"] == pytest.approx(10.0, rel=1e-6)
        assert a["delta_ms"]["backward"] == pytest.approx(0.0, abs=1e-6)
    else:
        assert a["slow_ms"] == pytest.approx(1.5 * 19.0, rel=1e-6)
    assert len(e["phase_segments_ms"]) == 20
    assert a["reason"] in sp.report_table()


def test_the_table_and_the_last_epochs_summary_name_the_same_dominant_phase():
    # epoch 0's optimizer phase (state created on its first step) dominates the fit's mean; the
    # last epoch is data-bound: both name the last epoch's, and the table says the fit's apart
    def epoch(i, phases):
        return {"epoch": i, "batches": 100, "epoch_seconds": sum(phases.values()) / 10, "steady_batches": 0,
                "steady_batch_ms": None, "phases_ms": phases, "phases_max_ms": phases, "world_size": 1,
                "timeline": "host-clock", "slowest_rank": 0, "rank_spread_pct": 0.0,
                "dominant_phase": max(phases, key=phases.get)}
    zero = dict.fromkeys(PHASES, 0.0)
    epochs = [epoch(0, dict(zero, optimizer=90.0, data_wait=10.0)), epoch(1, dict(zero, optimizer=5.0, data_wait=20.0))]
    table = report.format_table(epochs)
    assert "dominant phase: data_wait (last epoch; over the whole fit: optimizer;" in table
    assert epochs[-1]["dominant_phase"] == "data_wait"


@pytest.mark.slow  # a subprocess importing Lightning and fitting twice: ~10 s on 2 cores
def test_the_example_prints_the_same_dominant_phase_as_its_table():
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "profile_training.py"
    got = subprocess.run([sys.executable, str(example), "--batches", "30", "--epochs", "2", "--load-ms", "0.5",
                          "--loop-ms", "0.2"], capture_output=True, text=True, timeout=240)
    assert got.returncode == 0, got.stderr[-2000:]
    table = re.findall(r"dominant phase: (\w+) \(last epoch", got.stdout + got.stderr)
    printed = re.findall(r"^dominant: (\w+);", got.stdout, re.M)
    assert len(table) == 1 and printed == table, (table, printed)
