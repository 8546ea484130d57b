"""StepProfiler follows Lightning's conventions: the Trainer's log interval, its own checkpoint
entry (state_key), a clear error as Trainer(profiler=...), a chart whose title is whole."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from _profiling_helpers import MS, BatchDataset, Cost, CostModel, FakeClock, LoopOverhead, loader, trainer
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

from lightning_embcache import StepProfiler
from lightning_embcache.profiling.tap import ProfilerTap


def _fit(callbacks, batches=6, clock=None, **kw):
    clock = clock or FakeClock()
    cost = Cost(clock)
    ckpt_path = kw.pop("ckpt_path", None)
    with mock.patch("time.perf_counter", clock):
        t = trainer(max_epochs=kw.pop("epochs", 1), callbacks=[*callbacks, LoopOverhead(cost, 1 * MS)], **kw)
        t.fit(CostModel(cost, 5 * MS, 7 * MS, 4 * MS), loader(BatchDataset(batches, cost, 2 * MS)),
              ckpt_path=ckpt_path)
    return t


def test_default_log_interval_is_the_trainers(tmp_path):
    logger = mock.Mock()
    logger.save_dir = logger.log_dir = str(tmp_path)
    sp = StepProfiler(report=False)
    _fit([sp], batches=6, logger=logger, log_every_n_steps=3)
    steps = [c.kwargs["step"] for c in logger.log_metrics.call_args_list
             if "profile/step_ms" in c.kwargs["metrics"]]
    assert steps == [3, 6] and sp.log_every_n_steps == 3


def test_passing_it_as_the_trainers_profiler_is_a_clear_error():
    with pytest.raises(MisconfigurationException, match=r"Trainer\(callbacks=\[StepProfiler\(\)\]\)"):
        _fit([], profiler=StepProfiler())


def test_two_profilers_keep_their_own_checkpoint_entries_and_both_measure(tmp_path):
    a, b = StepProfiler(report=False, log_every_n_steps=2), StepProfiler(report=False, warmup_steps=1)
    assert a.state_key != b.state_key
    simple = SimpleProfiler()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = _fit([a, b, ckpt], batches=6, profiler=simple, enable_checkpointing=True)
    assert t.profiler is simple  # both taps removed, whatever the teardown order
    for sp in (a, b):
        ph = sp.summary()[0]["phases_ms"]
        assert math.isclose(ph["data_wait"], 2.0) and math.isclose(ph["optimizer"], 4.0), ph
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]
    assert a.state_key in saved and b.state_key in saved
    assert saved[a.state_key]["summaries"][0]["batches"] == 6
    # resuming gives each profiler its own entry back
    a2, b2 = StepProfiler(report=False, log_every_n_steps=2), StepProfiler(report=False, warmup_steps=1)
    _fit([a2, b2], batches=6, epochs=2, ckpt_path=str(tmp_path / "last.ckpt"))
    assert [e["epoch"] for e in a2.summary()] == [0, 1] and [e["epoch"] for e in b2.summary()] == [0, 1]
    assert a2.summary()[0]["steady_batches"] == 6 and b2.summary()[0]["steady_batches"] == 5


def test_two_profilers_with_the_same_settings_are_refused_by_lightning():
    with pytest.raises(RuntimeError, match="state_key"):
        _fit([StepProfiler(report=False), StepProfiler(report=False)])


def test_invalid_new_arguments():
    with pytest.raises(ValueError, match="sample_every_n_steps=0"):
        StepProfiler(sample_every_n_steps=0)
    with pytest.raises(ValueError, match="predict_at=1.5"):
        StepProfiler(predict_at=1.5)
    with pytest.raises(ValueError, match="log_every_n_steps=0"):
        StepProfiler(log_every_n_steps=0)


def test_the_tap_chain_unwinds_in_any_order():
    inner = PassThroughProfiler()
    first = ProfilerTap(inner, {}, {})
    second = ProfilerTap(first, {}, {})
    top = ProfilerTap.remove(second, first)  # the inner one leaves first
    assert top is second and second.inner is inner
    assert ProfilerTap.remove(top, second) is inner


def test_plot_title_is_whole(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    from lightning_embcache.profiling import report

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    sp = StepProfiler(report=False, plot=tmp_path / "phases.png")
    _fit([sp], batches=3)
    assert (tmp_path / "phases.png").stat().st_size > 0
    fig = figures[-1]
    title = fig._suptitle
    assert title is not None and title.get_text() == report.PLOT_TITLE
    fig.canvas.draw()
    box = title.get_window_extent()
    width, height = fig.canvas.get_width_height()
    assert 0 <= box.x0 and box.x1 <= width and box.y1 <= height, (box, width, height)


def test_state_key_is_built_once_per_settings():
    from unittest import mock

    from lightning_embcache import StepProfiler

    sp = StepProfiler(report=False, warmup_steps=3)
    with mock.patch.object(StepProfiler, "_generate_state_key", wraps=sp._generate_state_key) as gen:
        key = sp.state_key
        # Lightning reads it for every hook call's profiler action: six times a step
        assert all(sp.state_key is key for _ in range(100))
        assert gen.call_count == 1
        sp.warmup_steps = 4  # another setting: another key, as Lightning's own would be
        assert sp.state_key != key and gen.call_count == 2
    assert key == StepProfiler(report=False, warmup_steps=3).state_key


def _counting_profiler(calls: list) -> type:
    """A SimpleProfiler class that appends every action it starts to ``calls``."""

    class Counting(SimpleProfiler):
        def start(self, action_name):
            calls.append(action_name)
            super().start(action_name)

    return Counting


@pytest.mark.parametrize("manual", [False, True])
def test_no_per_step_callback_hook_is_called(manual):
    """Lightning calls a callback hook only where it is callable, and each call costs the loop an
    action named after the state_key: the profiler takes every boundary from actions Lightning
    opens anyway, and hides all six per-step hooks during the fit; the phases stay exact."""
    calls: list = []
    Counting = _counting_profiler(calls)

    sp = StepProfiler(report=False)
    clock = FakeClock()
    with mock.patch("time.perf_counter", clock):
        t = trainer(max_epochs=1, callbacks=[sp], profiler=Counting())
        t.fit(CostModel(Cost(clock), 2 * MS, 3 * MS, 4 * MS, manual=manual), loader(BatchDataset(5, Cost(clock), MS)))
    mine = [c.rsplit(".", 1)[1] for c in calls if c.startswith(f"[Callback]{sp.state_key}.")]
    per_step = {"on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_zero_grad",
                "on_before_optimizer_step", "on_train_batch_end"}
    assert not per_step & set(mine), mine
    assert "on_train_epoch_start" in mine  # epoch-level hooks are still called
    e = sp.summary()[0]
    assert e["batches"] == 5 and e["samples"] == 20
    ph = e["phases_ms"]
    assert math.isclose(ph["forward"], 2.0) and math.isclose(ph["backward"], 3.0), ph
    assert math.isclose(ph["optimizer"], 4.0) and math.isclose(ph["data_wait"], 1.0), ph
    # after the fit the hooks are the class's again (a later fit may need them)
    assert all(callable(getattr(sp, h)) for h in per_step)
    assert not per_step & set(vars(sp))


def test_without_the_loops_batch_the_batch_start_hook_counts_samples():
    """Where the loop's batch is out of reach (another Lightning), on_train_batch_start stays
    visible for the batch size alone; the phases come from the actions all the same."""
    calls: list = []
    Counting = _counting_profiler(calls)

    sp = StepProfiler(report=False)
    clock = FakeClock()
    with mock.patch("time.perf_counter", clock), \
            mock.patch("lightning_embcache.profiling.boundaries.loop_batch", return_value=None):
        t = trainer(max_epochs=1, callbacks=[sp], profiler=Counting())
        t.fit(CostModel(Cost(clock), 2 * MS, 3 * MS, 4 * MS), loader(BatchDataset(5, Cost(clock), MS, batch=3)))
    mine = [c.rsplit(".", 1)[1] for c in calls if c.startswith(f"[Callback]{sp.state_key}.")]
    assert mine.count("on_train_batch_start") == 5 and "on_train_batch_end" not in mine, mine
    e = sp.summary()[0]
    assert e["samples"] == 15
    assert math.isclose(e["phases_ms"]["forward"], 2.0) and math.isclose(e["phases_ms"]["optimizer"], 4.0)


def test_validation_batch_hooks_are_called_in_the_sanity_check_only():
    """They only serve the sanity check (the prediction's validation estimate), which Lightning
    runs before on_train_start: validation inside the epoch does not call them."""
    calls: list = []
    Counting = _counting_profiler(calls)

    sp = StepProfiler(report=False)
    clock = FakeClock()
    cost = Cost(clock)
    with mock.patch("time.perf_counter", clock):
        t = trainer(max_epochs=1, callbacks=[sp], profiler=Counting(), num_sanity_val_steps=2, val_check_interval=3)
        t.fit(CostModel(cost, MS, MS, MS, val_s=2 * MS), loader(BatchDataset(6, cost, MS)),
              loader(BatchDataset(4, cost, 0.0)))
    mine = [c.rsplit(".", 1)[1] for c in calls if c.startswith(f"[Callback]{sp.state_key}.")]
    assert mine.count("on_validation_batch_start") == 2 and mine.count("on_validation_batch_end") == 2, mine
    assert mine.count("on_validation_start") == 3  # the sanity check and two runs inside the epoch
    e = sp.summary()[0]
    assert math.isclose(e["val_seconds"], 2 * 4 * 2 * MS), e
    assert callable(sp.on_validation_batch_start) and "on_validation_batch_start" not in vars(sp)
