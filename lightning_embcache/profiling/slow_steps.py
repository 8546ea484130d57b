"""Which phase moved when the step time moved: the slow-step line of the end-of-fit table.

An epoch's steps are cut into twentieths; the slowest twentieth is compared, phase by phase, with
the typical one (each phase's median over the twentieths). Where every phase that takes a real
share of the step stretched together, the host got slower (a busier or throttled CPU, a GPU's
clocks); where one phase holds most of the extra time, that phase is named: data_wait is the
loader falling behind, store_io the embedding store's disk. Rare single stalls move a twentieth
little; this is about the level of the step time moving.

Fed on the host clock with each batch of finished steps the predictor hands over (never per step),
summed in blocks of ``BLOCK`` steps: a few bytes per step, O(steps) once per handover.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from lightning_embcache.profiling.timeline import BACKWARD, DATA, FORWARD, NUM_PHASES, OPTIMIZER, OTHER, PHASES, STORE

BLOCK = 16  # consecutive steps summed into one block
SEGMENTS = 20  # an epoch is compared in (up to) twentieths
MIN_SEGMENTS = 4
MOVED = 0.05  # the slowest twentieth this much over the typical one is worth naming
SHARE = 0.10  # a phase with this share of the typical step counts in "every phase stretched"
TOGETHER = 0.5  # ... if each grew by at least this fraction of the step's relative growth

# the phase holding most of the extra time, and what it says
CAUSES = {
    DATA: ("loader", "the loader fell behind (more num_workers, lighter __getitem__)"),
    STORE: ("store", "the store's disk fell behind (hot_bytes, read-ahead: docs/tuning.md)"),
    FORWARD: ("forward", "forward took longer"),
    BACKWARD: ("backward", "backward took longer"),
    OPTIMIZER: ("optimizer", "the optimizer step took longer"),
    OTHER: ("other", "loop code between steps took longer (callbacks, logging)"),
}
HOST = ("host", "the host got slower: every phase stretched together")
STEADY = ("steady", "the step time held (slowest twentieth within 5% of the typical)")


class PhaseBlocks:
    """One epoch's per-phase host seconds, summed in blocks of ``BLOCK`` consecutive steps. The
    epoch's first step (the loader's start-up) is left out when ``skip_first``."""

    def __init__(self, skip_first: bool = True) -> None:
        self._sums = array("d")  # NUM_PHASES per block
        self._carry = np.empty((0, NUM_PHASES))
        self._skip = skip_first

    def add(self, hosts: np.ndarray | Sequence[Sequence[float]]) -> None:
        """Finished steps' host phases, a row a step (timeline order; extra columns ignored)."""
        if len(hosts) == 0:
            return
        a = np.asarray(hosts, dtype=np.float64)[:, :NUM_PHASES]
        if self._skip:
            self._skip = False
            a = a[1:]
        if self._carry.shape[0]:
            a = np.concatenate([self._carry, a])
        full = a.shape[0] // BLOCK * BLOCK
        if full:
            self._sums.extend(a[:full].reshape(-1, BLOCK, NUM_PHASES).sum(axis=1).ravel())
        self._carry = a[full:]

    def segments(self, n: int = SEGMENTS) -> list[list[float]]:
        """Mean ms per step of each phase over each of up to ``n`` consecutive stretches of the
        epoch ([] for fewer than ``MIN_SEGMENTS`` blocks)."""
        b = np.frombuffer(self._sums, dtype=np.float64).reshape(-1, NUM_PHASES)
        k = min(n, b.shape[0])
        if k < MIN_SEGMENTS:
            return []
        size = b.shape[0] // k
        seg = b[:k * size].reshape(k, size, NUM_PHASES).sum(axis=1) * (1e3 / (size * BLOCK))
        return seg.tolist()


def attribute(segments: Sequence[Sequence[float]]) -> dict | None:
    """The slowest stretch of steps against the typical one, phase by phase, and its cause.

    ``segments``: per stretch, mean ms per step of each phase (:meth:`PhaseBlocks.segments`,
    several epochs' pooled). Returns ``{"typical_ms", "slow_ms", "moved_pct", "delta_ms": {phase:
    ms}, "cause", "reason"}``; None for fewer than ``MIN_SEGMENTS`` stretches."""
    s = np.asarray(segments, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] < MIN_SEGMENTS:
        return None
    typical = np.median(s, axis=0)
    typ_step = float(typical.sum())
    steps = s.sum(axis=1)
    i = int(np.argmax(steps))
    delta = s[i] - typical
    moved = float(steps[i]) / typ_step - 1.0 if typ_step > 0 else 0.0
    out = {"typical_ms": typ_step, "slow_ms": float(steps[i]), "moved_pct": 100.0 * moved,
           "delta_ms": {p: float(d) for p, d in zip(PHASES, delta)}}
    if moved < MOVED:
        cause = STEADY
    else:
        big = [j for j in range(NUM_PHASES) if typical[j] >= SHARE * typ_step]
        grew = [s[i, j] / typical[j] - 1.0 for j in big]
        if len(big) >= 2 and min(grew) >= TOGETHER * moved:
            cause = HOST
        else:
            cause = CAUSES[int(np.argmax(delta))]
    out["cause"], out["reason"] = cause
    return out


def describe(a: dict) -> str:
    """One line of the end-of-fit table for :func:`attribute`'s result."""
    if a["cause"] == STEADY[0]:
        return (f"slow steps: none; the slowest twentieth ran {a['slow_ms']:.2f} ms/step against "
                f"{a['typical_ms']:.2f} typical ({a['moved_pct']:+.0f}%)")
    moved = sorted(a["delta_ms"].items(), key=lambda kv: -abs(kv[1]))
    parts = ", ".join(f"{p} {d:+.2f}" for p, d in moved if abs(d) >= 0.005 * a["typical_ms"])
    return (f"slow steps: the slowest twentieth ran {a['slow_ms']:.2f} ms/step against {a['typical_ms']:.2f} "
            f"typical ({a['moved_pct']:+.0f}%; ms/step: {parts}): {a['reason']}")
