"""The prediction's charge for an embedding store whose hot tier fills during the epoch (a cold
store's first epoch): the batches' extra cost as the tier fills and after it is full, and a
checkpoint save's extra cost after it, against per-batch references and under a mocked clock."""

from __future__ import annotations

import math
from types import SimpleNamespace
from unittest import mock

from _profiling_helpers import (
    MS,
    ActualWall,
    BatchDataset,
    Cost,
    CostModel,
    FakeClock,
    FakeStore,
    LoopOverhead,
    loader,
    trainer,
)

from lightning_embcache import StepProfiler
from lightning_embcache.profiling import store_fill as fill_model
from lightning_embcache.profiling.forecast import Forecast
from lightning_embcache.profiling.predictor import EpochPredictor, save_batches
from lightning_embcache.profiling.store_fill import StoreFill, store_fill_save_s, store_fill_step_s

FWD, BWD, OPT, OTHER = 5 * MS, 7 * MS, 4 * MS, 1 * MS


def extra_reference(b: int, fill: int, per_batch: float, budget: float) -> float:
    """One batch's extra seconds, written out from the model's definition: the rows the store
    holds over its hot tier's budget (linear in the batch), the filling term capped at a full
    tier, the eviction term from the fill on."""
    held = max(0.0, (budget - per_batch * (fill - b)) / budget)
    cost = per_batch * min(held, 1.0) / fill_model.STORE_FILLING_BYTES_PER_S
    if b >= fill:
        cost += per_batch * held / fill_model.EVICTION_BYTES_PER_S
    return cost


def test_the_step_charge_sums_each_batchs_extra_as_the_tier_fills_and_after():
    fill = StoreFill(150, 2e6, 300e6)  # full at batch 150; empty at batch 0
    for a, b in [(0, 400), (20, 40), (40, 150), (149, 151), (150, 400), (300, 301), (400, 400)]:
        want = math.fsum(extra_reference(i, 150, 2e6, 300e6) for i in range(a, b))
        assert math.isclose(store_fill_step_s(fill, a, b), want, rel_tol=1e-9, abs_tol=1e-12), (a, b)
    # a tier that started part full: nothing below empty is counted
    part = StoreFill(150, 1e6, 300e6)  # empty at batch -150
    assert math.isclose(store_fill_step_s(part, 0, 10), math.fsum(
        extra_reference(i, 150, 1e6, 300e6) for i in range(10)), rel_tol=1e-9)
    # after the fill each batch costs more than the one before: the store holds more rows
    one = [store_fill_step_s(fill, i, i + 1) for i in (100, 149, 150, 250, 399)]
    assert one == sorted(one) and one[2] > one[1]


def test_a_save_after_the_fill_costs_more_the_more_rows_the_store_holds():
    fill = StoreFill(250, 256e3, 64e6)
    assert store_fill_save_s(fill, 249) == 0.0  # before the fill: the save's usual cost only
    assert math.isclose(store_fill_save_s(fill, 250), 64e6 / fill_model.FOLD_BYTES_PER_S)
    held = 1 + 256e3 * 500 / 64e6  # rows held at batch 750 over the tier's
    assert math.isclose(store_fill_save_s(fill, 750), 64e6 * held ** 2 / fill_model.FOLD_BYTES_PER_S)


def _walls(n, base, fill, saves=(), save_s=0.0):
    f, per_batch, budget = fill
    return [base + extra_reference(b, f, per_batch, budget)
            + (save_s + store_fill_save_s(StoreFill(*fill), b) if b in saves else 0.0) for b in range(n)]


def test_the_forecast_charges_what_the_window_has_not_seen_and_no_store_trend():
    fill = (150, 3e6, 450e6)
    walls = _walls(400, 0.020, fill)
    for k in (40, 100, 200, 300):  # before the fill, and after it (the window holds part of it)
        fc = Forecast()
        fc.shift_detection = False  # the window: the later half of the steps so far
        for w in walls[:k]:
            fc.add_step(w, w - 0.020)  # the extra is store time: a trend the model replaces
        p = fc.estimate(400, 0, None, 0, store_fill=StoreFill(*fill))
        assert math.isclose(p["seconds"], math.fsum(walls), rel_tol=1e-9), k
        lo = k // 2
        window = math.fsum(walls[lo:k]) / (k - lo) - 0.020
        assert math.isclose(p["store_fill_s"], math.fsum(walls[k:]) - (400 - k) * (0.020 + window), rel_tol=1e-9)
        assert p["trend_s"] == 0.0
        assert p["std"] >= fill_model.STORE_CHARGE_CV * p["store_fill_s"] > 0  # every step alike but the store's
        # later epochs run at the rate this one ends with
        assert math.isclose(p["end_rate_s"], walls[-1], rel_tol=1e-9)
    # without the charge the same steps predict far too little
    fc = Forecast()
    fc.shift_detection = False
    for w in walls[:40]:
        fc.add_step(w, 0.0)
    assert fc.estimate(400, 0, None, 0)["seconds"] < 0.8 * math.fsum(walls)


