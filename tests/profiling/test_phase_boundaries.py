"""Every phase boundary of a step is found in a real Trainer.fit, under automatic and manual
optimization and gradient accumulation: forward, backward and the optimizer each cost a different
known amount, so a boundary missed (or seen late) moves a phase's cost into its neighbour."""

from __future__ import annotations

import math
from unittest import mock

import lightning as L
import pytest
from _profiling_helpers import MS, BatchDataset, Cost, CostModel, FakeClock, LoopOverhead, loader, trainer
from lightning.pytorch.profilers import SimpleProfiler

from lightning_embcache import StepProfiler
from lightning_embcache.profiling.timeline import NUM_PHASES, PHASES

# each phase's cost differs from every other's by 1 ms or more
DATA_S, FWD_S, BWD_S, OPT_S, OTHER_S = 2 * MS, 5 * MS, 9 * MS, 3 * MS, 1 * MS


class StepPhases:
    """Records every closed step's host phases (the sink the timeline feeds)."""

    def __init__(self, sp: StepProfiler) -> None:
        self.steps: list[list[float]] = []
        self.sp = sp

    def wrap(self, sink):
        def record(epoch, batches, host, device, samples, steady, forced):
            if batches:
                self.steps.append(list(host[:NUM_PHASES]))
            return sink(epoch, batches, host, device, samples, steady, forced)
        return record


def _fit(manual=False, accumulate=1, batches=6, clock=None, profiler=None, **kw):
    sp = StepProfiler(report=False)
    rec = StepPhases(sp)
    from lightning_embcache.profiling import timeline as T
    original = T.StepTimeline.__init__

    def recording(self, sink, *a, **k):
        original(self, rec.wrap(sink), *a, **k)

    cost = Cost(clock)
    patches = [mock.patch.object(T.StepTimeline, "__init__", recording)]
    if clock is not None:
        patches.append(mock.patch("time.perf_counter", clock))
    for p in patches:
        p.start()
    try:
        t = trainer(max_epochs=1, callbacks=[sp, LoopOverhead(cost, OTHER_S)], accumulate_grad_batches=accumulate,
                    profiler=profiler, **kw)
        t.fit(CostModel(cost, FWD_S, BWD_S, OPT_S, manual=manual), loader(BatchDataset(batches, cost, DATA_S)))
    finally:
        for p in reversed(patches):
            p.stop()
    return sp, rec.steps


def _expected(i: int, accumulate: int) -> list[float]:
    """Host phases of batch ``i``: the optimizer runs on every ``accumulate``-th batch only."""
    steps = (i + 1) % accumulate == 0
    return [DATA_S, FWD_S, BWD_S, OPT_S if steps else 0.0, 0.0, OTHER_S]


@pytest.mark.parametrize("manual,accumulate", [(False, 1), (True, 1), (False, 2), (False, 3)])
@pytest.mark.parametrize("profiler", [None, "simple"])
def test_each_step_lands_in_its_phases_under_a_fake_clock(manual, accumulate, profiler):
    prof = SimpleProfiler() if profiler == "simple" else None
    sp, steps = _fit(manual, accumulate, batches=6, clock=FakeClock(), profiler=prof)
    assert len(steps) == 6
    for i, got in enumerate(steps):
        want = _expected(i, accumulate)
        assert all(math.isclose(g, w, abs_tol=1e-9) for g, w in zip(got, want)), (i, dict(zip(PHASES, got)))
    assert sp.summary()[0]["samples"] == 24


def test_accumulation_with_validation_inside_the_epoch():
    """Validation after a micro-step and after an optimizer step: charged to neither step."""
    clock = FakeClock()
    sp = StepProfiler(report=False)
    cost = Cost(clock)
    with mock.patch("time.perf_counter", clock):
        model = CostModel(cost, FWD_S, BWD_S, OPT_S, val_s=20 * MS)
        t = trainer(max_epochs=1, callbacks=[sp, LoopOverhead(cost, OTHER_S)], accumulate_grad_batches=2,
                    val_check_interval=3)
        t.fit(model, loader(BatchDataset(6, cost, DATA_S)), loader(BatchDataset(2, cost, 0.0)))
    e = sp.summary()[0]
    ph = e["phases_ms"]
    assert math.isclose(ph["optimizer"], OPT_S / 2 / MS) and math.isclose(ph["backward"], BWD_S / MS), ph
    assert math.isclose(ph["forward"], FWD_S / MS) and math.isclose(ph["other"], OTHER_S / MS), ph
    assert math.isclose(e["val_seconds"], 2 * 2 * 20 * MS), e


