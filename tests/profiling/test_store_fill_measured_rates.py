"""The store charge's rates measured in the run: the stores' flushes, write-back and compaction
seconds replace the cost model's constants once enough was measured (the charge then follows the
host), the constants stay the fallback, and the stores are read no more often for it."""

from __future__ import annotations

import math
from types import SimpleNamespace
from unittest import mock

from _profiling_helpers import MS, ActualWall, BatchDataset, Cost, CostModel, FakeClock, LoopOverhead, loader, trainer

from lightning_embcache import StepProfiler
from lightning_embcache.profiling import store_fill as model
from lightning_embcache.profiling.forecast import Forecast
from lightning_embcache.profiling.predictor import EpochPredictor
from lightning_embcache.profiling.store_fill import StoreFill, StoreRates, fold_bytes, measured_rates, store_fill_step_s
from lightning_embcache.profiling.stores import HotTiers, StoreReadings

FWD, BWD, OPT, OTHER = 5 * MS, 7 * MS, 4 * MS, 1 * MS
MiB = 1 << 20


def extra_reference(b: int, fill: int, per_batch: float, budget: float, filling: float, eviction: float) -> float:
    """One batch's extra seconds from the model's definition, at the given rates (bytes/s)."""
    held = max(0.0, (budget - per_batch * (fill - b)) / budget)
    cost = per_batch * min(held, 1.0) / filling
    if b >= fill:
        cost += per_batch * held / eviction
    return cost


def reading(flushed=0.0, flush_s=0.0, evicted=0.0, write_back_s=0.0, compaction_s=0.0) -> HotTiers:
    return HotTiers(50e6, 100e6, flushed, flush_s, evicted, write_back_s, compaction_s, 256)


def test_a_host_that_flushes_and_folds_4x_faster_is_charged_a_quarter():
    fill = StoreFill(150, 2e6, 300e6)
    fast_flush = 4 * model.STORE_FILLING_BYTES_PER_S * model.FILLING_SHARE  # what the stores measured
    # evictions so far: batches 150-199 at levels 1 .. level(200), 4x faster than the host the
    # constants came from, split between write-back and compaction
    evicted = 50 * 2e6
    level = (1.0 + fill.level(199)) / 2.0
    seconds = evicted * level / (4 * model.EVICTION_BYTES_PER_S * model.EVICTION_SHARE)
    r = measured_rates(reading(64 * MiB, 64 * MiB / fast_flush, evicted, 0.25 * seconds, 0.75 * seconds), fill, 200)
    assert math.isclose(r.filling_bytes_per_s, 4 * model.STORE_FILLING_BYTES_PER_S)
    assert math.isclose(r.eviction_bytes_per_s, 4 * model.EVICTION_BYTES_PER_S)
    measured = fill._replace(rates=r)
    for a, b in [(0, 400), (40, 150), (150, 400), (300, 301)]:
        want = math.fsum(extra_reference(i, 150, 2e6, 300e6, 4 * model.STORE_FILLING_BYTES_PER_S,
                                         4 * model.EVICTION_BYTES_PER_S) for i in range(a, b))
        assert math.isclose(store_fill_step_s(measured, a, b), want, rel_tol=1e-9), (a, b)
        assert math.isclose(store_fill_step_s(measured, a, b), store_fill_step_s(fill, a, b) / 4, rel_tol=1e-9)
    # the eviction term over the batches so far sums to the measured seconds' share
    eviction_only = StoreFill(150, 2e6, 300e6, StoreRates(math.inf, r.eviction_bytes_per_s))
    assert math.isclose(store_fill_step_s(eviction_only, 150, 200), model.EVICTION_SHARE * seconds, rel_tol=1e-9)


def test_the_constants_stay_until_enough_is_measured():
    fill = StoreFill(150, 2e6, 300e6)
    assert measured_rates(reading(), fill, 40) is None  # nothing written yet (a cold store at 5%)
    # flushed, but less than MEASURED_MIN_BYTES: still the constant
    assert measured_rates(reading(model.MEASURED_MIN_BYTES - 1, 0.01), fill, 40) is None
    # evictions with write-back alone (compaction not yet run): no eviction rate
    r = measured_rates(reading(64 * MiB, 0.2, 64 * MiB, 0.05, 0.0), fill, 200)
    assert r.filling_bytes_per_s is not None and r.eviction_bytes_per_s is None
    # before the fill, evicted bytes (a store that evicted earlier) say nothing of this fill
    assert measured_rates(reading(0, 0, 64 * MiB, 0.05, 0.5), fill, 100) is None
    partly = fill._replace(rates=r)
    want = math.fsum(extra_reference(i, 150, 2e6, 300e6, r.filling_bytes_per_s, model.EVICTION_BYTES_PER_S)
                     for i in range(40, 400))
    assert math.isclose(store_fill_step_s(partly, 40, 400), want, rel_tol=1e-9)


