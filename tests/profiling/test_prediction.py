"""The epoch-time prediction against the epochs' actual wall time, under a mocked clock
(``time.perf_counter`` patched as Lightning's own tests do), with the exact logged keys."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from _profiling_helpers import MS, BatchDataset, Cost, CostModel, FakeClock, FakeStore, LoopOverhead, loader, trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_embcache import StepProfiler
from lightning_embcache.profiling import PHASES, forecast, schedule
from lightning_embcache.profiling.forecast import Forecast

DATA, FWD, BWD, OPT, OTHER = 2 * MS, 5 * MS, 7 * MS, 4 * MS, 1 * MS
STEP = DATA + FWD + BWD + OPT + OTHER  # 19 ms
PRED_KEYS = {"profile/predicted_epoch_s", "profile/predicted_epoch_std_s", "profile/predicted_epoch_low_s",
             "profile/predicted_epoch_high_s"}
FIT_KEYS = {"profile/predicted_fit_s", "profile/predicted_fit_std_s", "profile/predicted_fit_low_s",
            "profile/predicted_fit_high_s"}
INTERVAL_KEYS = {f"profile/{p}_ms" for p in PHASES} | {
    "profile/step_ms", "profile/step_max_ms", "profile/slowest_rank", "profile/rank_spread_pct",
    "profile/samples_per_sec"}


class WarmLoader(BatchDataset):
    """Each epoch's first batch costs `first_s` more (iterator creation, worker start-up)."""

    def __init__(self, n, cost, data_s, first_s):
        super().__init__(n, cost, data_s)
        self.first_s = first_s

    def __getitem__(self, i):
        if i == 0:
            self.cost(self.first_s)
        return super().__getitem__(i)


class SaveCost(Callback):
    """A checkpoint save costs `seconds` (standing in for writing the file)."""

    def __init__(self, cost, seconds):
        self.cost, self.seconds, self.saves = cost, seconds, 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saves += 1
        self.cost(self.seconds)


class ActualWall(Callback):
    """Independent reference: each epoch's wall time, validation inside it included."""

    def __init__(self):
        self.epochs = []

    def on_train_epoch_start(self, *args):
        import time

        self.t0 = time.perf_counter()

    def on_train_epoch_end(self, *args):
        import time

        self.epochs.append(time.perf_counter() - self.t0)


def _logger(tmp_path):
    logger = mock.Mock()
    logger.save_dir = logger.log_dir = str(tmp_path)
    logger.name, logger.version = "mock", 0
    return logger


def _fit(sp, batches, epochs=1, first_s=0.0, model=None, clock=None, val_batches=0, extra=(), **kw):
    clock = clock or FakeClock()
    cost = Cost(clock)
    wall = ActualWall()
    with mock.patch("time.perf_counter", clock):
        model = model or CostModel(cost, FWD, BWD, OPT, val_s=3 * MS)
        model.cost = cost
        t = trainer(max_epochs=epochs, callbacks=[wall, sp, LoopOverhead(cost, OTHER), *extra], **kw)
        val = loader(BatchDataset(val_batches, cost, 0.0)) if val_batches else None
        t.fit(model, loader(WarmLoader(batches, cost, DATA, first_s)), val)
    return t, wall, cost


