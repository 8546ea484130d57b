"""The trace check's device span of a phase: what CUDA events at the phase's two ends measure,
computed from a trace's launch times and kernel end times."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")
from benchmarks.profiler_gpu import device_spans  # noqa: E402


def test_a_device_bound_phase_spans_until_its_last_kernel_ends():
    # forward launched at 0 and 1 (host done at 3), kernels end at 5 and 20; backward [3, 4]
    spans = device_spans([(0, 5), (1, 20)], {"forward": [(0, 3)], "backward": [(3, 4)]})
    assert spans == {"forward": 20, "backward": 0}  # backward's start waits for forward's kernels


def test_a_host_bound_phase_spans_the_host_window():
    spans = device_spans([(0, 1), (2, 3)], {"forward": [(0, 10)], "backward": [(10, 12)]})
    assert spans == {"forward": 10, "backward": 2}


def test_idle_gaps_waiting_for_launches_count_where_kernel_time_does_not():
    # two 1-unit kernels, the second launched 5 units later: kernel time 2, span 6
    launched = [(0, 1), (5, 6)]
    assert device_spans(launched, {"forward": [(0, 5.5)]}) == {"forward": 6}
    # summed over steps
    two = launched + [(10, 11), (15, 16)]
    assert device_spans(two, {"forward": [(0, 5.5), (10, 15.5)]}) == {"forward": 12}
