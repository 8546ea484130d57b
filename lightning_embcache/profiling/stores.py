"""What the profiler reads from a module's embedding stores (``pl_module.embedding_stores``):
the seconds the training thread waited in them (at every phase boundary: kept cheap) and how
full their hot tiers are, with the write work they measured so far (a few times an epoch, for the
prediction: ``stats()`` can take milliseconds)."""

from __future__ import annotations

from typing import Any, NamedTuple


class HotTiers(NamedTuple):
    """One reading of the stores whose hot tier has a budget, summed over them: how full the hot
    tiers are, and the write work the stores measured since they were opened (cumulative)."""

    hot_bytes: float
    budget_bytes: float
    flushed_bytes: float = 0.0       # rows written by flushes, in bytes
    flush_seconds: float = 0.0       # what those flushes took (their thread's time)
    evicted_bytes: float = 0.0       # rows evicted from the hot tiers, in bytes
    write_back_seconds: float = 0.0  # writing evicted or cleaned dirty rows below the hot tier
    compaction_seconds: float = 0.0  # folding written rows into the table on disk
    row_bytes: float = 0.0           # bytes of a row (the largest over the stores; 0: unknown)


class StoreReadings:
    """Readings over the handles of ``stores`` (name -> handle with ``stats()``)."""

    def __init__(self, stores: dict[str, Any]) -> None:
        self.stores = stores

    def io_wait_seconds(self) -> float:
        """Cumulative seconds the calling (training) thread waited in store calls, summed over
        the stores; a store that does not count per thread gives its callers' total."""
        # O(1) on a handle; stats() scans dirty marks and the store folder
        return sum(_thread_wait(h) for h in self.stores.values())

    def hot_tiers(self) -> HotTiers | None:
        """:class:`HotTiers` summed over the stores whose hot tier has a budget (one ``stats()``
        per store), or None if none has."""
        total = [0.0] * 7
        row_bytes = 0.0
        for h in self.stores.values():
            s = h.stats()
            b = getattr(s, "hot_budget_bytes", 0) or 0
            if b <= 0:
                continue
            rb = _row_bytes(h, s)
            row_bytes = max(row_bytes, rb)
            for i, v in enumerate((s.hot_bytes, b, getattr(s, "flushed_rows", 0) * rb,
                                   getattr(s, "flush_seconds", 0.0), getattr(s, "evicted_bytes", 0),
                                   getattr(s, "write_back_seconds", 0.0), getattr(s, "compaction_seconds", 0.0))):
                total[i] += float(v or 0)
        return HotTiers._make([*total, row_bytes]) if total[1] > 0 else None


class DeviceTiers(NamedTuple):
    """The GPU tiers of a module's stores, summed (cumulative counters since each tier opened)."""

    host_to_device_bytes: float
    device_to_host_bytes: float
    loaded_rows: float
    evicted_rows: float
    in_host_ram: bool  # every tier keeps its rows in host RAM, trained in place over the bus
    staged_ahead_rows: float = 0.0  # brought up by a prefetch or an announced batch before their lookup
    lookup_rows: float = 0.0  # rows looked up, and of those, rows already on the GPU (hits)
    lookup_hit_rows: float = 0.0


def device_tiers(stores: dict[str, Any]) -> DeviceTiers | None:
    """`DeviceTiers` over the handles with a GPU tier open now (``device_stats()``), or None."""
    seen = [h.device_stats() for h in stores.values() if hasattr(h, "device_stats")]
    seen = [st for st in seen if st]
    if not seen:
        return None
    return DeviceTiers(float(sum(st.get("host_to_device_bytes", 0) for st in seen)),
                       float(sum(st.get("device_to_host_bytes", 0) for st in seen)),
                       float(sum(st.get("device_loaded_rows", 0) for st in seen)),
                       float(sum(st.get("device_evicted_rows", 0) for st in seen)),
                       all(st.get("device_mapped_host") and not st.get("device_bytes") for st in seen),
                       float(sum(st.get("device_staged_ahead_rows", 0) for st in seen)),
                       float(sum(st.get("device_lookup_rows", 0) for st in seen)),
                       float(sum(st.get("device_lookup_hit_rows", 0) for st in seen)))


def per_step(before: DeviceTiers | None, after: DeviceTiers | None, steps: int,
             step_seconds: float | None = None) -> dict | None:
    """What the GPU tiers moved per step between two readings (an epoch), for its summary;
    ``step_seconds`` (the epoch's mean step) turns bytes per step into bytes per second."""
    if after is None or steps <= 0:
        return None
    if before is None or after.host_to_device_bytes < before.host_to_device_bytes:
        before = DeviceTiers(0.0, 0.0, 0.0, 0.0, after.in_host_ram)  # opened during the epoch
    d = {k: float(getattr(after, k)) - float(getattr(before, k)) for k in DeviceTiers._fields if k != "in_host_ram"}
    up, down = d["host_to_device_bytes"] / steps, d["device_to_host_bytes"] / steps
    per_s = step_seconds if step_seconds is not None and step_seconds > 0 else None
    return {"host_to_device_bytes_per_step": up,
            "device_to_host_bytes_per_step": down,
            "host_to_device_bytes_per_s": up / per_s if per_s is not None else None,
            "device_to_host_bytes_per_s": down / per_s if per_s is not None else None,
            "rows_loaded_per_step": d["loaded_rows"] / steps,
            "rows_evicted_per_step": d["evicted_rows"] / steps,
            "rows_staged_ahead_per_step": d["staged_ahead_rows"] / steps,
            "lookup_hit_rate": d["lookup_hit_rows"] / d["lookup_rows"] if d["lookup_rows"] > 0 else None,
            "rows_in_host_ram": after.in_host_ram}


def _row_bytes(h: Any, s: Any) -> float:
    """Bytes of one row of store ``h``: its own figure, else the table's bytes over its rows
    (a Lightning handle), else 0 (flushed bytes then count as unknown)."""
    rb = getattr(h, "row_bytes", None)
    if isinstance(rb, (int, float)) and rb > 0:
        return float(rb)
    rows, table = getattr(h, "num_rows", None), getattr(s, "table_bytes", 0)
    if isinstance(rows, int) and rows > 0 and isinstance(table, (int, float)) and table > 0:
        return table / rows
    return 0.0


def _thread_wait(h: Any) -> float:
    """Seconds the calling thread waited in store ``h`` (a background flush's time is its own
    thread's, overlapping the step); falls back to the total over threads, then to stats()."""
    own = getattr(h, "thread_io_wait_seconds", None)
    if own is not None:
        return own()
    return h.io_wait_seconds if hasattr(h, "io_wait_seconds") else h.stats().io_wait_seconds
