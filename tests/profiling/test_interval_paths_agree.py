"""Every place that states the prediction's 90% interval states the same drift-widened one: the
logged ``profile/predicted_epoch_low_s``/``high_s``, the summary's ``predicted_epoch_*`` and
``predicted_full_epoch_*``, the end-of-fit table and ``StepProfiler.predict(epoch_batches=N)``.
A fit whose host gets slower half-way through its first epoch: the second epoch's steps are all
alike, so its interval is as wide as the first epoch's drift makes it, not the estimator's
spread (mocked clock, as in test_prediction.py)."""

from __future__ import annotations

import math
from unittest import mock

import pytest
from _profiling_helpers import MS, BatchDataset, Cost, CostModel, FakeClock, LoopOverhead, loader, trainer
from lightning.pytorch.callbacks import Callback

from lightning_embcache import StepProfiler
from lightning_embcache.profiling import forecast

DATA, FWD, BWD, OPT, OTHER = 2 * MS, 5 * MS, 7 * MS, 4 * MS, 1 * MS
STEP = DATA + FWD + BWD + OPT + OTHER  # 19 ms
SLOWER = 5 * MS  # the host's extra time per step from batch 200 of the first epoch on
BATCHES = 400


class HostGetsSlower(CostModel):
    def training_step(self, batch, batch_idx):
        if self.current_epoch > 0 or batch_idx >= BATCHES // 2:
            self.cost(SLOWER)
        return super().training_step(batch, batch_idx)


class AtTrainEnd(Callback):
    def __init__(self, sp: StepProfiler) -> None:
        self.sp = sp

    def on_train_end(self, trainer, pl_module):
        self.full = self.sp.predict(epoch_batches=BATCHES)
        self.own = self.sp.predict()


def _half(p_seconds: float, low: float, high: float) -> float:
    assert math.isclose(high - p_seconds, p_seconds - low, rel_tol=1e-9), (low, p_seconds, high)
    return high - p_seconds


def test_every_path_states_the_drift_widened_interval(tmp_path):
    clock = FakeClock()
    cost = Cost(clock)
    logger = mock.Mock()
    logger.save_dir = logger.log_dir = str(tmp_path)
    logger.name, logger.version = "mock", 0
    sp = StepProfiler(report=False, log_every_n_steps=10)
    probe = AtTrainEnd(sp)
    with mock.patch("time.perf_counter", clock):
        t = trainer(max_epochs=2, max_steps=BATCHES + BATCHES // 2, logger=logger,
                    callbacks=[sp, LoopOverhead(cost, OTHER), probe])
        t.fit(HostGetsSlower(cost, FWD, BWD, OPT), loader(BatchDataset(BATCHES, cost, DATA)))
    first, second = sp.summary()
    # the first epoch drifted: its twentieths' typical step 19 then 24 ms
    drift = forecast.level_spread([STEP] * (BATCHES // 2) + [STEP + SLOWER] * (BATCHES // 2),
                                 forecast.EPOCH_DRIFT_BLOCKS)
    assert drift > forecast.FIRST_EPOCH_DRIFT / 2  # above the floor after one epoch
    rate = STEP + SLOWER  # the second epoch's every step

    # the kept prediction of the second epoch (the summary, the table): at 5% of the 200 batches
    # max_steps leaves it, the rest of it off the rate by as much as the first epoch drifted
    k, target = second["predicted_at_batch"], second["batches"]
    assert (k, target) == (10, 200)
    half = _half(second["predicted_epoch_seconds"], second["predicted_epoch_low_seconds"],
                 second["predicted_epoch_high_seconds"])
    want = math.hypot(forecast.INTERVAL_Z * second["predicted_epoch_std_seconds"], (target - k) * rate * drift)
    assert half == pytest.approx(want, rel=1e-6)
    assert half > 1.2 * forecast.INTERVAL_Z * second["predicted_epoch_std_seconds"]  # the drift widens it
    low, high = second["predicted_epoch_low_seconds"], second["predicted_epoch_high_seconds"]
    assert f"{low:.2f}-{high:.2f}" in sp.report_table()

    # the interval logged at the batch the kept prediction was made at is the same one
    logged = [c.kwargs["metrics"] for c in logger.log_metrics.call_args_list
              if c.kwargs["step"] == BATCHES + k and "profile/predicted_epoch_s" in c.kwargs["metrics"]]
    assert len(logged) == 1
    m = logged[0]
    assert m["profile/predicted_epoch_s"] == pytest.approx(second["predicted_epoch_seconds"], rel=1e-9)
    assert m["profile/predicted_epoch_low_s"] == pytest.approx(low, rel=1e-9)
    assert m["profile/predicted_epoch_high_s"] == pytest.approx(high, rel=1e-9)

    # predict(epoch_batches=400) at the end of the cut epoch, and the summary's full epoch: one
    # interval, widened by the drift over the 200 batches the epoch did not run
    full = probe.full
    assert full["at_batch"] == target and full["epoch_batches"] == BATCHES
    half_full = _half(full["epoch_s"], full["epoch_low_s"], full["epoch_high_s"])
    want_full = math.hypot(forecast.INTERVAL_Z * full["epoch_std_s"], (BATCHES - target) * rate * drift)
    assert half_full == pytest.approx(want_full, rel=1e-6)
    assert second["predicted_full_epoch_seconds"] == pytest.approx(full["epoch_s"], rel=1e-9)
    assert second["predicted_full_epoch_low_seconds"] == pytest.approx(full["epoch_low_s"], rel=1e-9)
    assert second["predicted_full_epoch_high_seconds"] == pytest.approx(full["epoch_high_s"], rel=1e-9)
    assert (f"90% interval {full['epoch_low_s']:.1f}-{full['epoch_high_s']:.1f} s"
            in sp.report_table())
    # the epoch's own length: nothing left to go, nothing to widen
    assert probe.own["epoch_high_s"] - probe.own["epoch_low_s"] < 1e-9
    # the first epoch: no earlier epoch, the host-clock floor on the drift
    half0 = _half(first["predicted_epoch_seconds"], first["predicted_epoch_low_seconds"],
                  first["predicted_epoch_high_seconds"])
    k0 = first["predicted_at_batch"]
    assert half0 == pytest.approx((BATCHES - k0) * STEP * forecast.FIRST_EPOCH_DRIFT, rel=1e-6)
