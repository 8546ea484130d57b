"""Fair comparisons, one way for every benchmark: variants interleaved in a rotating order within
each repetition, and ratios as the median of per-repetition *paired* ratios with their range.

A ratio of two medians hides how far the machine moved between variants; a paired ratio compares
two variants measured minutes apart at most, in the same repetition, and its spread over
repetitions is the noise a reader should see beside it. Rotating the order keeps any variant from
always running first (after the previous repetition's teardown) or last.

    order = rotating_order(["anchor", "store"], rep)           # rep 0: anchor, store; rep 1: store, anchor
    runs = run_interleaved({"anchor": time_anchor, "store": time_store}, reps=5)
    summary = paired_ratios(runs, numerator="anchor", denominator="store")   # > 1: store faster
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

T = TypeVar("T")

#: the fewest repetitions behind a figure a benchmark reports as a result
MIN_REPS = 5


def rotating_order(variants: Sequence[T], rep: int) -> list[T]:
    """``variants`` rotated by ``rep``: over len(variants) repetitions each runs once in each place."""
    if not variants:
        return []
    k = rep % len(variants)
    return list(variants[k:]) + list(variants[:k])


def run_interleaved(variants: Mapping[str, Callable[[], float]], reps: int = MIN_REPS,
                    on_result: Callable[[int, str, float], None] | None = None) -> dict[str, list[float]]:
    """Call every variant once per repetition, in `rotating_order`; each call returns its figure
    (seconds, or a rate: the caller knows). Returns name -> figures in repetition order."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1; got {reps}")
    names = list(variants)
    out: dict[str, list[float]] = {n: [0.0] * reps for n in names}
    for rep in range(reps):
        for name in rotating_order(names, rep):
            value = float(variants[name]())
            out[name][rep] = value
            if on_result is not None:
                on_result(rep, name, value)
    return out


@dataclass(frozen=True)
class PairedRatio:
    """``numerator / denominator`` per repetition, summarised: median, range and count."""

    median: float
    low: float
    high: float
    reps: int
    per_rep: tuple[float, ...]

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f}, {self.reps} reps)"


def paired_ratios(runs: Mapping[str, Sequence[float]], numerator: str, denominator: str) -> PairedRatio:
    """The median of per-repetition ratios ``runs[numerator][i] / runs[denominator][i]``, with their
    range. For times, ``numerator="anchor"`` gives "> 1: faster than the anchor"; for rates, swap."""
    a, b = runs[numerator], runs[denominator]
    if len(a) != len(b) or not a:
        raise ValueError(f"paired ratios need the same non-zero number of repetitions; got {len(a)} and {len(b)}")
    ratios = tuple(x / y for x, y in zip(a, b))
    return PairedRatio(statistics.median(ratios), min(ratios), max(ratios), len(ratios), ratios)
