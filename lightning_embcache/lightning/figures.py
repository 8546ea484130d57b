"""Combining the callbacks' per-rank figures into one logged value each (one all-reduce per log).

`DeferredSync` and `MemoryPressure` act on each rank's own shard and memory; what they log is
the whole job: seconds and fractions are the maximum over ranks (the slowest flush, the fullest
machine decide), row and byte counts the sum. The figures of all ranks travel in one
``all_reduce`` of a ``world_size x k`` buffer (`lightning_embcache.distributed.collectives.gather_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lightning_embcache.distributed.collectives import gather_rows
from lightning_embcache.distributed.exchange import world

#: how each logged key combines across ranks
REDUCE: dict[str, Callable[[Iterable[float]], float]] = {
    "embcache/sync_seconds": max,
    "embcache/synced_rows": sum,
    "embcache/dirty_rows": sum,
    "embcache/mem_used_fraction": max,
    "embcache/rss_bytes": sum,
    "embcache/evicted_bytes": sum,
}


def several_ranks() -> bool:
    return world()[1] > 1


def reduce_figures(
    metrics: Mapping[str, float], trainer: Any = None, *, present: bool = True
) -> dict[str, float] | None:
    """`metrics` of every rank combined by :data:`REDUCE` (a collective: every rank calls it).

    `present=False`: this rank has nothing to report this time but joins the reduction; returns
    None when no rank had anything.
    """
    keys = sorted(metrics)
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    rows = gather_rows([1.0 if present else 0.0, *(float(metrics[k]) if present else 0.0 for k in keys)], device)
    had = [r[1:] for r in rows if r[0] > 0]
    if not had:
        return None
    return {k: float(REDUCE.get(k, max)(r[i] for r in had)) for i, k in enumerate(keys)}