def _close(a, b, rel=1e-9):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def test_prediction_after_5_percent_matches_the_epoch_and_fit_and_is_logged(tmp_path):
    logger = _logger(tmp_path)
    sp = StepProfiler(report=False, log_every_n_steps=10)
    _, wall, _ = _fit(sp, batches=200, epochs=2, first_s=150 * MS, logger=logger)
    s = sp.summary()
    for e, actual in zip(s, wall.epochs):
        # the first batch's loader start-up is counted once, the rate is the steady steps'
        assert _close(actual, 200 * STEP + 0.150)
        assert _close(e["epoch_wall_seconds"], actual)
        assert e["predicted_at_batch"] == 10  # 5% of 200
        assert _close(e["predicted_epoch_seconds"], actual), e
        assert abs(e["prediction_error_pct"]) < 1e-6
        assert e["predicted_epoch_std_seconds"] < 1e-6  # every step alike: no spread
    # epoch 0's early prediction of the whole fit: the second epoch pays the loader start-up again
    assert _close(s[0]["predicted_fit_seconds"], sum(wall.epochs))
    assert _close(s[1]["predicted_fit_seconds"], sum(wall.epochs))
    calls = [c.kwargs for c in logger.log_metrics.call_args_list
             if any(k.startswith("profile/") for k in c.kwargs["metrics"])]
    assert [c["step"] for c in calls] == list(range(10, 401, 10))
    for c in calls:
        assert set(c["metrics"]) == INTERVAL_KEYS | PRED_KEYS | FIT_KEYS, c
        assert _close(c["metrics"]["profile/predicted_epoch_s"], wall.epochs[0])
        assert _close(c["metrics"]["profile/predicted_fit_s"], sum(wall.epochs))


def test_no_prediction_before_enough_steps_and_no_fit_keys_without_a_limit(tmp_path):
    logger = _logger(tmp_path)
    sp = StepProfiler(report=False, log_every_n_steps=4)

    class StopAfterOneEpoch(Callback):
        def on_train_epoch_end(self, trainer, *args):
            trainer.should_stop = True

    _fit(sp, batches=24, epochs=-1, logger=logger, extra=(StopAfterOneEpoch(),))
    calls = [c.kwargs["metrics"] for c in logger.log_metrics.call_args_list
             if any(k.startswith("profile/") for k in c.kwargs["metrics"])]
    # steps 4 and 8: fewer than 9 steps seen; from 12 on the epoch is predicted, the fit is not
    assert set(calls[0]) == set(calls[1]) == INTERVAL_KEYS
    for m in calls[2:6]:
        assert set(m) == INTERVAL_KEYS | PRED_KEYS


def test_max_steps_ends_the_predicted_epoch_early():
    sp = StepProfiler(report=False)
    _, wall, _ = _fit(sp, batches=400, epochs=3, max_steps=300)
    e = sp.summary()[0]
    assert e["batches"] == 300 and e["epoch_batches"] == 400
    assert _close(e["predicted_epoch_seconds"], wall.epochs[0]) and e["predicted_at_batch"] == 15
    assert _close(e["predicted_fit_seconds"], wall.epochs[0])


def test_a_run_stopped_early_predicts_the_full_epoch_it_did_not_run(tmp_path):
    """`predict(epoch_batches=...)` at the end of a run that `max_steps` cut short gives what a
    whole epoch takes, with the checkpoint saves a whole epoch would have: against a real whole
    epoch of the same loop. Without the argument the prediction is of the cut epoch."""

    class AtTrainEnd(Callback):
        def on_train_end(self, trainer, pl_module):
            self.full = sp.predict(epoch_batches=400)
            self.own = sp.predict()

    clock = FakeClock()
    sp, probe = StepProfiler(report=False), AtTrainEnd()
    saves = SaveCost(Cost(clock), 0.5)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=100, save_top_k=-1)
    _, wall, _ = _fit(sp, batches=400, epochs=1, first_s=150 * MS, clock=clock, max_steps=150,
                      enable_checkpointing=True, extra=(saves, ckpt, probe))
    assert saves.saves == 1 and _close(probe.own["epoch_s"], wall.epochs[0])
    clock = FakeClock()
    saves = SaveCost(Cost(clock), 0.5)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=100, save_top_k=-1)
    sp_whole = StepProfiler(report=False)
    _, whole, _ = _fit(sp_whole, batches=400, epochs=1, first_s=150 * MS, clock=clock,
                       enable_checkpointing=True, extra=(saves, ckpt))
    assert saves.saves == 4 and sp_whole.summary()[0]["predicted_full_epoch_seconds"] is None
    assert probe.full["epoch_batches"] == 400 and probe.full["at_batch"] == 150
    assert _close(probe.full["epoch_s"], whole.epochs[0], rel=1e-6), (probe.full["epoch_s"], whole.epochs[0])
    assert probe.full["epoch_s"] > 400 / 150 * wall.epochs[0]  # not the rate so far times the batches
    # the cut epoch's summary and the end-of-fit table carry the same prediction
    e = sp.summary()[0]
    assert e["batches"] == 150 and _close(e["predicted_full_epoch_seconds"], probe.full["epoch_s"])
    assert e["predicted_full_epoch_std_seconds"] is not None
    assert (f"a full epoch (400 batches): predicted {probe.full['epoch_s']:.1f} s (90% interval "
            f"{e['predicted_full_epoch_low_seconds']:.1f}-{e['predicted_full_epoch_high_seconds']:.1f} s)"
            ) in sp.report_table()
    assert e["predicted_full_epoch_low_seconds"] <= whole.epochs[0] <= e["predicted_full_epoch_high_seconds"]


