"""Growing a store's table (`EmbeddingStore.grow`): more rows, the same store.

A grown store is the store reopened at its version with more rows. The rows not flushed yet
(dirty in the hot tier, or written back since the last flush) are read out first and written
again after, so the next flush makes them and the new size durable together: its manifest
records ``num_rows`` (docs/store-format.md). Until then the version on disk keeps its size, so a
crash, a checkpoint's version or a pinned one reopens the table as it was, exactly.

New rows hold what a store created at the new size would hold: initial values are a function
of the id alone (``init="zeros"``, ``"normal"`` per row, a callable of the ids). The last chunk of
the old table may be short; its base file holds the old rows only, so the grown layout drops it
(those rows are carried with the unflushed ones) and the chunk reads as never written plus them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import idsets
from .errors import InvalidArgumentError, InvalidTypeError, StoreError
from .limits import MAX_ROWS
from .stats import StoreStats


@dataclass(frozen=True)
class Kept:
    """What a grown store keeps from before: its locks (other threads may wait on them), the
    writer lock's descriptor (never let go of), its counters and its version."""

    lock: threading.RLock
    stats: StoreStats
    row_thread: int
    io_wait: float
    io_wait_by_thread: dict[int, float]
    flush_lock: threading.RLock
    no_flush_waiting: threading.Condition
    flush_waiting: int
    lock_fd: int | None
    fold_proc_failed: bool
    fold_proc_restarts: int
    version: int

    @classmethod
    def of(cls, store: Any) -> Kept:
        core = store._core
        return cls(lock=core.lock, stats=core.stats, row_thread=core.row_thread, io_wait=store._io_wait,
                   io_wait_by_thread=store._io_wait_by_thread, **store._versions.kept())

    def apply(self, store: Any) -> None:
        """Onto the store being reconstructed (its new `StoreCore` made, its `Versions` not yet)."""
        core = store._core
        core.lock, core.stats, core.row_thread = self.lock, self.stats, self.row_thread
        store._io_wait, store._io_wait_by_thread = self.io_wait, self.io_wait_by_thread


@dataclass(frozen=True)
class Grown:
    """The constructor's ``grown`` argument: the new size and what is kept (`grow`)."""

    num_rows: int
    kept: Kept


def check_rows(store: Any, num_rows: Any) -> int:
    """``num_rows`` of a `grow` call, checked against the store (nothing changed on refusal)."""
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)):
        raise InvalidTypeError(f"num_rows must be an int; got {type(num_rows).__name__} {num_rows!r}")
    n, now = int(num_rows), store.num_rows
    if n < now:
        raise InvalidArgumentError(
            f"num_rows must be in [{now}, {MAX_ROWS}]; got {n}: the table has {now} rows and a store "
            f"grows, it never shrinks (ids are never taken back)"
        )
    if n > MAX_ROWS:
        raise InvalidArgumentError(f"num_rows must be in [{now}, {MAX_ROWS}] (the id limit); got {n}")
    if n > now and store._core.init_kind == "normal" and store._core.meta.get("init_version", 1) < 2:
        raise InvalidArgumentError(
            "grow() needs initial values made per row; this store was created by lightning_embcache 0.1 with "
            "init='normal', whose values are drawn per chunk (a grown last chunk would differ from a store "
            "created at the new size). Export its rows and create a new store at the size you need"
        )
    return n


def unflushed_ids(store: Any) -> np.ndarray:
    """Sorted ids whose rows a reopened store would not find on disk as they are now: rows not
    flushed (dirty, or written back since the last flush), every row of an in-memory table, and
    the rows of a short last chunk whose base file the grown layout drops. Caller holds the lock."""
    hot, n, cr = store._tiers.hot, store._core.num_rows, store._core.chunk_rows
    versions = store._versions
    slots = np.flatnonzero(hot.dirty)
    parts = [slots if hot.resident else hot.id_of[slots]]
    parts += [seg.ids for seg in versions.pending]
    if versions.disk is None:  # nothing below the pool: the rows made so far are all there is
        if hot.all_loaded or hot.loaded.all():
            return np.arange(n, dtype=np.int64)
        for c in np.flatnonzero(hot.loaded).tolist():
            parts.append(np.arange(c * cr, min(n, (c + 1) * cr), dtype=np.int64))
        if hot.row_ok is not None:
            parts.append(np.flatnonzero(hot.row_ok))
    elif n % cr and versions.cmap[n // cr]:
        parts.append(np.arange(n // cr * cr, n, dtype=np.int64))
    return idsets.unique(np.concatenate(parts).astype(np.int64)) if parts else np.zeros(0, np.int64)


def grow(store: Any, num_rows: int) -> None:
    """`EmbeddingStore.grow` (validated): reopen the store at ``num_rows`` rows in place."""
    versions, core = store._versions, store._core
    with versions.flush_lock:
        versions.await_round()
        with core.lock:
            core.check_open()
            ids = unflushed_ids(store)
            carried = store.read_records(torch.from_numpy(ids)) if len(ids) else None
            core.closed = True  # from here calls of other threads refuse (as during close())
    versions.wake()
    store._stop_background()
    old_rows = core.num_rows
    with versions.flush_lock, core.lock:
        settings = store._reopen_settings()
        store._close_files()
        kept = Kept.of(store)
        try:
            _reopen(store, kept, settings, num_rows, ids, carried)
        except BaseException as exc:
            # Reopen at the size it had and put its rows back: the failed growth leaves no trace.
            try:
                _reopen(store, kept, settings, old_rows, ids, carried)
            except BaseException:
                store._core.closed = True
                store._versions.release_lock()
                raise StoreError(
                    f"grow(num_rows={num_rows}) failed ({exc}) and the store could not be reopened as it was; "
                    "it is closed: reopen it with EmbeddingStore.open(path) (its last flush is intact)"
                ) from exc
            raise


def _reopen(store: Any, kept: Kept, settings: dict, num_rows: int, ids: np.ndarray, carried: Any) -> None:
    """The store reopened at ``num_rows`` with the carried rows written again (dirty); on failure
    what it opened is closed again, but for the writer lock (a failed constructor closes its own)."""
    store.__dict__.clear()  # nothing of the store before survives but what ``kept`` holds
    type(store).__init__(store, **settings, grown=Grown(num_rows, kept))
    try:
        if carried is not None:
            store.write_records(torch.from_numpy(ids), carried)
    except BaseException:
        store._core.closed = True  # its threads stop at their next look (the caller holds the locks they take)
        store._versions.wake()
        store._tiers.prefetch.stop(wait=False)
        store._versions.bg.stop(wait=False)
        store._tiers.fill.stop(wait=False)
        store._close_files()
        raise
