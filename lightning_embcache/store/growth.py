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

from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError, InvalidTypeError, StoreError
from .validate import MAX_ROWS

# Attributes a grown store keeps from before: its locks (other threads may wait on them), the
# writer lock's descriptor (never let go of) and its counters.
KEPT = ("_lock", "_flush_lock", "_no_flush_waiting", "_flush_waiting", "_lock_fd", "_stats", "_io_wait",
        "_io_wait_by_thread", "_row_thread", "_fold_proc_failed", "_fold_proc_restarts", "_version")


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
    if n > now and store._init_kind == "normal" and store._meta.get("init_version", 1) < 2:
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
    hot, n, cr = store._hot, store._num_rows, store._chunk_rows
    slots = np.flatnonzero(hot.dirty)
    parts = [slots if hot.resident else hot.id_of[slots]]
    parts += [seg.ids for seg in store._pending]
    if store._disk is None:  # nothing below the pool: the rows made so far are all there is
        if hot.all_loaded or hot.loaded.all():
            return np.arange(n, dtype=np.int64)
        for c in np.flatnonzero(hot.loaded).tolist():
            parts.append(np.arange(c * cr, min(n, (c + 1) * cr), dtype=np.int64))
        if hot.row_ok is not None:
            parts.append(np.flatnonzero(hot.row_ok))
    elif n % cr and store._cmap[n // cr]:
        parts.append(np.arange(n // cr * cr, n, dtype=np.int64))
    return np.unique(np.concatenate(parts).astype(np.int64)) if parts else np.zeros(0, np.int64)


def resize_layout(store: Any, num_rows: int) -> None:
    """The layout of the store's version at ``num_rows`` rows (called by the constructor of a
    grown store, before its tiers are made): chunk map padded with never-written chunks, a short
    last chunk's base file dropped, all published by the next flush."""
    old, cr, disk = store._num_rows, store._chunk_rows, store._disk
    chunks = (num_rows + cr - 1) // cr
    cmap = np.zeros(chunks, np.int32)
    cmap[: len(store._cmap)] = store._cmap
    folded = np.zeros(chunks, np.int64)
    folded[: len(store._folded)] = store._folded
    if old % cr:
        # its base file holds the old rows only; `unflushed_ids` carried them, the rest is init.
        # The records it folded stay dead (the folded mark stays): the carried rows are newer.
        cmap[old // cr] = 0
    store._num_rows = num_rows
    disk.resize(num_rows)
    if store._cmap_gen:  # a chunk map file has its table's size: the grown layout gets its own
        gen = store._next_gen
        store._next_gen += 1
        disk.write_chunkmap(gen, cmap, folded)
        store._cmap_gen = gen
    store._cmap, store._folded = cmap, folded
    store._index_rebuild()
    store._grown_unflushed = True
    store._refresh_sharing()


def grow(store: Any, num_rows: int) -> None:
    """`EmbeddingStore.grow` (validated): reopen the store at ``num_rows`` rows in place."""
    with store._flush_lock:
        store._await_round()
        with store._lock:
            store._check_open()
            ids = unflushed_ids(store)
            carried = store.read_records(torch.from_numpy(ids)) if len(ids) else None
            store._closed = True  # from here calls of other threads refuse (as during close())
    store._stop_background()
    old_rows = store._num_rows
    with store._flush_lock, store._lock:
        settings = store._reopen_settings()
        store._close_files()
        kept = {k: store.__dict__[k] for k in KEPT if k in store.__dict__}
        try:
            _reopen(store, kept, settings, num_rows, ids, carried)
        except BaseException as exc:
            # Reopen at the size it had and put its rows back: the failed growth leaves no trace.
            try:
                _reopen(store, kept, settings, old_rows, ids, carried)
            except BaseException:
                store._closed = True
                store._release_lock()
                raise StoreError(
                    f"grow(num_rows={num_rows}) failed ({exc}) and the store could not be reopened as it was; "
                    "it is closed: reopen it with EmbeddingStore.open(path) (its last flush is intact)"
                ) from exc
            raise


def _reopen(store: Any, kept: dict, settings: dict, num_rows: int, ids: np.ndarray, carried: Any) -> None:
    """The store reopened at ``num_rows`` with the carried rows written again (dirty); on failure
    what it opened is closed again, but for the writer lock (a failed constructor closes its own)."""
    for k in [k for k in store.__dict__ if k not in kept]:
        delattr(store, k)
    type(store).__init__(store, **settings, grown={"num_rows": num_rows, "kept": kept})
    try:
        if carried is not None:
            store.write_records(torch.from_numpy(ids), carried)
    except BaseException:
        store._closed = True  # its threads stop at their next look (the caller holds the locks they take)
        for ex in (store._prefetcher, store._bg, store._filler):
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)
        store._close_files()
        raise