def test_validation_runs_are_predicted_from_the_sanity_check():
    sp = StepProfiler(report=False)
    # 4 validation runs of 5 batches (3 ms each) inside each epoch; the sanity check ran 2 batches
    _, wall, _ = _fit(sp, batches=200, epochs=2, val_batches=5, val_check_interval=50, num_sanity_val_steps=2)
    for e, actual in zip(sp.summary(), wall.epochs):
        assert _close(e["val_seconds"], 4 * 5 * 3 * MS)
        assert _close(actual, 200 * STEP + 4 * 5 * 3 * MS)
        assert _close(e["predicted_epoch_seconds"], actual), e  # no run had been seen at batch 10
    assert _close(sp.summary()[0]["predicted_fit_seconds"], sum(wall.epochs))


def test_checkpoint_saves_are_kept_out_of_the_rate_and_charged_per_save(tmp_path):
    clock = FakeClock()
    saves = SaveCost(Cost(clock), 40 * MS)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=50, save_top_k=-1)
    sp = StepProfiler(report=False, predict_at=0.3)  # at batch 60: the save at step 50 measured
    _, wall, _ = _fit(sp, batches=200, epochs=1, clock=clock, extra=(ckpt, saves), enable_checkpointing=True)
    e = sp.summary()[0]
    assert saves.saves == 4
    assert _close(wall.epochs[0], 200 * STEP + 4 * 0.040)
    assert e["predicted_at_batch"] == 60
    assert _close(e["predicted_epoch_seconds"], wall.epochs[0]), e


def test_a_save_measured_in_one_epoch_is_charged_in_the_next(tmp_path):
    clock = FakeClock()
    saves = SaveCost(Cost(clock), 40 * MS)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=50, save_top_k=-1)
    sp = StepProfiler(report=True)  # at 5% (batch 10) no save of the epoch has happened yet
    _, wall, _ = _fit(sp, batches=200, epochs=2, clock=clock, extra=(ckpt, saves), enable_checkpointing=True)
    first, second = sp.summary()
    assert first["predicted_unmeasured_saves"] == 4
    # none measured yet: each charged at the estimate for the 9 float32 parameters of the model
    guess = forecast.SAVE_FIXED_S + 9 * 4 / forecast.SAVE_BYTES_PER_S
    assert _close(first["predicted_epoch_seconds"], wall.epochs[0] - 4 * 0.040 + 4 * guess)
    assert second["predicted_unmeasured_saves"] == 0
    assert _close(second["predicted_epoch_seconds"], wall.epochs[1]), second
    assert "charges those at an estimate from the bytes a save writes" in sp.report_table()


