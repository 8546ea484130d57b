"""The CUDA path of StepTimeline on any machine: fake events on a fake clock stand in for CUDA
events, so the sampling (events on about one step in k, none in between), the event pool and the
reported phases can be checked exactly."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from _profiling_helpers import MS, FakeClock

from lightning_embcache.profiling.timeline import (
    BACKWARD,
    DATA,
    FORWARD,
    NUM_PHASES,
    OPTIMIZER,
    OTHER,
    StepTimeline,
    Totals,
)


class FakeEvent:
    """Completes when recorded; elapsed_time from the fake clock; counts what is asked of it."""

    created = 0
    syncs = 0

    def __init__(self, enable_timing: bool = False, clock: FakeClock = None) -> None:
        FakeEvent.created += 1
        self.clock, self.t = clock, None

    def record(self, stream=None) -> None:
        self.t = self.clock()

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: FakeEvent) -> float:
        return 1e3 * (other.t - self.t)

    def synchronize(self) -> None:
        FakeEvent.syncs += 1


class FakeStream:
    def synchronize(self) -> None:
        FakeEvent.syncs += 1


def _run(k: int, steps: int = 400, epochs: int = 1):
    clock = FakeClock()
    FakeEvent.created = FakeEvent.syncs = 0
    got = Totals()
    device_steps = []

    def sink(epoch, batches, host, device, samples, steady, forced):  # samples: here the step's index
        got.add(batches, host, device, samples, steady, forced)
        if batches:
            device_steps.append((epoch * steps + samples, device is not None))

    with mock.patch("time.perf_counter", clock), \
            mock.patch.object(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(enable_timing, clock)), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: FakeStream()):
        tl = StepTimeline(sink, torch.device("cuda", 0), sample_every=k)
        for epoch in range(epochs):
            tl.begin(DATA)
            for i in range(steps):
                # every 10th step is slow in "other" (logging every 10 steps)
                for phase, ms in ((FORWARD, 5), (BACKWARD, 7), (OPTIMIZER, 4), (OTHER, 1 + 9 * (i % 10 == 9))):
                    clock.advance(2 * MS if phase == FORWARD else 0)  # the loader's 2 ms, then forward
                    tl.switch(phase)
                    clock.advance(ms * MS)
                syncs_before = FakeEvent.syncs
                tl.end_step(epoch, i, True, next_phase=DATA)
                assert FakeEvent.syncs == syncs_before  # nothing waits inside the epoch
                if i % 50 == 49:
                    tl.drain()
            tl.end_epoch(epoch)
            tl.drain(block=True)
    # steps timed on the device reach the sink when their events are read: put them in order
    return tl, got, [timed for _, timed in sorted(device_steps)]


def test_every_step_timed_when_k_is_1():
    tl, got, timed = _run(1, steps=100)
    assert all(timed)
    assert tl.events_recorded == 1 + 100 * 5 + 1  # the epoch's start, 5 boundaries a step, its end
    assert FakeEvent.created <= 5 * 50 + 10  # events come back to the pool when read (every 50 steps)


@pytest.mark.parametrize("k", [4, 8, 16])
def test_about_one_step_in_k_is_timed_and_the_phases_stay_exact(k):
    tl, got, timed = _run(k, steps=2000)
    share = sum(timed) / len(timed)
    assert 0.7 / k <= share <= 1.3 / k, share
    # a timed step costs 5 events, plus one to start its chain when the step before was not timed
    assert tl.events_recorded <= 6.3 * 2000 / k + 10
    # on the fake clock device time equals host time: the reported phases are the true means
    ph = [1e3 * v / got.batches for v in got.phases()]
    expected = {DATA: 2.0, FORWARD: 5.0, BACKWARD: 7.0, OPTIMIZER: 4.0, OTHER: 1.9}
    for phase, ms in expected.items():  # "other", the only phase that varies, is the remainder
        assert math.isclose(ph[phase], ms, rel_tol=1e-6), (phase, ph)
    assert math.isclose(sum(ph), 1e3 * got.wall_s / got.batches, rel_tol=1e-9)
    assert len(ph) == NUM_PHASES


def test_sampling_is_not_locked_to_a_period():
    # with fixed gaps of 8 steps, a 1-in-10 slow step would be timed every 40 steps or never
    _, _, timed = _run(8, steps=4000)
    slow_timed = sum(1 for i, t in enumerate(timed) if t and i % 10 == 9)
    assert 0.5 * 400 / 8 <= slow_timed <= 1.5 * 400 / 8


def test_a_whole_fit_on_the_sampled_cuda_path_with_fake_events():
    """The callback's CUDA path end to end (events, lazy reads, the device rate for the
    prediction) through a real Trainer on the CPU, fake events standing in for CUDA's."""
    from _profiling_helpers import BatchDataset, Cost, CostModel, LoopOverhead, loader, trainer

    from lightning_embcache import StepProfiler
    from lightning_embcache.profiling import timeline as T

    clock = FakeClock()
    cost = Cost(clock)
    FakeEvent.created = FakeEvent.syncs = 0
    original = T.StepTimeline.__init__

    def on_cuda(self, sink, device=None, store_io=None, sample_every=1, seed=0):
        original(self, sink, torch.device("cuda", 0), store_io, sample_every, seed)

    with mock.patch("time.perf_counter", clock), \
            mock.patch.object(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(enable_timing, clock)), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: FakeStream()), \
            mock.patch.object(T.StepTimeline, "__init__", on_cuda):
        sp = StepProfiler(report=False, log_every_n_steps=20)
        t = trainer(max_epochs=2, callbacks=[sp, LoopOverhead(cost, 1 * MS)])
        t.fit(CostModel(cost, 5 * MS, 7 * MS, 4 * MS), loader(BatchDataset(400, cost, 2 * MS)))
    assert sp._timeline.events_recorded <= 0.8 * 800  # against 5 a step when every step is timed
    for e in sp.summary():
        assert e["timeline"] == "cuda-events"
        ph = e["phases_ms"]
        for phase, ms in (("data_wait", 2.0), ("forward", 5.0), ("backward", 7.0), ("optimizer", 4.0),
                          ("other", 1.0)):
            assert math.isclose(ph[phase], ms, rel_tol=1e-6), ph
        # made once 3 sampled steps were read, at 5% of the epoch or a little later
        assert 20 <= e["predicted_at_batch"] <= 80
        assert abs(e["prediction_error_pct"]) < 1e-6
