"""Combining per-rank figures with one collective.

Each rank writes its values into its own slot of a ``world_size x k`` buffer of zeros and the
buffer is summed with one ``all_reduce``: every rank then holds every rank's row, from which sums,
maxima, the slowest rank and the spread follow locally. One collective of ``world_size * k``
doubles (a few KiB even for a thousand ranks) replaces a SUM and a MAX reduction and also says
*which* rank is slowest.
"""

from __future__ import annotations

from lightning_embcache.distributed.collectives import PendingRows, gather_rows, world

__all__ = ["PendingRows", "gather_rows", "spread", "world"]


def spread(rows: list[list[float]], wall_col: int, batches_col: int, wait_col: int) -> tuple[float, int, float]:
    """Which rank is the straggler: (max ms/step, that rank, spread in % of the mean).

    Ranks are compared on their time per step *outside* column ``wait_col`` (backward), because
    DDP's gradient all-reduce makes every fast rank wait there for the slowest one; compared on
    whole steps, all ranks of a synchronous job look alike.
    """
    vals = [1e3 * (r[wall_col] - r[wait_col]) / r[batches_col] if r[batches_col] else 0.0 for r in rows]
    hi = max(vals)
    mean = sum(vals) / len(vals)
    pct = 100.0 * (hi - min(vals)) / mean if mean > 0 else 0.0
    return hi, vals.index(hi), pct