class BigModel(CostModel):
    """A CostModel with 1M more float32 parameters and Adam (two moments and a step per tensor)."""

    def __init__(self, cost):
        super().__init__(cost, FWD, BWD, OPT)
        self.big = torch.nn.Parameter(torch.zeros(1000, 1000))

    def _loss(self, batch):
        return super()._loss(batch) + 0.0 * self.big.sum()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_an_unmeasured_save_is_charged_at_the_bytes_it_writes(tmp_path):
    clock = FakeClock()
    cost = Cost(clock)
    # parameters (1,000,000 + 9 floats), Adam's exp_avg and exp_avg_sq of each, one step scalar per tensor
    nbytes = 3 * (1_000_000 + 9) * 4 + 3 * 4
    per_save = forecast.save_estimate_s(nbytes)
    assert _close(per_save, forecast.SAVE_FIXED_S + nbytes / forecast.SAVE_BYTES_PER_S)
    saves = SaveCost(cost, per_save)  # a save that takes exactly the estimate
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=50, save_top_k=-1)
    sp = StepProfiler(report=False)  # at 5% (batch 10): the first save comes at step 50
    with mock.patch("time.perf_counter", clock):
        model = BigModel(cost)
    t, wall, _ = _fit(sp, batches=200, epochs=1, clock=clock, model=model, extra=(ckpt, saves),
                      enable_checkpointing=True)
    assert schedule.checkpoint_bytes(t) == nbytes
    e = sp.summary()[0]
    assert saves.saves == 4 and e["predicted_at_batch"] == 10 and e["predicted_unmeasured_saves"] == 4
    assert _close(e["predicted_epoch_seconds"], wall.epochs[0]), e
    # the estimate's uncertainty: half of what the unmeasured saves were charged
    assert e["predicted_epoch_std_seconds"] >= 0.5 * 4 * per_save * (1 - 1e-9)


def test_a_warming_store_tier_trend_is_carried_on():
    clock = FakeClock()
    cost = Cost(clock)

    class WarmingStore(FakeStore):
        """A cold tier warming up: 12 ms per step falling by 0.25 ms a step to 2 ms, then level."""

        def __init__(self):
            super().__init__(cost, 0.0)
            self.calls = 0

        def get(self, ids):
            self.seconds = max(2 * MS, 12 * MS - 0.25 * MS * self.calls)
            self.calls += 1
            return super().get(ids)

    model = CostModel(cost, FWD, BWD, OPT, store_s=1.0)
    model.embedding_stores = {"rows": WarmingStore()}
    sp = StepProfiler(report=False, predict_at=0.1)  # at batch 20 of 200: halfway down the slope
    _, wall, _ = _fit(sp, batches=200, epochs=1, clock=clock, model=model)
    e = sp.summary()[0]
    actual = wall.epochs[0]
    assert e["predicted_at_batch"] == 20
    store_ms = [max(2.0, 12.0 - 0.25 * c) for c in range(200)]
    assert _close(actual, 200 * STEP + sum(store_ms) * MS)
    # without the trend, the mean of steps 10-19 taken as the rate would give +25%; with it, within 3%
    naive = 20 * STEP + sum(store_ms[:20]) * MS + 180 * (STEP + sum(store_ms[10:20]) / 10 * MS)
    assert naive / actual - 1 > 0.2
    assert abs(e["prediction_error_pct"]) < 3.0, e
    assert e["predicted_epoch_std_seconds"] > 0


def test_forecast_spread_gives_the_uncertainty():
    f = Forecast()
    f.add_step(0.5, 0.0)  # the loader's start-up
    for i in range(99):
        f.add_step(0.010 if i % 2 else 0.012, 0.0)
    p = f.estimate(1000, 0, None, 0)
    assert _close(p["rate_s"], 0.011, rel=1e-3)
    assert _close(p["seconds"], f.elapsed + 900 * p["rate_s"])
    # 900 steps to go, each +/-1 ms around the rate: sqrt(900) * 1 ms plus the rate's standard error
    assert 0.03 <= p["std"] <= 0.2, p
    assert p["unmeasured_saves"] == 0
    f.mark_save()
    f.add_step(0.2, 0.0)
    p = f.estimate(1000, 0, None, 3)
    assert p["unmeasured_saves"] == 0 and p["rate"]["save_s"] > 0.18
    assert Forecast().estimate(100, 0, None, 0) is None