def test_saves_after_the_fill_are_charged_from_the_model_before_any_is_measured():
    fill = StoreFill(100, 3e6, 300e6)
    walls = _walls(400, 0.020, (100, 3e6, 300e6), saves=(100, 200, 300), save_s=0.050)
    fc = Forecast()
    fc.shift_detection = False
    for w in walls[:40]:
        fc.add_step(w, 0.0)
    p = fc.estimate(400, 0, None, 3, save_guess_s=0.050, store_fill=fill, save_batches=[100, 200, 300])
    assert math.isclose(p["seconds"], math.fsum(walls), rel_tol=1e-9)
    # once saves after the fill are measured: test_store_fill_measured_rates.py


def test_save_batches_are_the_steps_after_each_checkpoints_optimizer_step():
    t = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(_every_n_train_steps=250)])
    assert save_batches(t, 49, 977, 49, 1) == [250, 500, 750]
    assert save_batches(t, 25, 488, 50, 2) == [50 + (250 - 25) * 2]  # two batches a step
    assert save_batches(SimpleNamespace(checkpoint_callbacks=[]), 0, 1000, 0, 1) == []


def test_a_hot_tier_full_sooner_than_projected_is_charged_from_the_reading_that_saw_it_full():
    readings = iter([(10.0, 100.0), (20.0, 100.0), (100.0, 100.0)])
    ep = EpochPredictor(0.05, 0, None)
    ep.store_reader = lambda: next(readings)
    ep._store_first = (10, ep.store_reader())  # 10 bytes at batch 10, 20 at batch 20: full at 100
    assert ep.store_fill_batch(20, 400) == 100 and ep._fill == StoreFill(100, 1.0, 100.0)
    assert ep.store_fill_batch(50, 400) is None  # full at batch 50 already
    assert ep._fill == StoreFill(50, 1.0, 100.0)  # charged from there, at the bytes per batch it filled with


class ModelStore(FakeStore):
    """A cold store whose hot tier takes `per_batch` bytes a batch up to `budget`, and whose
    batches cost the model's extra on top of 1 ms: what the profiler is asked to foresee."""

    def __init__(self, cost, per_batch, budget):
        super().__init__(cost, 1 * MS)
        self.per_batch, self.budget, self.hot, self.batch = per_batch, budget, 0.0, 0

    def get(self, ids):
        self.seconds = 1 * MS + extra_reference(self.batch, round(self.budget / self.per_batch), self.per_batch,
                                                 self.budget)
        self.hot = min(self.budget, self.hot + self.per_batch)
        self.batch += 1
        return super().get(ids)

    def stats(self):
        return SimpleNamespace(io_wait_seconds=self.io, hot_bytes=self.hot, hot_budget_bytes=self.budget)


def test_a_fit_whose_store_fills_mid_epoch_is_predicted_at_10_percent(tmp_path):
    clock = FakeClock()
    cost = Cost(clock)
    store = ModelStore(cost, 3e6, 150 * 3e6)  # full after 150 batches
    model = CostModel(cost, FWD, BWD, OPT, store_s=1.0)
    model.embedding_stores = {"rows": store}
    sp, wall = StepProfiler(report=False, log_every_n_steps=10, predict_at=0.1), ActualWall()
    logger = mock.Mock()
    logger.save_dir = logger.log_dir = str(tmp_path)
    logger.name, logger.version = "mock", 0
    with mock.patch("time.perf_counter", clock):
        t = trainer(max_epochs=1, callbacks=[wall, sp, LoopOverhead(cost, OTHER)], logger=logger)
        t.fit(model, loader(BatchDataset(400, cost, 2 * MS)))
    e = sp.summary()[0]
    assert e["predicted_at_batch"] == 40 and e["predicted_store_fill_batch"] == 150
    extra = [extra_reference(b, 150, 3e6, 450e6) for b in range(400)]
    # charged: the rest's extra less what the window (batches 20-39) already ran at
    want = math.fsum(extra[40:]) - 360 * math.fsum(extra[20:40]) / 20
    assert math.isclose(e["predicted_store_fill_seconds"], want, rel_tol=1e-6)
    assert abs(e["prediction_error_pct"]) < 0.05, e
    assert math.isclose(e["epoch_wall_seconds"], wall.seconds, rel_tol=1e-9)
    # the +/- holds the model's uncertainty, a large share of the charge
    assert e["predicted_epoch_std_seconds"] >= fill_model.STORE_CHARGE_CV * want
