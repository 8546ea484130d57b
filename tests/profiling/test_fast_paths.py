"""The per-step fast paths give what the general code gives: the batch size against Lightning's
``extract_batch_size``, the tap's actions behind ``PassThroughProfiler`` and behind a recording
profiler (its own record of the actions as reference)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_embcache.profiling import boundaries
from lightning_embcache.profiling.tap import ProfilerTap

Pair = namedtuple("Pair", "x y")


@pytest.mark.parametrize("batch", [
    torch.zeros(5, 3), torch.zeros(()), (torch.zeros(7, 2), torch.zeros(7)), [torch.zeros(4), torch.zeros(4, 1)],
    (torch.zeros(()), torch.zeros(6, 2)), {"x": torch.zeros(3, 2)}, Pair(torch.zeros(9, 1), torch.zeros(9)),
    (torch.nn.Parameter(torch.zeros(2, 2)),), ([torch.zeros(8, 1)], torch.zeros(8)),
])
def test_batch_size_fast_path_agrees_with_lightning(batch):
    want = 1 if isinstance(batch, torch.Tensor) and batch.ndim == 0 else extract_batch_size(batch)
    got = boundaries.batch_size(batch)
    assert got == want and type(got) is int


def _tap(inner):
    seen = []
    tap = ProfilerTap(inner, {"a": lambda: seen.append("a+")}, {"a": lambda: seen.append("a-"),
                                                                "b": lambda: seen.append("b-")})
    return tap, seen


def test_tap_behind_passthrough_calls_hooks_and_ignores_other_actions():
    tap, seen = _tap(PassThroughProfiler())
    for name in ("a", "b", "untracked", "untracked"):
        with tap.profile(name) as got:
            if name != "untracked":
                assert got == name
    tap.start("a")
    tap.stop("a")
    tap.start("untracked")
    tap.stop("b")
    assert seen == ["a+", "a-", "b-", "a+", "a-", "b-"]


def test_tap_rebound_onto_a_recording_profiler_forwards_every_action():
    plain = PassThroughProfiler()
    tap, seen = _tap(ProfilerTap(plain, {}, {}))  # over another tap: the general path
    simple = SimpleProfiler()
    ProfilerTap.remove(tap, tap.inner)  # now directly over the passthrough: the fast path
    assert tap.inner is plain and "profile" in tap.__dict__
    tap._bind(simple)  # and over a recording profiler again: no fast path left behind
    assert "profile" not in tap.__dict__ and "start" not in tap.__dict__
    with tap.profile("a"):
        pass
    tap.start("c")
    tap.stop("c")
    assert seen == ["a+", "a-"]
    assert {"a", "c"} <= set(simple.recorded_durations)


@pytest.mark.parametrize("inner", [PassThroughProfiler, SimpleProfiler])
def test_an_exception_inside_any_action_propagates(inner):
    tap, seen = _tap(inner())
    for name in ("a", "b", "untracked"):
        with pytest.raises(KeyError, match="boom"):
            with tap.profile(name):
                raise KeyError("boom")
    assert seen == ["a+", "a-", "b-"]  # a stop hook still runs on the way out


@pytest.mark.parametrize("inner", [PassThroughProfiler, SimpleProfiler])
def test_an_action_tracked_later_reaches_the_bound_fast_path(inner):
    tap, seen = _tap(inner())
    profile = tap.profile  # bound before: the fast path is the action table's own lookup
    with profile("late"):
        pass
    tap.track("late", on_start=lambda: seen.append("late+"))
    with tap.profile("late"):
        pass
    if inner is PassThroughProfiler:
        with profile("late"):
            pass
    assert seen == ["late+"] * (2 if inner is PassThroughProfiler else 1)