class CountingStats:
    """A store handle whose stats() calls are counted; its counters as given."""

    def __init__(self, budget: float, **counters) -> None:
        self.calls, self.budget, self.counters, self.num_rows = 0, budget, counters, 1000

    def thread_io_wait_seconds(self) -> float:
        return 0.0

    def stats(self):
        self.calls += 1
        return SimpleNamespace(hot_bytes=self.budget / 2, hot_budget_bytes=self.budget, table_bytes=256 * 1000,
                               **self.counters)


def test_hot_tiers_reads_each_store_once_and_sums_the_measured_work():
    a = CountingStats(100.0, flushed_rows=1000, flush_seconds=0.5, evicted_bytes=10, write_back_seconds=0.1,
                      compaction_seconds=0.2)
    b = CountingStats(300.0, flushed_rows=10, flush_seconds=0.25)  # no eviction counters: a store without them
    none = CountingStats(0.0, flushed_rows=99)  # no hot budget: not counted
    h = StoreReadings({"a": a, "b": b, "none": none}).hot_tiers()
    assert (a.calls, b.calls, none.calls) == (1, 1, 1)
    assert h == HotTiers(200.0, 400.0, 1010 * 256.0, 0.75, 10.0, 0.1, 0.2, 256.0)
    assert StoreReadings({"none": none}).hot_tiers() is None


def test_a_prediction_past_the_fill_reads_the_stores_once_for_the_rates():
    calls = []

    def reader():
        calls.append(1)
        return reading(64 * MiB, 0.2, 64 * MiB, 0.1, 0.4)

    ep = EpochPredictor(0.05, 0, None)
    ep.store_reader = reader
    ep._store_first = (10, HotTiers(10.0, 100.0))
    ep._fill = StoreFill(100, 1.0, 100.0)
    assert ep._project_fill(200, 400).rates is not None and len(calls) == 1
    r = ep._fill.rates
    assert math.isclose(r.filling_bytes_per_s, 64 * MiB / 0.2 / model.FILLING_SHARE)
    level = (1.0 + ep._fill.level(199)) / 2.0
    assert math.isclose(r.eviction_bytes_per_s, 64 * MiB * level / 0.5 / model.EVICTION_SHARE)
    assert ep._fill[:3] == (100, 1.0, 100.0)  # the projection itself stays


class MeasuringStore:
    """A cold store whose hot tier takes `per_batch` bytes a batch up to `budget`, flushing what
    it takes in at `flush_rate` bytes/s (counted in its stats, as the real store counts them), and
    whose batches cost 1 ms plus the model's extra at that host's rates: 4x faster flushes than
    the host the constants came from."""

    def __init__(self, cost: Cost, per_batch: float, budget: float, filling: float) -> None:
        self.cost, self.per_batch, self.budget, self.filling = cost, per_batch, budget, filling
        self.hot, self.batch, self.io, self.stats_calls = 0.0, 0, 0.0, 0
        self.flushed_rows, self.flush_seconds, self.num_rows = 0, 0.0, 10 ** 6

    def thread_io_wait_seconds(self) -> float:
        return self.io

    def get(self, ids):
        import time

        import torch

        t0 = time.perf_counter()
        self.cost(1 * MS + extra_reference(self.batch, round(self.budget / self.per_batch), self.per_batch,
                                           self.budget, self.filling, model.EVICTION_BYTES_PER_S))
        self.io += time.perf_counter() - t0
        self.hot = min(self.budget, self.hot + self.per_batch)
        self.flushed_rows += round(self.per_batch / 256)  # a flush after every batch
        self.flush_seconds += self.per_batch / (self.filling * model.FILLING_SHARE)
        self.batch += 1
        return torch.zeros(len(ids), 1)

    def stats(self):
        self.stats_calls += 1
        return SimpleNamespace(io_wait_seconds=self.io, hot_bytes=self.hot, hot_budget_bytes=self.budget,
                               table_bytes=256 * self.num_rows, flushed_rows=self.flushed_rows,
                               flush_seconds=self.flush_seconds)


