"""The benchmark harness interleaves variants in a rotating order and pairs ratios per repetition."""

from __future__ import annotations

import pytest

from benchmarks.harness import paired_ratios, rotating_order, run_interleaved


def test_every_variant_runs_once_in_each_place_over_as_many_repetitions():
    names = ["a", "b", "c"]
    orders = [rotating_order(names, rep) for rep in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for place in range(3):
        assert sorted(o[place] for o in orders) == names


def test_run_interleaved_calls_in_rotating_order_and_keeps_repetitions_apart():
    calls = []
    values = iter(range(100))

    def make(name):
        def run():
            calls.append(name)
            return next(values)
        return run

    runs = run_interleaved({"x": make("x"), "y": make("y")}, reps=4)
    assert calls == ["x", "y", "y", "x", "x", "y", "y", "x"]
    assert runs == {"x": [0, 3, 4, 7], "y": [1, 2, 5, 6]}


def test_paired_ratios_are_per_repetition_not_a_ratio_of_medians():
    # the machine slows 3x in the last two repetitions: medians would mislead, pairs do not
    runs = {"anchor": [1.0, 1.0, 1.0, 3.0, 3.0], "store": [2.0, 2.0, 2.0, 6.0, 6.0]}
    r = paired_ratios(runs, "anchor", "store")
    assert (r.median, r.low, r.high, r.reps) == (0.5, 0.5, 0.5, 5)
    runs["store"][0] = 0.5
    r = paired_ratios(runs, "anchor", "store")
    assert r.median == 0.5 and r.high == 2.0 and r.per_rep[0] == 2.0
    assert str(r) == "0.50x (0.50-2.00, 5 reps)"


def test_unpaired_runs_are_refused():
    with pytest.raises(ValueError, match="same non-zero number"):
        paired_ratios({"a": [1.0, 2.0], "b": [1.0]}, "a", "b")
    with pytest.raises(ValueError, match="reps must be"):
        run_interleaved({"a": lambda: 1.0}, reps=0)