@pytest.mark.parametrize("level", ["WARNING", "ERROR"])
def test_the_table_reaches_the_user_with_logging_at_warning(level, capsys):
    import logging

    lg = logging.getLogger("lightning.pytorch")
    old = lg.level
    lg.setLevel(level)
    try:
        sp = StepProfiler()
        _fit(sp, batches=40, epochs=1)
    finally:
        lg.setLevel(old)
    out = capsys.readouterr().out
    assert "data_wait" in out and "dominant phase" in out and "predicted s" in out
    assert sp.report_table() in out


def test_on_a_gpu_the_device_rate_and_backlog_are_used():
    # the host launches a step in 1 ms and runs ahead; the GPU needs 10 ms a step
    f = Forecast()
    for i in range(100):
        f.add_step(0.001, 0.0)
    for i in range(1, 70, 3):  # sampled steps the GPU has finished
        f.add_device_step(i, 0.010)
    f.backlog = 30  # steps 70..99 launched, not yet run
    f.needs_device = True
    p = f.estimate(1000, 0, None, 0)
    assert p["rate"]["device"] and _close(p["rate_s"], 0.010)
    assert _close(p["seconds"], 0.1 + (900 + 30) * 0.010)


def test_on_a_gpu_no_prediction_before_the_device_has_timed_a_few_steps():
    f = Forecast()
    f.needs_device = True
    for i in range(100):
        f.add_step(0.001, 0.0)
    f.add_device_step(3, 0.010)
    f.add_device_step(9, 0.010)
    assert f.estimate(1000, 0, None, 0) is None  # the host's 1 ms steps only say how fast it queues
    f.add_device_step(17, 0.010)
    assert f.estimate(1000, 0, None, 0) is not None


def _device_bound_epoch_start(f: Forecast, steps: int = 100) -> None:
    """A step the GPU sets at 14 ms: the host first runs ahead of it (steps of 9 ms, every fourth
    15 ms, while the launch queue fills), then waits for it (14 ms); every eighth step timed on
    the device, 14 ms +/- 0.02."""
    for i in range(steps):
        f.add_step(0.4 if i == 0 else (0.015 if i % 4 == 0 else 0.009) if i < 45 else 0.014, 0.0)
    for j, i in enumerate(range(3, steps, 8)):
        f.add_device_step(i, 0.014 + (0.00002 if j % 2 else -0.00002))
    f.needs_device = True


def test_on_a_gpu_the_uncertainty_comes_from_the_device_not_the_host_running_ahead():
    f = Forecast()
    _device_bound_epoch_start(f)
    p = f.estimate(2000, 0, None, 0)
    assert p["rate"]["device"] and _close(p["rate_s"], 0.014, rel=1e-3)
    # the host's steps so far vary by ~20% (run-ahead), which said nothing of the epoch to come:
    # the +/- is the device's spread plus how far a device-timed rate is from the host's steps
    rel = p["std"] / p["seconds"]
    assert forecast.DEVICE_RATE_CV * 0.9 < rel < 2 * forecast.DEVICE_RATE_CV
    assert forecast.level_variation_so_far(f.wall) > 0.1  # what the +/- was taken from before


def test_a_measured_save_still_to_come_carries_its_spread():
    f = Forecast()
    for i in range(100):
        f.add_step(0.010, 0.0)
    with_saves = f.estimate(1000, 0, None, 4, save_s=2.0)
    without = f.estimate(1000, 0, None, 0)
    assert _close(with_saves["seconds"] - without["seconds"], 8.0)
    assert _close(with_saves["std"] ** 2 - without["std"] ** 2, (forecast.SAVE_MEASURED_CV * 8.0) ** 2, rel=1e-6)


