"""The prediction benchmark's own accounting: its probe's predict() calls are left out of the
actual epoch time, and the replay's split of the rest's extra time into slow steps, the training
thread's share of them and garbage collection."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.prediction import _result, tail


def test_the_probes_own_predictions_are_left_out_of_the_actual_time():
    sp = SimpleNamespace(summary=lambda: [
        {"epoch": 0, "batches": 100, "epoch_wall_seconds": 10.5, "predicted_epoch_seconds": 10.0,
         "predicted_epoch_std_seconds": 0.1, "predicted_at_batch": 5, "prediction_error_pct": -4.76,
         "predicted_fit_seconds": 20.0},
        {"epoch": 1, "batches": 100, "epoch_wall_seconds": 10.0, "predicted_epoch_seconds": 10.0,
         "predicted_epoch_std_seconds": 0.1, "predicted_at_batch": 5, "prediction_error_pct": 0.0}])
    probe = SimpleNamespace(own_s={0: 0.5}, seen={0: {0.5: 10.0}}, traces=[])
    r = _result("x", sp, SimpleNamespace(epochs=[10.5, 10.0]), None, probe)
    e0, e1 = r["epochs"]
    assert e0["actual_s"] == 10.0 and e0["probe_s"] == 0.5 and e0["reference_s"] == 10.0
    assert abs(e0["error_pct"]) < 1e-12 and e0["error_pct_by_fraction"] == {0.5: 0.0}
    assert e1["actual_s"] == 10.0 and e1["probe_s"] == 0.0
    assert r["fit_actual_s"] == 20.0 and abs(r["fit_error_pct"]) < 1e-12


def test_the_aggregate_counts_the_epochs_inside_the_90_percent_interval():
    from benchmarks.prediction import aggregate

    epochs = [{"epoch": i, "predicted_s": 10.0, "actual_s": actual, "std_s": 0.1, "error_pct": 100 * (10 / actual - 1),
               "low_s": 9.0, "high_s": 11.0} for i, actual in enumerate((10.5, 12.0, 9.5, 10.0))]
    a = aggregate([{"run": "x", "epochs": epochs, "fit_error_pct": None}])["x"]
    assert a["within_90_interval_share"] == 0.75 and a["within_2_std_share"] == 0.25
    assert a["interval_half_width_pct_median"] == 10.0


def test_tail_splits_the_rests_slow_steps_into_the_threads_cpu_and_waiting():
    # 100 steps of 1 ms; the first 10 are the first 5% (window: steps 5-9); in the rest, steps
    # 50 and 70 take 11 ms, of which the thread ran 3 ms on the CPU (1 ms is the usual)
    wall = [0.001] * 100
    cpu = [0.001] * 100
    for i in (50, 70):
        wall[i], cpu[i] = 0.011, 0.003
    trace = {"wall": wall, "saves": [], "thread_cpu": cpu, "gc": [(3, 0, 0.0001), (60, 2, 0.0009)]}
    t = tail(trace, 10)
    assert t["window_pct"] == 0.0
    assert abs(t["rest_pct"] - 100 * 0.020 / (0.001 * 90)) < 1e-9  # 20 ms extra over 90 ms
    assert abs(t["slow_cpu_share"] - 0.2) < 1e-9  # 4 ms of the 20 on the CPU: the rest waited
    assert abs(t["gc_pct"] - 100 * 0.001 / sum(wall)) < 1e-9
    # a save's step is not a slow step, and traces saved without GC records give None
    t = tail(dict(trace, saves=[50], gc=None), 10)
    assert abs(t["rest_pct"] - 100 * 0.010 / (0.001 * 89)) < 1e-9 and t["gc_pct"] is None