@pytest.mark.slow  # wall-clock: the default suite checks the same boundaries under a fake clock
@pytest.mark.parametrize("manual,accumulate", [(False, 1), (True, 1), (False, 2)])
def test_real_sleeps_land_in_their_phases(manual, accumulate):
    """The real clock and real sleeps: each phase's shortest time over the steps holds its own
    sleep and at most loop overhead (a missed boundary would move 3 ms or more into a neighbour in
    every step; the shortest, because a busy 2-core host stalls steps by milliseconds, at times
    more than half of them, and a stall only ever adds time)."""
    sp, steps = _fit(manual, accumulate, batches=12, clock=None, profiler=SimpleProfiler() if manual else None)
    assert len(steps) == 12
    slack = 1.5 * MS  # sleep overshoot and Lightning's own loop code
    for stepping in ([True, False] if accumulate > 1 else [True]):
        mine = [(i, got) for i, got in enumerate(steps) if i > 0 and ((i + 1) % accumulate == 0) == stepping]
        want = _expected(mine[0][0], accumulate)
        for phase, w in enumerate(want):
            least = min(got[phase] for _, got in mine)
            assert w - 0.1 * MS <= least <= w + slack, (stepping, PHASES[phase], least, [g for _, g in mine])


class ClipsByHand(CostModel):
    """Manual optimization with user code between manual_backward and opt.step()."""

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.cost(4 * MS)  # e.g. clipping or logging by hand: training_step code, so forward
        opt.step()
        return loss


def test_manual_code_between_backward_and_the_step_is_forward():
    clock = FakeClock()
    sp = StepProfiler(report=False)
    cost = Cost(clock)
    with mock.patch("time.perf_counter", clock):
        model = ClipsByHand(cost, FWD_S, BWD_S, OPT_S, manual=True)
        t = trainer(max_epochs=1, callbacks=[sp, LoopOverhead(cost, OTHER_S)])
        t.fit(model, loader(BatchDataset(4, cost, DATA_S)))
    ph = sp.summary()[0]["phases_ms"]
    assert math.isclose(ph["forward"], FWD_S / MS + 4) and math.isclose(ph["backward"], BWD_S / MS), ph
    assert math.isclose(ph["optimizer"], OPT_S / MS) and math.isclose(ph["other"], OTHER_S / MS), ph


class HookWork(L.Callback):
    """A callback whose per-step hooks cost known times (e.g. gradient-norm logging)."""

    def __init__(self, cost: Cost) -> None:
        self.cost = cost

    def on_train_batch_start(self, *args) -> None:
        self.cost(0.5 * MS)

    def on_before_backward(self, *args) -> None:
        self.cost(0.25 * MS)

    def on_before_optimizer_step(self, *args) -> None:
        self.cost(2 * MS)


@pytest.mark.parametrize("first", [True, False])
def test_other_callbacks_hooks_go_to_the_phase_they_open_wherever_the_profiler_sits(first):
    """Work in another callback's on_train_batch_start is forward, in its on_before_backward
    backward, in its on_before_optimizer_step optimizer, before or after StepProfiler in the list
    (as it was with the profiler first, when it used hooks of its own)."""
    clock = FakeClock()
    cost = Cost(clock)
    sp = StepProfiler(report=False)
    work = HookWork(cost)
    with mock.patch("time.perf_counter", clock):
        t = trainer(max_epochs=1, callbacks=[sp, work] if first else [work, sp])
        t.fit(CostModel(cost, FWD_S, BWD_S, OPT_S), loader(BatchDataset(4, cost, DATA_S)))
    ph = sp.summary()[0]["phases_ms"]
    assert math.isclose(ph["forward"], FWD_S / MS + 0.5) and math.isclose(ph["backward"], BWD_S / MS + 0.25), ph
    assert math.isclose(ph["optimizer"], OPT_S / MS + 2) and math.isclose(ph["other"], 0.0, abs_tol=1e-9), ph