def test_the_sanity_checks_one_time_set_up_is_not_taken_for_the_cost_of_validation():
    clock = FakeClock()
    cost = Cost(clock)

    class FirstEvalKernels(Callback):  # the first validation batch ever pays 200 ms of set-up
        def __init__(self):
            self.paid = False

        def on_validation_batch_start(self, *args):
            if not self.paid:
                self.paid = True
                cost(0.200)

    sp = StepProfiler(report=False)
    _, wall, _ = _fit(sp, batches=200, epochs=1, clock=clock, val_batches=5, val_check_interval=50,
                      num_sanity_val_steps=2, extra=(FirstEvalKernels(),))
    e = sp.summary()[0]
    assert _close(e["predicted_epoch_seconds"], wall.epochs[0]), e


class SlowStart(CostModel):
    """Forward costs `slow_s` more for the first `slow_steps` batches of every epoch: a warm-up
    (allocator, caches, the loader filling its queue) longer than half the steps seen at 5%."""

    def __init__(self, cost, slow_steps, slow_s):
        super().__init__(cost, FWD, BWD, OPT)
        self.slow_steps, self.slow_s = slow_steps, slow_s

    def training_step(self, batch, batch_idx):
        if batch_idx < self.slow_steps:
            self.cost(self.slow_s)
        return super().training_step(batch, batch_idx)


def test_a_warm_up_longer_than_half_the_steps_seen_is_left_out_of_the_rate():
    clock = FakeClock()
    model = SlowStart(Cost(clock), slow_steps=70, slow_s=20 * MS)
    sp = StepProfiler(report=False)  # predicts after 5% of 2,000 batches: at batch 100
    _, wall, _ = _fit(sp, batches=2000, epochs=1, clock=clock, model=model)
    e = sp.summary()[0]
    actual = wall.epochs[0]
    assert _close(actual, 2000 * STEP + 70 * 20 * MS)
    assert e["predicted_at_batch"] == 100
    # the later half of the steps seen (50-99) holds 20 slow ones: taken as the rate, +26%
    naive = 100 * STEP + 70 * 20 * MS + 1900 * (STEP + 20 / 50 * 20 * MS)
    assert naive / actual - 1 > 0.25
    # the level shift at batch 70 is found: the rate is that of the steps after it
    assert abs(e["prediction_error_pct"]) < 0.01, e


def test_a_level_shift_mid_epoch_sets_the_rate_once_it_has_lasted_three_blocks():
    f = Forecast()
    f.add_step(0.5, 0.0)
    for _ in range(399):
        f.add_step(0.010, 0.0)
    for _ in range(100):  # a store's hot tier is full from here on: every step evicts
        f.add_step(0.030, 0.030)
    p = f.estimate(1000, 0, None, 0)
    assert p["rate"]["shifted"] and p["rate"]["window_start"] >= 400
    assert _close(p["rate_s"], 0.030)
    assert _close(p["seconds"], 0.5 + 399 * 0.010 + 600 * 0.030)
    # before the new level has lasted three blocks of the steps, it does not count yet
    g = Forecast()
    g.add_step(0.5, 0.0)
    for _ in range(399):
        g.add_step(0.010, 0.0)
    for _ in range(20):
        g.add_step(0.030, 0.0)
    assert not g.rate()["shifted"]


def test_no_level_shift_is_found_in_noise():
    import numpy as np

    from lightning_embcache.profiling.forecast import level_shift

    rng = np.random.default_rng(0)
    found = 0
    for _ in range(200):
        # 10 ms steps with a heavy tail: 2% of them 3x slower
        w = rng.normal(0.010, 0.001, 2000)
        w[rng.random(2000) < 0.02] *= 3
        found += level_shift(w) is not None
    assert found <= 2, found  # a false shift in at most 1% of epochs
    w = np.r_[np.full(1000, 0.010), np.full(1000, 0.011)] + rng.normal(0, 0.0005, 2000)
    assert level_shift(w) == 1000  # a 10% shift, found at its block boundary


