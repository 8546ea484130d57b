"""StoreStats: what the store did, for logs, the profiler and the memory-pressure callback."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import StoreCore
    from .tiers import Tiers
    from .versions import Versions


@dataclass
class StoreStats:
    """A snapshot; counters are cumulative since the store was opened.

    ``io_wait_seconds`` is the wall time callers spent inside get/update/flush/prefetch: the
    share of a training step the StepProfiler reports as ``store_io``.
    """

    hot_bytes: int = 0
    warm_bytes: int = 0
    hot_budget_bytes: int = 0
    warm_budget_bytes: int = 0
    disk_bytes: int = 0
    hot_hits: int = 0
    hot_misses: int = 0
    warm_hits: int = 0
    warm_misses: int = 0
    cold_reads: int = 0
    dirty_rows: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    flushes: int = 0
    flushed_rows: int = 0
    compactions: int = 0
    superseded_segments: int = 0  # segments left out of a flush's manifest: all their rows flushed again since
    flush_seconds: float = 0.0  # writing flushes: segment, fsyncs, manifest (what a flush costs per byte here)
    write_back_seconds: float = 0.0  # writing evicted or cleaned dirty rows below the hot tier
    compaction_seconds: float = 0.0  # compaction rounds, in the background or in a flush
    compaction_bytes_written: int = 0  # bytes compaction rounds wrote (chunk files, chunk maps, manifests)
    compaction_folded_bytes: int = 0  # bytes of the rows rounds folded into base files (each row once a chunk)
    chunks_folded_in_place: int = 0  # chunk folds that wrote just the changed rows into the file (inplace.py)
    compaction_process_chunks: int = 0  # chunks folded by the compaction process (off this process's GIL)
    compaction_process_failures: int = 0  # rounds it failed or died in (then folded in this process)
    compaction_process_rss_bytes: int = 0  # its peak resident bytes beyond its interpreter's (~30 MiB more)
    compression_ratio: float = 1.0
    io_wait_seconds: float = 0.0
    version: int = 0
    prefetched_rows: int = 0
    evicted_bytes: int = 0
    cleaned_rows: int = 0
    gets: int = 0
    updates: int = 0
    segments: int = 0
    pending_segments: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    stall_seconds: float = 0.0
    warm_bytes_read: int = 0
    warm_bytes_written: int = 0
    table_bytes: int = 0
    chunks_read_ahead: int = 0  # announced chunks read whole into the warm tier by kernel threads
    damaged: int = 0  # 1 once a damaged file was met: background work on the folder stopped (fail-stop)

    _COUNTERS = (
        "hot_hits",
        "hot_misses",
        "cold_reads",
        "flushes",
        "flushed_rows",
        "compactions",
        "superseded_segments",
        "flush_seconds",
        "compaction_seconds",
        "compaction_bytes_written",
        "compaction_folded_bytes",
        "chunks_folded_in_place",
        "compaction_process_chunks",
        "compaction_process_failures",
        "prefetched_rows",
        "evicted_bytes",
        "cleaned_rows",
        "gets",
        "updates",
        "prefetch_hits",
        "prefetch_misses",
        "stall_seconds",
        "chunks_read_ahead",
    )

    @classmethod
    def counter_fields(cls) -> tuple[str, ...]:
        """Names of the fields that count events (they add up across stores and ranks)."""
        return cls._COUNTERS

    @property
    def hot_hit_rate(self) -> float:
        """Share of looked-up rows found in the hot tier."""
        total = self.hot_hits + self.hot_misses
        return self.hot_hits / total if total else 1.0

    @property
    def prefetch_hit_rate(self) -> float:
        """Of the rows a lookahead hint announced, the share that was in memory when read: hot,
        or in a chunk held whole in the warm tier (1.0 if none)."""
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else 1.0

    @property
    def stall_seconds_per_get(self) -> float:
        """Mean time a get (or update) waited on reads below the hot tier."""
        return self.stall_seconds / self.gets if self.gets else 0.0

    @property
    def disk_use_ratio(self) -> float:
        """Bytes of the store directory over the table's bytes (rows x record bytes)."""
        return self.disk_bytes / self.table_bytes if self.table_bytes else 0.0

    def as_dict(self) -> dict[str, float]:
        """Every figure by field name (what loggers take)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def snapshot(core: StoreCore, tiers: Tiers, versions: Versions, io_wait: float) -> StoreStats:
    """`EmbeddingStore.stats`: the counters and the parts' figures taken under the lock; the
    compaction process's memory and the folder's size read outside it (get/update need it every step)."""
    with core.lock:
        s = StoreStats(**{k: getattr(core.stats, k) for k in StoreStats.counter_fields()})
        tiers.fill_stats(s)
        versions.fill_stats(s)
        s.table_bytes = core.num_rows * core.row_bytes
        s.io_wait_seconds = io_wait
        disk = versions.disk if not core.closed else None
        fold = versions.compaction.fold_proc
    if fold is not None and fold.base_rss:  # /proc reads: outside the lock
        s.compaction_process_rss_bytes = max(0, fold.peak_rss() - fold.base_rss)
    # a scan of the store's folders: outside the lock, which get/update need every step
    try:
        s.disk_bytes = disk.disk_bytes() if disk is not None else 0
    except FileNotFoundError:  # closed meanwhile, and the folder of an ephemeral store removed
        s.disk_bytes = 0
    return s