def test_a_fit_on_a_host_that_flushes_4x_faster_is_predicted_from_the_measured_rate(tmp_path):
    clock = FakeClock()
    cost = Cost(clock)
    fast = 4 * model.STORE_FILLING_BYTES_PER_S
    per_batch = 256 * 11719.0  # whole rows
    store = MeasuringStore(cost, per_batch, 150 * per_batch, fast)  # full after 150 batches
    net = CostModel(cost, FWD, BWD, OPT, store_s=1.0)
    net.embedding_stores = {"rows": store}
    sp, wall = StepProfiler(report=False, predict_at=0.1), ActualWall()
    with mock.patch("time.perf_counter", clock):
        t = trainer(max_epochs=1, callbacks=[wall, sp, LoopOverhead(cost, OTHER)])
        t.fit(net, loader(BatchDataset(400, cost, 2 * MS)))
    e = sp.summary()[0]
    assert e["predicted_at_batch"] == 40 and e["predicted_store_fill_batch"] == 150
    # the stores were read twice in the epoch (half-way to the prediction, and at it), as before
    assert store.stats_calls == 2
    extra = [extra_reference(b, 150, per_batch, 150 * per_batch, fast, model.EVICTION_BYTES_PER_S) for b in range(400)]
    want = math.fsum(extra[40:]) - 360 * math.fsum(extra[20:40]) / 20
    assert math.isclose(e["predicted_store_fill_seconds"], want, rel_tol=1e-6)
    assert abs(e["prediction_error_pct"]) < 0.05, e
    # the constants would have charged the filling 4x over: far off
    slow = [extra_reference(b, 150, per_batch, 150 * per_batch, model.STORE_FILLING_BYTES_PER_S,
                            model.EVICTION_BYTES_PER_S)
            for b in range(400)]
    over = math.fsum(slow[40:]) - 360 * math.fsum(slow[20:40]) / 20 - want
    assert over > 0.05 * wall.seconds


def test_saves_after_the_fill_are_charged_at_the_fold_rate_the_measured_ones_ran_at():
    # a host whose saves after the fill wait 2.5x what the constant says; a save's usual cost 50 ms
    fill = StoreFill(150, 3e6, 300e6)
    slow_fold = model.FOLD_BYTES_PER_S / 2.5
    walls = [0.020 + extra_reference(b, 150, 3e6, 300e6, model.STORE_FILLING_BYTES_PER_S, model.EVICTION_BYTES_PER_S)
             + ((0.050 + fold_bytes(fill, b) / slow_fold) if b in (100, 200, 300) else 0.0) for b in range(400)]
    fc = Forecast()
    fc.shift_detection = False
    for i, w in enumerate(walls[:250]):  # the saves at 100 (before the fill) and 200 (after) seen
        if i in (100, 200):
            fc.mark_save()
        fc.add_step(w, 0.0)
    p = fc.estimate(400, 0, None, 1, store_fill=fill, save_batches=[300])
    assert math.isclose(p["seconds"], math.fsum(walls), rel_tol=2e-3)
    # how: the save before the fill is the usual cost; the one after it sets the fold rate
    mean = fc.rate()["mean"]
    usual = walls[100] - mean
    fold = fold_bytes(fill, 200) / (walls[200] - mean - usual)
    steps = store_fill_step_s(fill, 250, 400) - 150 * store_fill_step_s(fill, 125, 250) / 125
    assert math.isclose(p["store_fill_s"], steps + fold_bytes(fill, 300) / fold, rel_tol=1e-9)
    assert math.isclose(p["seconds"], fc.elapsed + 150 * mean + usual + fold_bytes(fill, 300) / fold + steps,
                        rel_tol=1e-9)
    # the save at 300 charged at the mean of the two seen (no model) would miss by a fifth of the
    # epoch, at the constant fold rate by a tenth
    mean_of_seen = (walls[100] + walls[200]) / 2 - mean
    assert abs(mean_of_seen - (walls[300] - 0.020)) > 0.2 * math.fsum(walls)
    assert fold_bytes(fill, 300) * (1 / model.FOLD_BYTES_PER_S - 1 / fold) < -0.1 * math.fsum(walls)