def test_a_hot_tier_filling_before_the_epoch_ends_is_reported_with_the_prediction(tmp_path):
    from types import SimpleNamespace

    clock = FakeClock()
    cost = Cost(clock)

    class FillingStore(FakeStore):
        """A cold store whose hot tier takes 1,000 bytes per batch up to a 150,000-byte budget,
        after which each get also evicts rows: 10 ms more per batch."""

        def __init__(self):
            super().__init__(cost, 1 * MS)
            self.hot = 0
            self.stats_calls = 0

        def get(self, ids):
            self.hot = min(150_000, self.hot + 1_000)
            self.seconds = (11 if self.hot >= 150_000 else 1) * MS
            return super().get(ids)

        def stats(self):
            self.stats_calls += 1
            return SimpleNamespace(io_wait_seconds=self.io, hot_bytes=self.hot, hot_budget_bytes=150_000)

    store = FillingStore()
    model = CostModel(cost, FWD, BWD, OPT, store_s=1.0)
    model.embedding_stores = {"rows": store}
    sp = StepProfiler(report=False, log_every_n_steps=10, predict_at=0.1)
    _, wall, _ = _fit(sp, batches=400, epochs=1, clock=clock, model=model, logger=_logger(tmp_path))
    e = sp.summary()[0]
    assert e["predicted_at_batch"] == 40
    # the fill at batch 150 (the 150th get) is projected from the growth between batches 20 and 40
    assert e["predicted_store_fill_batch"] == 150
    # the prediction itself knows only the cheap batches: short by the evictions to come
    assert e["prediction_error_pct"] < -20
    assert "hot tiers fill up, at about batch 150" in sp.report_table()
    # stats() read twice for it (and by the io_wait fallback of stores without io_wait_seconds)
    assert store.stats_calls >= 2
    # after the fill has lasted three blocks the rate is the new level's: right again
    p_late = None

    class Late(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            nonlocal p_late
            if batch_idx == 300:
                p_late = sp2.predict()

    sp2 = StepProfiler(report=False)
    store2 = FillingStore()
    model2 = CostModel(cost, FWD, BWD, OPT, store_s=1.0)
    model2.embedding_stores = {"rows": store2}
    _, wall2, _ = _fit(sp2, batches=400, epochs=1, clock=clock, model=model2, extra=[Late()])
    assert p_late is not None and p_late["store_fill_batch"] is None  # already full
    assert abs(p_late["epoch_s"] / wall2.epochs[0] - 1) < 0.01, (p_late, wall2.epochs)


def test_step_times_pending_for_the_forecast_stay_bounded_without_a_logger():
    from lightning_embcache.profiling.predictor import SYNC_EVERY

    sp = StepProfiler(report=False, predict_at=0.01)
    most = 0

    class Watch(Callback):
        def on_train_batch_end(self, *args):
            nonlocal most
            most = max(most, len(sp._predictor._hosts))

    _, wall, _ = _fit(sp, batches=1200, epochs=1, extra=[Watch()])
    assert 0 < most <= SYNC_EVERY
    # every step reached the forecast by the epoch's end
    assert sp._predictor.forecast.batches == 1200
    assert _close(sp.summary()[0]["predicted_epoch_seconds"], wall.epochs[0])


class Alternating(CostModel):
    """Forward costs `slow_s` more in every other block of `block` batches: a host whose speed
    switches between two levels for stretches longer than the first 5% of an epoch."""

    def __init__(self, cost, block, slow_s):
        super().__init__(cost, FWD, BWD, OPT)
        self.block, self.slow_s = block, slow_s

    def training_step(self, batch, batch_idx):
        if (batch_idx // self.block) % 2:
            self.cost(self.slow_s)
        return super().training_step(batch, batch_idx)


def test_level_changes_seen_in_an_earlier_epoch_widen_the_uncertainty():
    from lightning_embcache.profiling.forecast import level_variation

    clock = FakeClock()
    sp = StepProfiler(report=False)
    _, wall, _ = _fit(sp, batches=1000, epochs=2, clock=clock, model=Alternating(Cost(clock), 50, 5 * MS))
    first, second = sp.summary()
    for e, actual in zip((first, second), wall.epochs):
        assert _close(actual, 1000 * STEP + 500 * 5 * MS)
        # after 5% (50 batches, all fast) the rate misses the slow half of the epoch to come
        assert e["prediction_error_pct"] < -10
    # epoch 0 knew nothing of the host's levels: its +/- is that of 50 identical batches
    assert first["predicted_epoch_std_seconds"] < 1e-6
    # epoch 1 carries epoch 0's level variation (block medians 19 and 24 ms: 12%) into its +/-
    cv = level_variation([0.0] + [STEP + (5 * MS if (i // 50) % 2 else 0.0) for i in range(999)])
    assert 0.10 < cv < 0.14
    miss = abs(second["predicted_epoch_seconds"] - wall.epochs[1])
    assert second["predicted_epoch_std_seconds"] > 0.5 * miss
    assert miss <= 2 * second["predicted_epoch_std_seconds"]


def test_a_first_epoch_whose_steps_so_far_changed_speed_says_so_in_its_uncertainty():
    from lightning_embcache.profiling.forecast import level_variation_so_far

    clock = FakeClock()
    sp = StepProfiler(report=False, predict_at=0.1)
    # 100 fast batches, then 100 slow ones, and so on: the first 200 batches see one switch
    _, wall, _ = _fit(sp, batches=2000, epochs=1, clock=clock, model=Alternating(Cost(clock), 100, 5 * MS))
    e = sp.summary()[0]
    actual = wall.epochs[0]
    assert _close(actual, 2000 * STEP + 1000 * 5 * MS)
    assert e["predicted_at_batch"] == 200
    # the rate is the new (slow) level's, its 100 batches all alike; the epoch averages both levels
    miss = e["predicted_epoch_seconds"] - actual
    assert _close(miss, 1800 * 2.5 * MS, rel=1e-6)
    # the steps so far switched between 19 and 24 ms (block medians: ~12% variation), which the
    # +/- carries to the batches to go: the actual time lies within it (the window's batches
    # alone, all alike, gave a +/- of nothing)
    cv = level_variation_so_far([0.0] + [STEP + (5 * MS if (i // 100) % 2 else 0.0) for i in range(199)])
    assert 0.10 < cv < 0.14
    assert miss <= 2 * e["predicted_epoch_std_seconds"] <= 4 * miss


class _SlowerAfter(CostModel):
    """The host gets 30% slower (forward costs more) after the first `k` batches of the fit."""

    def __init__(self, cost, k):
        super().__init__(cost, FWD, BWD, OPT)
        self.k, self.seen = k, 0

    def training_step(self, batch, batch_idx):
        self.seen += 1
        if self.seen > self.k:
            self.cost(0.3 * STEP)
        return super().training_step(batch, batch_idx)


def test_the_fits_interval_holds_a_level_shift_after_5_percent_of_the_first_epoch():
    """The whole fit predicted at 5% of its first epoch: the point cannot know the host slows
    down right after, but the 90% interval widens by the drift floor over every step still to
    come (this epoch's and the next's), so the actual fit lies inside; the estimator's own
    spread (every step alike so far) would have said +/- 0."""
    clock = FakeClock()
    model = _SlowerAfter(Cost(clock), k=10)
    sp = StepProfiler(report=False)
    _, wall, _ = _fit(sp, batches=200, epochs=2, model=model, clock=clock)
    first = sp.summary()[0]
    assert first["predicted_at_batch"] == 10
    actual = sum(wall.epochs)
    assert first["predicted_fit_std_seconds"] < 1e-6
    assert first["predicted_fit_seconds"] < 0.9 * actual  # the point misses the slow-down
    assert first["predicted_fit_low_seconds"] <= actual <= first["predicted_fit_high_seconds"], first
