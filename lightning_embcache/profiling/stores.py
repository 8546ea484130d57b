"""What the profiler reads from a module's embedding stores (``pl_module.embedding_stores``):
the seconds the training thread waited in them (at every phase boundary: kept cheap) and how
full their hot tiers are (twice an epoch, for the prediction: ``stats()`` can take milliseconds)."""

from __future__ import annotations

from typing import Any, Optional


class StoreReadings:
    """Readings over the handles of ``stores`` (name -> handle with ``stats()``)."""

    def __init__(self, stores: dict[str, Any]) -> None:
        self.stores = stores

    def io_wait_seconds(self) -> float:
        """Cumulative seconds the calling (training) thread waited in store calls, summed over
        the stores; a store that does not count per thread gives its callers' total."""
        # O(1) on a handle; stats() scans dirty marks and the store folder
        return sum(_thread_wait(h) for h in self.stores.values())

    def hot_tiers(self) -> Optional[tuple[float, float]]:
        """(hot bytes, hot budget bytes) summed over the stores whose hot tier has a budget."""
        hot = budget = 0.0
        for h in self.stores.values():
            s = h.stats()
            b = getattr(s, "hot_budget_bytes", 0) or 0
            if b > 0:
                hot += s.hot_bytes
                budget += b
        return (hot, budget) if budget > 0 else None


def _thread_wait(h: Any) -> float:
    """Seconds the calling thread waited in store ``h`` (a background flush's time is its own
    thread's, overlapping the step); falls back to the total over threads, then to stats()."""
    own = getattr(h, "thread_io_wait_seconds", None)
    if own is not None:
        return own()
    return h.io_wait_seconds if hasattr(h, "io_wait_seconds") else h.stats().io_wait_seconds
