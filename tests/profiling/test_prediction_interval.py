"""The prediction's 90% interval counts the drift of the host's speed, not only the estimator's
own spread: synthetic step-time series whose level moves after the prediction is made."""

from __future__ import annotations

import math

import pytest

from lightning_embcache.profiling import forecast
from lightning_embcache.profiling.forecast import Forecast, level_drift, level_spread

MS = 1e-3


def _feed(walls: list[float], device: bool = False) -> Forecast:
    fc = Forecast()
    for i, w in enumerate(walls):
        fc.add_step(w, 0.0)
        if device and i % 8 == 0:
            fc.add_device_step(i, w)
    return fc


def _old_interval(p: dict) -> tuple[float, float]:
    """The interval before drift counted: the estimator's standard deviation, two either side."""
    return p["seconds"] - 2 * p["std"], p["seconds"] + 2 * p["std"]


def test_a_level_shift_after_5_percent_of_a_first_epoch_lies_inside_the_interval():
    # 2,000 steps: 10 ms for the first 5%, then the host gets 30% slower for the rest
    n, k = 2000, 100
    walls = [10 * MS] * k + [13 * MS] * (n - k)
    actual = math.fsum(walls)
    fc = _feed(walls[:k])
    p = fc.estimate(n, 0, None, 0)  # a fit's first epoch: no earlier epoch's drift (drift=None)
    assert math.isclose(p["seconds"], n * 10 * MS)  # the point cannot know what comes after 5%
    assert p["low"] <= actual <= p["high"], (p["low"], actual, p["high"])
    # the estimator's own spread says nothing of it: every step so far took the same time
    lo, hi = _old_interval(p)
    assert not lo <= actual <= hi
    # the interval is the point's, 90% of it the host-timed first epoch's floor on the drift
    assert math.isclose(p["high"] - p["seconds"], forecast.FIRST_EPOCH_DRIFT * (n - k) * 10 * MS, rel_tol=1e-9)


def test_the_drift_seen_so_far_in_the_epoch_widens_the_interval():
    # the host wanders between 10 and 14 ms in runs of 25 steps; the rest runs at 11.5 ms
    n, k = 4000, 200
    walls = [(10 if (i // 25) % 2 == 0 else 14) * MS for i in range(k)] + [11.5 * MS] * (n - k)
    actual = math.fsum(walls)
    seen = level_drift(walls[:k])
    assert seen > forecast.FIRST_EPOCH_DRIFT / 10
    fc = _feed(walls[:k])
    fc.shift_detection = False
    # a later epoch of a fit whose nine earlier epochs held steady
    p = fc.estimate(n, 0, None, 0, drift=0.0, drift_epochs=9)
    assert p["drift"] == pytest.approx(seen)
    assert p["low"] <= actual <= p["high"], (p["low"], actual, p["high"])


def test_an_earlier_epochs_drift_widens_a_steady_windows_interval():
    # the previous epoch ran 10 ms for half, 12 ms for the other half: its blocks lay 2/11 of
    # their median apart; this epoch's first 5% is steady at 10 ms, its rest runs at 11.5 ms
    previous = [10 * MS] * 1000 + [12 * MS] * 1000
    carried = level_spread(previous, forecast.EPOCH_DRIFT_BLOCKS)
    assert carried == pytest.approx(2 / 11, rel=1e-6)
    # one block's departure from the middle says half of it: the interval it gave missed this
    assert level_drift(previous, forecast.EPOCH_DRIFT_BLOCKS) == pytest.approx(1 / 11, rel=1e-6)
    n, k = 2000, 100
    walls = [10 * MS] * k + [11.5 * MS] * (n - k)
    actual = math.fsum(walls)
    p = _feed(walls[:k]).estimate(n, 0, None, 0, drift=carried, drift_epochs=9)
    assert p["low"] <= actual <= p["high"]
    assert p["drift"] == pytest.approx(carried)
    assert not _old_interval(p)[0] <= actual <= _old_interval(p)[1]
    assert p["seconds"] + (n - k) * 10 * MS / 11 < actual  # the old, half as wide one missed it


def test_a_steady_fit_narrows_the_floor_with_every_epoch_seen():
    # earlier epochs drifted by nothing: after k of them the next drifts further one time in
    # k + 1, so the first epoch's floor shrinks to 1 / (k + 1) of it, never to nothing
    n, k = 2000, 100
    walls = [10 * MS] * k
    rest = (n - k) * 10 * MS
    halves = []
    for epochs in (1, 3, 9):
        q = _feed(walls).estimate(n, 0, None, 0, drift=0.0, drift_epochs=epochs)
        assert q["drift"] == pytest.approx(forecast.FIRST_EPOCH_DRIFT / (1 + epochs))
        halves.append(q["high"] - q["seconds"])
        assert halves[-1] == pytest.approx(rest * forecast.FIRST_EPOCH_DRIFT / (1 + epochs), rel=1e-6)
    assert halves[0] > halves[1] > halves[2] > 0
    # a device-timed rate: the device floor likewise
    fc = _feed([14 * MS] * k, device=True)
    fc.needs_device = True
    q = fc.estimate(n, 0, None, 0, drift=0.0, drift_epochs=4)
    assert q["drift"] == pytest.approx(forecast.FIRST_EPOCH_DEVICE_DRIFT / 5)


def test_a_device_timed_first_epoch_gets_the_small_floor():
    # a step the GPU sets holds its speed: 5% of the rest, not 40%
    n, k = 2000, 100
    fc = _feed([14 * MS] * k, device=True)
    fc.needs_device = True
    p = fc.estimate(n, 0, None, 0)
    assert p["rate"]["device"]
    rest = (n - k) * 14 * MS
    # the floor, and the device-timed rate's own spread against the host's steps (0.5%) beside it
    want = math.hypot(forecast.FIRST_EPOCH_DEVICE_DRIFT * rest, forecast.INTERVAL_Z * forecast.DEVICE_RATE_CV * rest)
    assert p["high"] - p["seconds"] == pytest.approx(want, rel=1e-6)


def test_a_device_timed_step_that_does_the_stores_work_gets_the_host_floor():
    # the GPU times the rate, but a fifth of each host step is the stores' work (a device tier
    # filling): the host's drift sets how far the rest may run off, not the GPU's
    n, k = 2000, 100
    fc = Forecast()
    for i in range(k):
        fc.add_step(14 * MS, 3 * MS)
        if i % 8 == 0:
            fc.add_device_step(i, 14 * MS)
    fc.needs_device = True
    p = fc.estimate(n, 0, None, 0)
    assert p["rate"]["device"]
    assert p["drift"] == pytest.approx(forecast.FIRST_EPOCH_DRIFT)
    # the same steps without store work keep the device floor
    assert _feed([14 * MS] * k, device=True).estimate(n, 0, None, 0)["drift"] == pytest.approx(
        forecast.FIRST_EPOCH_DEVICE_DRIFT)


def test_the_low_end_is_never_below_the_time_already_run():
    n, k = 200, 20
    p = _feed([10 * MS] * k).estimate(n, 0, None, 0)
    assert p["low"] >= k * 10 * MS
