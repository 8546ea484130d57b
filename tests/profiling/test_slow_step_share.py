"""Rare slow steps (the training thread waiting while another process runs on its core): the
first 5% of an epoch usually holds fewer of them than the epoch will. From the second epoch on
the prediction carries the previous epoch's share of them (mocked clock, a real Trainer)."""

from __future__ import annotations

import math
from unittest import mock

from _profiling_helpers import MS, BatchDataset, Cost, CostModel, FakeClock, LoopOverhead, loader, trainer
from lightning.pytorch.callbacks import Callback

from lightning_embcache import StepProfiler
from lightning_embcache.profiling.forecast import Forecast, slow_share

FWD, BWD, OPT, OTHER = 5 * MS, 7 * MS, 4 * MS, 1 * MS
STEP = 2 * MS + FWD + BWD + OPT + OTHER  # 19 ms


def test_slow_share_is_the_extra_time_of_steps_over_3x_the_median_per_step():
    wall = [1.0] + [0.010] * 99 + [0.050, 0.025]  # the first step (start-up) is left out
    # 101 steps counted: one at 5x the median (40 ms extra); 2.5x is not slow
    assert math.isclose(slow_share(wall), 0.040 / (101 * 0.010))
    assert math.isclose(slow_share(wall, skip=[100]), 0.0)  # a checkpoint save is not a stall
    assert slow_share([0.01] * 5) == 0.0  # too few steps to say


def test_the_window_share_is_replaced_by_the_previous_epochs():
    fc = Forecast()
    fc.shift_detection = False
    for _ in range(40):
        fc.add_step(0.010, 0.0)
    p = fc.estimate(400, 0, None, 0, slow_share=0.5)  # half a median step more per step, on average
    assert math.isclose(p["rate_s"], 0.015) and math.isclose(p["seconds"], 0.4 + 360 * 0.015)
    # a window with a stall of its own: it counts at the epoch's share, not the window's
    fc.add_step(0.110, 0.0)
    r = fc.rate()
    p = fc.estimate(400, 0, None, 0, slow_share=0.0)
    assert math.isclose(p["rate_s"], r["mean"] - 0.100 / r["steps"])


class Stalls(Callback):
    """Every 100th batch (at 50, 150, ...) the thread waits 200 ms: another process on its core."""

    def __init__(self, cost):
        self.cost = cost

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % 100 == 50:
            self.cost(0.200)


def test_the_second_epoch_is_predicted_with_the_first_epochs_stalls():
    clock = FakeClock()
    cost = Cost(clock)
    sp = StepProfiler(report=False)
    with mock.patch("time.perf_counter", clock):
        model = CostModel(cost, FWD, BWD, OPT)
        t = trainer(max_epochs=2, callbacks=[sp, LoopOverhead(cost, OTHER), Stalls(cost)])
        t.fit(model, loader(BatchDataset(400, cost, 2 * MS)))
    e0, e1 = sp.summary()
    actual = 400 * STEP + 4 * 0.200
    assert math.isclose(e1["epoch_wall_seconds"], actual, rel_tol=1e-9)
    # at 5% (batch 20) no stall has happened: the first epoch misses them
    assert e0["predicted_at_batch"] == 20 and e0["prediction_error_pct"] < -9
    # the second carries the first epoch's: 4 stalls of 200 ms in 399 counted steps
    want = 20 * STEP + 380 * (STEP + 4 * 0.200 / 399)
    assert math.isclose(e1["predicted_epoch_seconds"], want, rel_tol=1e-9)
    assert abs(e1["prediction_error_pct"]) < 0.5
