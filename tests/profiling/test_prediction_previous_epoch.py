"""On a GPU host the step time's level wanders within an epoch (10-30% for seconds at a time) and
comes back: the first 5% of an epoch catches one level. From the second epoch on, a device-timed
rate is combined with the previous whole epoch's mean step time. Synthetic step series: the
epoch-time prediction against the series' own sum."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from lightning_embcache.profiling.forecast import Forecast, epoch_level, level_variation, with_previous_epoch
from lightning_embcache.profiling.predictor import EpochPredictor
from lightning_embcache.profiling.timeline import FORWARD, NUM_PHASES

N = 4000  # batches per epoch: 5% is batch 200, one twentieth-block
BLOCK = N // 20
LOW, HIGH = 0.0015, 0.0025  # two levels of the host's speed; the mean step is 2 ms


def _epoch(levels: list[float], first_s: float = 0.200) -> list[float]:
    """Step wall seconds: each block of a twentieth of the epoch at its level; the first step
    holds the loader's start-up."""
    wall = [lv for lv in levels for _ in range(BLOCK)]
    wall[0] = first_s
    return wall


# epoch 0 alternates between the two levels (mean 2 ms, no drift between its halves); epoch 1
# starts in a fast block: its first 5% runs at 1.5 ms a step, the rest at 2.03 ms
EPOCH0 = _epoch([LOW, HIGH] * 10)
EPOCH1 = _epoch([LOW] + [HIGH, LOW] * 9 + [HIGH])
SAMPLED = range(1, N, 8)  # the steps the device timed (here the device keeps pace with the host)


def _forecast(wall: list[float], upto: int, device: bool = True) -> Forecast:
    fc = Forecast()
    fc.needs_device = device
    for w in wall[:upto]:
        fc.add_step(w, 0.0)
    if device:
        for i in SAMPLED:
            if i < upto:
                fc.add_device_step(i, wall[i])
    return fc


def _error(p: dict, wall: list[float]) -> float:
    return p["seconds"] / math.fsum(wall) - 1.0


def test_epoch_level_is_the_mean_step_and_the_drift_between_the_halves():
    wall = [1.0] + [0.010] * 99 + [0.015] * 100  # the first step (start-up) is left out
    mean, drift = epoch_level(wall)
    assert math.isclose(mean, (99 * 0.010 + 100 * 0.015) / 199)
    assert math.isclose(drift, 0.015 / 0.010 - 1.0)
    # a checkpoint save's step is left out too
    assert epoch_level(wall[:150] + [5.0] + wall[151:], skip=[150]) == epoch_level(wall[:150] + [0.015] + wall[151:],
                                                                               skip=[150])
    assert epoch_level([0.01] * 8) is None  # 7 steps counted: too few


def test_a_device_timed_rate_is_combined_with_the_previous_epochs_level():
    previous, cv = epoch_level(EPOCH0), level_variation(EPOCH0)
    assert math.isclose(previous[0], 0.002, rel_tol=1e-3) and abs(previous[1]) < 1e-3 and cv > 0.2
    fc = _forecast(EPOCH1, N // 20)
    alone = fc.estimate(N, 0, None, 0, level_cv=cv)
    assert math.isclose(alone["rate_s"], LOW)
    assert _error(alone, EPOCH1) < -0.20  # the window's level: 25% short
    p = fc.estimate(N, 0, None, 0, level_cv=cv, previous=previous)
    # the window spans one twentieth of the epoch, the previous epoch twenty: weight 20/21 for it
    w = p["rate"]["previous_weight"]
    assert math.isclose(w, 20 / 21, rel_tol=1e-3)
    assert math.isclose(p["rate_s"], w * previous[0] + (1 - w) * LOW)
    assert abs(_error(p, EPOCH1)) < 0.05
    # and the uncertainty shrinks with it, still covering the actual epoch
    assert p["std"] < alone["std"] and abs(p["seconds"] - math.fsum(EPOCH1)) < 2 * p["std"]


def test_a_host_timed_rate_is_not_combined():
    # on the shared CPU hosts the level moved between epochs as much as within one
    fc = _forecast(EPOCH1, N // 20, device=False)
    cv = level_variation(EPOCH0)
    alone = fc.estimate(N, 0, None, 0, level_cv=cv)
    p = fc.estimate(N, 0, None, 0, level_cv=cv, previous=epoch_level(EPOCH0))
    assert p["seconds"] == alone["seconds"] and p["rate"]["previous_weight"] == 0.0


def test_a_previous_epoch_that_drifted_weighs_less():
    cv = level_variation(EPOCH0)
    steady = with_previous_epoch(LOW, 0.0, BLOCK // 2, N, cv, (0.002, 0.0))
    drifted = with_previous_epoch(LOW, 0.0, BLOCK // 2, N, cv, (0.002, 0.10))
    assert drifted[1] < steady[1]
    # twice the drift between its halves counts: (0.2)^2 against the window's cv^2
    assert math.isclose(drifted[1], cv ** 2 / (cv ** 2 + cv ** 2 / 20 + 0.2 ** 2))
    # the longer the window, the less the previous epoch counts
    assert with_previous_epoch(LOW, 0.0, 10 * BLOCK, N, cv, (0.002, 0.0))[1] < steady[1]


def test_a_workload_that_changed_between_epochs_keeps_its_own_rate():
    # a steady host (1% level variation) whose steps got 50% longer: not the host's speed
    cv = 0.01
    fc = _forecast([0.003] * N, N // 20)
    p = fc.estimate(N, 0, None, 0, level_cv=cv, previous=(0.002, 0.0))
    assert p["rate"]["previous_weight"] == 0.0 and math.isclose(p["rate_s"], 0.003)
    assert with_previous_epoch(0.003, 0.0, BLOCK // 2, N, cv, (0.002, 0.0)) is None


class _Timeline:
    """A CUDA timeline whose sampled steps are all read back already."""

    _cuda = True

    def drain(self) -> None:
        pass

    def device_backlog(self) -> int:
        return 0


@pytest.mark.parametrize("cuda", [True, False])
def test_the_second_epoch_is_predicted_with_the_first_epochs_level(cuda):
    tl = _Timeline()
    tl._cuda = cuda
    pred = EpochPredictor(predict_at=0.05, sample_every=8, epoch_batches=None)
    trainer = SimpleNamespace(num_training_batches=N, max_steps=-1, max_epochs=2, current_epoch=0, global_step=0,
                              accumulate_grad_batches=1, checkpoint_callbacks=[], enable_validation=False)
    kept = []
    before = 0.0
    for epoch, wall in enumerate((EPOCH0, EPOCH1)):
        trainer.current_epoch = epoch
        pred.begin_epoch(epoch, 0, 0.0, epoch * N, before, tl)
        for i, w in enumerate(wall):
            host = [0.0] * NUM_PHASES
            host[FORWARD] = w
            trainer.global_step += 1
            pred.add_step(host, trainer)
            if cuda and i in SAMPLED:
                pred.add_device_step(i, w)
        kept.append(pred.finish_epoch())
        before += math.fsum(wall)
    assert [k["at_batch"] for k in kept] == [N // 20] * 2
    err1 = kept[1]["epoch_s"] / math.fsum(EPOCH1) - 1.0
    if cuda:
        assert abs(err1) < 0.05, kept[1]
    else:  # host-timed: the window's level, as before
        assert err1 < -0.20, kept[1]
