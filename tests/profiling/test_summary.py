"""Combining ranks: rows of sums -> logged metrics and epoch summaries (no processes needed)."""

import math

from lightning_embcache.profiling import PHASES
from lightning_embcache.profiling.summary import epoch_row, epoch_summary, interval_metrics, interval_row
from lightning_embcache.profiling.timeline import Totals


def _totals(batches, per_step_ms, samples_per_step=8, val_s=0.0, steady=None):
    """`per_step_ms`: phase -> ms each step; the wall is their sum."""
    t = Totals()
    host = [per_step_ms.get(p, 0.0) / 1e3 for p in PHASES] + [0.0]
    for i in range(batches):
        t.add(1, host, host, samples_per_step, steady is None or i >= steady)
    t.val_s = val_s
    return t


def test_straggler_is_named_even_though_ddp_evens_out_whole_steps():
    # rank 1 computes 30 ms more forward; rank 0 waits those 30 ms inside backward (all-reduce)
    fast = _totals(10, {"data_wait": 2, "forward": 5, "backward": 40, "optimizer": 1, "other": 2})
    slow = _totals(10, {"data_wait": 2, "forward": 35, "backward": 10, "optimizer": 1, "other": 2})
    rows = [epoch_row(fast), epoch_row(slow)]
    e = epoch_summary(3, rows, True, 100, "host-clock")
    assert e["slowest_rank"] == 1 and e["world_size"] == 2
    assert math.isclose(e["phases_ms"]["forward"], 20.0) and math.isclose(e["phases_max_ms"]["forward"], 35.0)
    # outside backward: 10 ms vs 40 ms per step -> spread 30 / 25 = 120 %
    assert math.isclose(e["rank_spread_pct"], 120.0)
    assert math.isclose(e["avg_batch_ms"], 50.0) and math.isclose(sum(e["phases_ms"].values()), 50.0)
    assert e["samples"] == 160 and math.isclose(e["samples_per_sec"], 160 / 0.5)
    assert math.isclose(e["projected_epoch_seconds"], 0.5 + 90 * 0.05)

    m = interval_metrics([interval_row(fast), interval_row(slow)], True)
    assert m["profile/slowest_rank"] == 1.0 and math.isclose(m["profile/rank_spread_pct"], 120.0)
    assert math.isclose(m["profile/forward_ms"], 20.0) and math.isclose(m["profile/step_max_ms"], 50.0)


def test_steady_excludes_warmup_and_single_rank_has_no_spread():
    t = _totals(10, {"forward": 10}, steady=4)
    t.steady_wall_s = 6 * 0.008  # the 6 steady steps took 8 ms each, the warm-up more
    t.steady_batches = 6
    e = epoch_summary(0, [epoch_row(t)], False, None, "host-clock")
    assert math.isclose(e["steady_batch_ms"], 8.0) and e["steady_batches"] == 6
    assert e["samples"] is None and e["samples_per_sec"] is None and e["projected_epoch_seconds"] is None
    assert e["rank_spread_pct"] == 0.0 and e["slowest_rank"] == 0


def test_interval_with_no_finished_step_logs_nothing():
    assert interval_metrics([interval_row(Totals())], True) is None
