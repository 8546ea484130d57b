"""EmbeddingStore: a row per id, tiered (hot RAM -> LZ4 warm -> disk), durable by flush.

Reads and writes go to the hot tier; misses are filled from the warm tier or from disk (base
chunk + delta segments). ``flush()`` writes only the dirty rows as one delta segment plus a small
manifest, so its cost follows the dirty bytes; background compaction folds segments into base
chunks. The store never imports Lightning.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch

from .disk import Disk, Manifest, Segment
from .errors import (
    CorruptStoreError,
    ForkedWriterError,
    InvalidArgumentError,
    InvalidTypeError,
    ReadOnlyError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
)
from .hot import SLOT_OVERHEAD, HotTier
from .schema import DTYPES, Schema
from .stats import StoreStats
from .validate import as_ids, as_values, budget, positive_int
from .warm import WarmTier

InitFn = Callable[[torch.Tensor], torch.Tensor]
Init = Union[str, InitFn]
PathLike = Union[str, os.PathLike, None]

# Compaction folds delta segments into base chunks once they hold this share of the table's
# bytes, or once there are this many: disk stays near 2x the table, reads touch few segments.
COMPACT_RATIO = 0.25
COMPACT_SEGMENTS = 32
KEEP_VERSIONS = 2  # unpinned versions kept besides pins (the latest and its predecessor)

_LIVE: "weakref.WeakSet[EmbeddingStore]" = weakref.WeakSet()


class _TooLarge(Exception):
    """Internal: a read needs more distinct rows than the hot tier holds."""

    def __init__(self, slots: np.ndarray, mids: np.ndarray, records: np.ndarray) -> None:
        self.slots, self.mids, self.records = slots, mids, records


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    # bfloat16 has no numpy dtype: move its bits as int16
    return np.dtype(np.int16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def _to_np(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


class EmbeddingStore:
    """Rows keyed by int id with byte-budgeted tiers and crash-safe, versioned flushes.

    Example::

        with EmbeddingStore.create("runs/latents", num_rows=10_000_000, dim=64,
                                   hot_bytes=256 << 20, warm_bytes=128 << 20) as store:
            z = store.get(ids)              # (len(ids), 64) float32
            store.update(ids, z - 0.1 * g)  # last write of a duplicate id wins
            version = store.flush()         # durable when it returns

    Notes:
        ``hot_bytes=None`` keeps the whole table resident (memory mode); a budget turns on disk
        mode, where RAM use stays within ``hot_bytes + warm_bytes`` plus 4 bytes per table row
        for the id map (allocated only where touched). One writer per path; a writable store
        cannot be used in a forked child (open a ``readonly=True`` handle there).

    Raises:
        StoreError: and its subclasses, each naming the argument, its value and what is allowed.
    """

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        path: PathLike,
        num_rows: int,
        dim: int,
        dtype: torch.dtype = torch.float32,
        chunk_rows: int = 1024,
        hot_bytes: int | None = None,
        warm_bytes: int = 0,
        compression: str | None = None,
        init: Init = "zeros",
        *,
        seed: int = 0,
        init_std: float = 1.0,
        check_finite: bool = True,
        fields: Mapping[str, tuple] | None = None,
    ) -> "EmbeddingStore":
        """Create a new store (``path=None``: ephemeral, deleted on close)."""
        num_rows = positive_int(num_rows, "num_rows")
        dim = positive_int(dim, "dim")
        chunk_rows = positive_int(chunk_rows, "chunk_rows")
        hot_bytes = budget(hot_bytes, "hot_bytes", allow_none=True)
        warm_bytes = budget(warm_bytes, "warm_bytes", allow_none=False)
        if not isinstance(dtype, torch.dtype):
            raise InvalidTypeError(f"dtype must be a torch.dtype; got {dtype!r}")
        schema = Schema(dim, dtype, dict(fields or {}))
        if compression not in (None, "lz4"):
            raise InvalidArgumentError(f"compression must be None or 'lz4'; got {compression!r}")
        if isinstance(init, str):
            if init not in ("zeros", "normal"):
                raise InvalidArgumentError(f"init must be 'zeros', 'normal' or a callable f(ids) -> rows; got {init!r}")
        elif not callable(init):
            raise InvalidTypeError(f"init must be 'zeros', 'normal' or a callable; got {type(init).__name__}")
        meta = {
            "format": "lightning_embcache",
            "uuid": uuid.uuid4().hex,
            "num_rows": num_rows,
            "chunk_rows": chunk_rows,
            "schema": schema.to_json(),
            "compression": compression,
            "init": init if isinstance(init, str) else "callable",
            "seed": int(seed),
            "init_std": float(init_std),
        }
        ephemeral = path is None
        if ephemeral and hot_bytes is None:
            root = None
        else:
            root = Path(tempfile.mkdtemp(prefix="embcache-")) if ephemeral else Path(path)
            if root.exists() and any(root.iterdir()):
                if (root / "META").exists():
                    raise InvalidArgumentError(f"path={str(root)!r} already holds a store; use EmbeddingStore.open()")
                raise InvalidArgumentError(f"path={str(root)!r} exists and is not empty; give a new or empty folder")
            root.mkdir(parents=True, exist_ok=True)
        store = cls(root, meta, None, readonly=False, hot_bytes=hot_bytes, warm_bytes=warm_bytes,
                    check_finite=check_finite, init_fn=None if isinstance(init, str) else init,
                    ephemeral=ephemeral, create=True)
        return store

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        version: int | None = None,
        readonly: bool = False,
        hot_bytes: int | None = None,
        warm_bytes: int = 0,
        *,
        check_finite: bool = True,
        init: InitFn | None = None,
    ) -> "EmbeddingStore":
        """Open an existing store at its latest version, or at a retained ``version``."""
        root = Path(path)
        hot_bytes = budget(hot_bytes, "hot_bytes", allow_none=True)
        warm_bytes = budget(warm_bytes, "warm_bytes", allow_none=False)
        if not root.is_dir():
            raise InvalidArgumentError(f"path={str(root)!r} is not a store directory (it does not exist)")
        if not (root / "META").exists():
            raise CorruptStoreError(root, "not a lightning_embcache store (no META file)")
        meta = Disk.read_meta(root)
        if meta.get("format") != "lightning_embcache":
            raise CorruptStoreError(root / "META", "not a lightning_embcache store")
        if meta["init"] == "callable" and init is None:
            raise InvalidArgumentError(
                f"the store at {str(root)!r} was created with a callable init; pass the same function as init="
            )
        return cls(root, meta, version, readonly=readonly, hot_bytes=hot_bytes, warm_bytes=warm_bytes,
                   check_finite=check_finite, init_fn=init, ephemeral=False, create=False)

    def __init__(self, root: Path | None, meta: dict, version: int | None, *, readonly: bool,
                 hot_bytes: int | None, warm_bytes: int, check_finite: bool, init_fn: InitFn | None,
                 ephemeral: bool, create: bool) -> None:
        self._closed = True  # until fully constructed
        self._root = root
        self._ephemeral = ephemeral
        self._meta = meta
        self._schema = Schema.from_json(meta["schema"])
        self._num_rows = int(meta["num_rows"])
        self._chunk_rows = int(meta["chunk_rows"])
        self._row_bytes = self._schema.row_bytes
        self._compress = meta["compression"] == "lz4"
        self._init_kind = meta["init"]
        self._init_fn = init_fn
        self._seed = int(meta["seed"])
        self._init_std = float(meta["init_std"])
        self._readonly = bool(readonly)
        self._check_finite = bool(check_finite)
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._flush_lock = threading.Lock()
        self._lock_fd: int | None = None
        self._stats = StoreStats()
        self._io_wait = 0.0
        self._epoch = 0  # bumped whenever the below-hot view of some rows changes
        self._committed: list[Segment] = []
        self._pending: list[Segment] = []
        self._pins: set[int] = set()
        self._disk: Disk | None = None
        self._version = 0
        self._max_version = 0
        self._parent = 0
        self._cmap_gen = 0
        self._next_seq = 1
        self._next_gen = 1
        self._bg: ThreadPoolExecutor | None = None
        self._prefetcher: ThreadPoolExecutor | None = None
        self._bg_futures: dict[str, Future] = {}
        self._bg_error: BaseException | None = None
        self._dirty_estimate = 0  # rows written since the last background clean (an upper bound)
        self._writing_seqs: set[int] = set()  # segments being written: garbage collection skips them
        self._writing_gens: set[int] = set()  # compaction generations being written
        num_chunks = (self._num_rows + self._chunk_rows - 1) // self._chunk_rows
        if root is not None:
            if not readonly:
                self._take_lock(root)
            try:
                self._disk = Disk(root, self._num_rows, self._chunk_rows, self._row_bytes)
                if create:
                    Disk.write_meta(root, meta)
                    self._disk.write_manifest(Manifest(0, 0, []))
                self._load_version(version)
            except BaseException:
                self._release_lock()
                raise
        else:
            self._cmap = np.zeros(num_chunks, np.int32)
        capacity = None if hot_bytes is None else max(1, hot_bytes // (self._row_bytes + SLOT_OVERHEAD))
        if capacity is not None and capacity >= self._num_rows:
            capacity = self._num_rows
        self._hot_budget = hot_bytes
        self._hot = HotTier(self._num_rows, self._row_bytes, self._chunk_rows, capacity)
        self._warm = WarmTier(warm_bytes if root is not None else 0)
        if root is None and self._init_kind == "zeros" and not any(f.fill for f in self._schema.fields.values()):
            self._hot.loaded[:] = True  # the zero-filled pool already holds every row's initial value
            self._hot.all_loaded = True
        self._np_views = {n: self._field_np(n) for n in self._schema.names}
        self._closed = False
        _LIVE.add(self)

    # ------------------------------------------------------------------ properties
    path = property(lambda self: None if self._ephemeral else self._root, doc="Store directory (None if ephemeral).")
    num_rows = property(lambda self: self._num_rows)
    dim = property(lambda self: self._schema.dim)
    dtype = property(lambda self: self._schema.dtype)
    chunk_rows = property(lambda self: self._chunk_rows)
    readonly = property(lambda self: self._readonly)
    closed = property(lambda self: self._closed)
    hot_bytes = property(lambda self: self._hot_budget, doc="Hot budget in bytes; None = whole table resident.")
    warm_bytes = property(lambda self: self._warm.budget)
    version = property(lambda self: self._version, doc="Version of the last completed flush (0 = as created).")
    field_names = property(lambda self: self._schema.names)

    def field_spec(self, name: str) -> tuple[torch.dtype, int]:
        f = self._schema.fields[name]
        return f.dtype, f.cols

    # ------------------------------------------------------------------ public row API
    def get(self, ids: Any) -> torch.Tensor:
        """Rows of ``ids`` as a new (len(ids), dim) CPU tensor in the storage dtype."""
        return self.get_fields(ids, ("weight",))["weight"]

    def update(self, ids: Any, values: Any) -> None:
        """Write rows; of duplicate ids in one call the last one wins. Not durable until flush()."""
        self.update_fields(ids, {"weight": values})

    def get_fields(self, ids: Any, names: Sequence[str] = ("weight",)) -> dict[str, torch.Tensor]:
        """Several per-row fields of ``ids`` at once (e.g. weights and optimizer moments)."""
        t0 = time.perf_counter()
        self._check_usable()
        names = self._check_names(names)
        idx = as_ids(ids, self._num_rows)
        with self._lock:
            try:
                out = self._gather(self._resolve(idx, load=True), names)
            except _TooLarge as big:
                out = self._gather_direct(idx, big.slots, big.mids, big.records, names)
        self._stats.gets += 1
        self._io_wait += time.perf_counter() - t0
        return out

    def update_fields(self, ids: Any, values: Mapping[str, Any]) -> None:
        """Write several fields of ``ids``; fields not named keep their values."""
        t0 = time.perf_counter()
        self._check_usable(write=True)
        if not isinstance(values, Mapping) or not values:
            raise InvalidTypeError("values must be a non-empty mapping of field name -> tensor")
        names = self._check_names(tuple(values))
        idx = as_ids(ids, self._num_rows)
        vals = {}
        for n in names:
            dtype, cols = self.field_spec(n)
            arg = "values" if n == "weight" and len(names) == 1 else f"values[{n!r}]"
            vals[n] = as_values(values[n], len(idx), cols, dtype, arg=arg, check_finite=self._check_finite)
        if len(idx):
            full = set(names) == set(self._schema.names)
            with self._lock:
                slots = self._resolve(idx, load=not full, for_write=True, values=vals)
                if slots is not None:
                    self._scatter(slots, vals)
                if not self._hot.resident:
                    # Keep evictions cheap for the training thread: once about half the hot slots
                    # may be dirty, write the cold ones back in the background.
                    self._dirty_estimate += len(idx)
                    if self._dirty_estimate > self._hot.limit // 2:
                        self._dirty_estimate = 0
                        self._submit_bg(self._clean)
        self._stats.updates += 1
        self._io_wait += time.perf_counter() - t0

    def prefetch(self, ids: Any) -> None:
        """Hint: bring these rows into the hot tier in the background; returns at once."""
        self._check_usable()
        idx = as_ids(ids, self._num_rows).copy()
        if self._disk is None:
            return
        with self._lock:
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="embcache-prefetch")
            self._prefetcher.submit(self._prefetch, idx)

    # ------------------------------------------------------------------ residency
    def _field_np(self, name: str) -> np.ndarray:
        f = self._schema.fields[name]
        pool = self._hot.pool_np
        if len(self._schema.fields) == 1:
            return pool.view(_np_dtype(f.dtype))
        return pool[:, f.offset : f.offset + f.nbytes].view(_np_dtype(f.dtype))

    def _gather(self, slots: np.ndarray, names: Sequence[str]) -> dict[str, torch.Tensor]:
        s = torch.from_numpy(slots)
        return {n: torch.index_select(self._schema.view(self._hot.pool, n), 0, s) for n in names}

    def _gather_direct(self, idx, slots, mids, records, names) -> dict[str, torch.Tensor]:
        """Serve a read with more distinct missing rows than hot slots without caching it all."""
        rec = np.empty((len(idx), self._row_bytes), np.uint8)
        hit = slots >= 0
        rec[hit] = self._hot.pool_np[slots[hit]]
        miss = ~hit
        rec[miss] = records[np.searchsorted(mids, idx[miss])]
        t = torch.from_numpy(rec)
        return {n: self._schema.view(t, n).clone() for n in names}

    def _scatter(self, slots: np.ndarray, vals: dict[str, torch.Tensor]) -> None:
        """Write rows into hot slots and mark them dirty; of duplicate slots the last write wins.

        index_copy_ is the fastest scatter but leaves duplicates undefined, so the dirty array
        doubles as a stamp: each slot records the last batch position written to it, and only
        those positions are copied (a second pass only when the batch has duplicates).
        """
        dirty = self._hot.dirty
        pos = np.arange(1, len(slots) + 1, dtype=np.int32)
        dirty[slots] = pos
        last = dirty[slots] == pos
        if not last.all():
            keep = torch.from_numpy(np.flatnonzero(last))
            slots = slots[last]
            vals = {n: v.index_select(0, keep) for n, v in vals.items()}
        s = torch.from_numpy(slots)
        for n, v in vals.items():
            self._schema.view(self._hot.pool, n).index_copy_(0, s, v)

    def _resolve(self, idx: np.ndarray, *, load: bool, for_write: bool = False,
                 values: dict[str, torch.Tensor] | None = None) -> np.ndarray | None:
        """Slots holding ``idx``, filling misses from below. Caller holds the lock.

        For a write covering every field (``load=False``) missing rows are not read from below.
        Returns None when a write was too large for the hot tier and went straight to disk.
        """
        hot = self._hot
        slots = hot.lookup(idx)
        if hot.resident:
            if slots is idx:
                return slots
            miss = idx[slots < 0]
            for c in np.unique(miss // self._chunk_rows).tolist():
                self._load_chunk_resident(c)
            hot.all_loaded = bool(hot.loaded.all())
            self._stats.hot_misses += len(miss)
            self._stats.hot_hits += len(idx) - len(miss)
            return idx
        missing = slots < 0
        n_miss = int(missing.sum())
        self._stats.hot_hits += len(idx) - n_miss
        if not n_miss:
            return slots
        self._stats.hot_misses += n_miss
        mids = np.unique(idx[missing])
        if len(mids) > hot.limit or (for_write and len(mids) > hot.limit // 2):
            if for_write:
                self._write_around(idx, mids, values or {}, load)
                return None
        if len(mids) > hot.limit and not for_write:
            raise _TooLarge(slots, mids, self._fetch(mids))
        records = self._fetch(mids) if load else np.zeros((len(mids), self._row_bytes), np.uint8)
        got = self._allocate(len(mids), protect=slots[~missing])
        if len(got) < len(mids):
            # No room even after eviction (everything in flight or in use by this call).
            hot.free.extend(got.tolist())
            if for_write:
                self._write_around(idx, mids, values or {}, load)
                return None
            raise _TooLarge(slots, mids, records)
        hot.install(mids, got, records)
        slots = hot.slot_of[idx].astype(np.int64) - 1
        return slots

    def _allocate(self, n: int, protect: np.ndarray | None = None) -> np.ndarray:
        """n free slots, evicting (and writing back) cold rows by CLOCK as needed."""
        hot = self._hot
        got = hot.take_free(n)
        if len(got) < n:
            victims = hot.victims(n - len(got), protect)
            if len(victims):
                self._evict_slots(victims)
                more = hot.take_free(n - len(got))
                got = np.concatenate([got, more])
        return got

    def _evict_slots(self, slots: np.ndarray) -> None:
        hot = self._hot
        d = slots[hot.dirty[slots] != 0]
        if len(d):
            self._write_back(hot.id_of[d], hot.pool_np[d])
        self._stats.evicted_bytes += len(slots) * self._row_bytes
        hot.drop(slots)

    def _write_back(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Write evicted dirty rows to a pending segment (part of the next flush's version)."""
        assert self._disk is not None
        order = np.argsort(ids, kind="stable")
        seq = self._next_seq
        self._next_seq += 1
        seg = self._disk.write_segment(seq, ids[order], np.ascontiguousarray(records[order]), durable=False)
        self._pending.append(seg)
        self._pending.sort(key=lambda g: g.seq)
        self._warm.discard_many(ids // self._chunk_rows)
        self._epoch += 1

    def _clean(self) -> None:
        """Background write-back: turn dirty hot rows that are not recently used into clean ones.

        The rows stay resident; their values go to a pending segment (part of the next flush), so
        a later eviction of them is free. Holds the flush lock so no flush can publish a version
        while cleaned rows are neither dirty nor in a published segment.
        """
        with self._flush_lock:
            with self._lock:
                hot = self._hot
                if self._closed or hot.resident or self._disk is None:
                    return
                slots = np.flatnonzero(hot.dirty[: hot.limit])
                cold = slots[hot.ref[slots] == 0]
                take = cold if len(cold) >= len(slots) // 2 else slots
                if len(take) < max(1, hot.limit // 8):
                    return
                ids = hot.id_of[take]
                order = np.argsort(ids, kind="stable")
                ids, take = ids[order], take[order]
                records = hot.pool_np[take]
                hot.dirty[take] = 0
                hot.inflight[take] = True
                seq = self._next_seq
                self._next_seq += 1
                self._writing_seqs.add(seq)
            try:
                seg = self._disk.write_segment(seq, ids, records, durable=False)
            except BaseException:
                with self._lock:
                    hot.dirty[take] = 1
                    hot.inflight[take] = False
                    self._writing_seqs.discard(seq)
                raise
            with self._lock:
                hot.inflight[take] = False
                self._writing_seqs.discard(seq)
                self._pending.append(seg)
                self._pending.sort(key=lambda g: g.seq)
                self._warm.discard_many(ids // self._chunk_rows)
                self._epoch += 1
                self._stats.cleaned_rows += len(ids)

    def _write_around(self, idx, mids, values, load: bool) -> None:
        """A write too large for the hot tier: merge it with stored rows and write back directly."""
        # Rows already resident take the write in place; the rest go to a pending segment.
        hot = self._hot
        slots = hot.lookup(idx)
        res = slots >= 0
        if res.any():
            for n, v in values.items():
                self._np_views[n][slots[res]] = _to_np(v[torch.from_numpy(np.flatnonzero(res))])
            hot.dirty[slots[res]] = 1
        rest = np.flatnonzero(~res)
        rid = idx[rest]
        # last occurrence of each id wins
        rev = rid[::-1]
        uniq, first_in_rev = np.unique(rev, return_index=True)
        pos = rest[::-1][first_in_rev]
        records = self._fetch(uniq) if load else np.zeros((len(uniq), self._row_bytes), np.uint8)
        rec_t = torch.from_numpy(records)
        p = torch.from_numpy(pos)
        for n, v in values.items():
            self._schema.view(rec_t, n)[:] = v[p]
        self._write_back(uniq, records)

    def _load_chunk_resident(self, chunk: int) -> None:
        lo, hi = self._hot.chunk_range(chunk)
        self._hot.pool_np[lo:hi] = self._below(chunk)
        self._hot.loaded[chunk] = True

    def _fetch(self, ids: np.ndarray) -> np.ndarray:
        """Records of sorted unique ``ids`` from the warm tier or disk."""
        out = np.empty((len(ids), self._row_bytes), np.uint8)
        chunks = ids // self._chunk_rows
        bounds = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1], True])
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            c = int(chunks[a])
            recs = self._below(c)
            out[a:b] = recs[ids[a:b] - c * self._chunk_rows]
        return out

    def _below(self, chunk: int) -> np.ndarray:
        """A chunk's records as stored below the hot tier: warm copy, else base + deltas."""
        rows = min(self._chunk_rows, self._num_rows - chunk * self._chunk_rows)
        cached = self._warm.get(chunk)
        if cached is not None:
            return cached.reshape(rows, self._row_bytes)
        if self._disk is not None and self._cmap[chunk]:
            recs = self._disk.read_chunk(chunk, int(self._cmap[chunk]))
        else:
            recs = self._init_records(chunk, rows)
        lo = chunk * self._chunk_rows
        for seg in self._committed + self._pending:
            got = seg.rows_of_chunk(chunk)
            if got is not None:
                recs[got[0] - lo] = got[1]
        self._stats.cold_reads += 1
        if self._warm.budget:
            self._warm.put(chunk, recs)
        return recs

    def _init_records(self, chunk: int, rows: int) -> np.ndarray:
        recs = np.zeros((rows, self._row_bytes), np.uint8)
        t = torch.from_numpy(recs)
        lo = chunk * self._chunk_rows
        w = self._schema.view(t, "weight")
        if self._init_kind == "normal":
            g = torch.Generator().manual_seed(self._seed * 1_000_003 + chunk)
            w[:] = (torch.randn(rows, self.dim, generator=g, dtype=torch.float32) * self._init_std).to(self.dtype)
        elif self._init_kind == "callable":
            assert self._init_fn is not None
            ids = torch.arange(lo, lo + rows)
            vals = self._init_fn(ids)
            if not isinstance(vals, torch.Tensor) or tuple(vals.shape) != (rows, self.dim):
                raise InvalidArgumentError(
                    f"init(ids) must return a tensor of shape ({rows}, {self.dim}); got "
                    f"{tuple(vals.shape) if isinstance(vals, torch.Tensor) else type(vals).__name__}"
                )
            w[:] = vals.detach().cpu().to(self.dtype)
        for f in self._schema.fields.values():
            if f.name != "weight" and f.fill:
                self._schema.view(t, f.name)[:] = f.fill
        return recs

    def _prefetch(self, idx: np.ndarray) -> None:
        try:
            with self._lock:
                if self._closed:
                    return
                slots = self._hot.lookup(idx)
                miss = np.unique(idx[slots < 0])
                if not len(miss):
                    return
                if not self._hot.resident and len(miss) > self._hot.limit // 2:
                    miss = miss[: self._hot.limit // 2]
                self._resolve(miss, load=True)
                self._stats.prefetched_rows += len(miss)
        except StoreError:
            pass  # a hint: the foreground read will report the problem

    # ------------------------------------------------------------------ flush and versions
    def flush(self) -> int:
        """Make every update so far durable as a new version and return it.

        Thread-safe: may run in a background thread while another thread calls get/update;
        rows updated during the flush go into the next version.
        """
        t0 = time.perf_counter()
        self._check_usable(write=True)
        self._raise_bg_error()
        if self._disk is None:  # ephemeral memory store: nothing to make durable
            with self._lock:
                if self._hot.dirty.any():
                    self._hot.dirty[:] = 0
                    self._version += 1
                return self._version
        with self._flush_lock:
            with self._lock:
                hot = self._hot
                slots = np.flatnonzero(hot.dirty)
                if not len(slots) and not self._pending:
                    return self._version
                ids = slots if hot.resident else hot.id_of[slots]
                order = np.argsort(ids, kind="stable")
                ids, slots = ids[order], slots[order]
                records = hot.pool_np[slots]
                hot.dirty[slots] = 0
                hot.inflight[slots] = True
                seq = self._next_seq
                self._next_seq += 1
                self._writing_seqs.add(seq)
                pending = list(self._pending)
                version = self._max_version + 1
                segs = [s.seq for s in self._committed] + [p.seq for p in pending]
            try:
                for p in pending:
                    self._disk.sync_segment(p)
                new = [self._disk.write_segment(seq, ids, records)] if len(ids) else []
                m = Manifest(version, self._cmap_gen, segs + [s.seq for s in new], parent=self._version)
                self._parent = self._version
                self._disk.write_manifest(m)
            except BaseException:
                with self._lock:
                    hot.dirty[slots] = 1
                    hot.inflight[slots] = False
                    self._writing_seqs.discard(seq)
                raise
            with self._lock:
                hot.inflight[slots] = False
                self._writing_seqs.discard(seq)
                self._committed += pending + new
                self._pending = [p for p in self._pending if p not in pending]
                self._version = self._max_version = version
                self._warm.discard_many(ids // self._chunk_rows)
                self._epoch += 1
                self._stats.flushes += 1
                self._stats.flushed_rows += len(ids)
            self._apply_retention()
        self._maybe_compact()
        self._io_wait += time.perf_counter() - t0
        return version

    def versions(self) -> list[int]:
        """Versions still on disk (openable with ``open(path, version=v)``)."""
        if self._disk is None:
            return [self._version]
        return self._disk.list_versions()

    def pin(self, version: int) -> None:
        """Never reclaim ``version`` (until unpinned); persisted across opens."""
        self._check_usable(write=True)
        disk = self._require_disk("pin")
        disk.read_manifest(int(version))  # raises VersionNotFoundError
        with self._flush_lock:
            self._pins.add(int(version))
            disk.write_pins(self._pins)

    def unpin(self, version: int) -> None:
        self._check_usable(write=True)
        disk = self._require_disk("unpin")
        with self._flush_lock:
            self._pins.discard(int(version))
            disk.write_pins(self._pins)
            self._apply_retention()

    def pinned(self) -> list[int]:
        return sorted(self._pins)

    def manifest_checksum(self, version: int) -> str:
        """Hex checksum of a version's manifest (checkpoints record it to detect a foreign store)."""
        return self._require_disk("manifest_checksum").manifest_checksum(int(version))

    def _require_disk(self, what: str) -> Disk:
        if self._disk is None:
            raise StoreError(f"{what}() needs a store on disk; this one was created with path=None")
        return self._disk

    def _apply_retention(self) -> None:
        """Delete manifests of unpinned versions beyond the newest KEEP_VERSIONS. Holds flush lock."""
        assert self._disk is not None
        if self._readonly:
            return
        versions = self._disk.list_versions()
        keep = set(versions[-KEEP_VERSIONS:]) | self._pins | {self._version}
        dropped = False
        for v in versions:
            if v not in keep:
                try:
                    self._disk.manifest_path(v).unlink()
                    dropped = True
                except FileNotFoundError:
                    pass
        if dropped:
            self._submit_bg(self._collect_garbage)

    def _load_version(self, version: int | None) -> None:
        disk = self._disk
        assert disk is not None
        versions = disk.list_versions()
        if not versions:
            raise CorruptStoreError(self._root, "holds no manifest (an interrupted create?)")
        v = versions[-1] if version is None else int(version)
        m = disk.read_manifest(v)
        self._cmap = disk.read_chunkmap(m.chunkmap)
        self._cmap_gen = m.chunkmap
        self._committed = [disk.open_segment(s) for s in m.segments]
        self._version = v
        self._max_version = versions[-1]
        self._pins = disk.read_pins()
        seq, gen = disk.max_seq_and_gen()
        self._next_seq = seq + 1
        self._next_gen = gen + 1
        if not self._readonly:
            # Leftovers of a crash (unreferenced segments, temp files) are removed by the writer.
            self._collect_garbage(at_open=True)

    # ------------------------------------------------------------------ compaction and GC
    def _segment_bytes(self) -> int:
        return sum(s.nbytes for s in self._committed)

    def _maybe_compact(self) -> None:
        table = self._num_rows * self._row_bytes
        if len(self._committed) > COMPACT_SEGMENTS or self._segment_bytes() > COMPACT_RATIO * table:
            self._submit_bg(self._compact)

    def _submit_bg(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the background I/O thread; a job of the same kind already queued absorbs it."""
        with self._lock:
            if self._closed:
                return
            if self._bg is None:
                self._bg = ThreadPoolExecutor(1, thread_name_prefix="embcache-bg")
            key = fn.__name__
            fut = self._bg_futures.get(key)
            if fut is not None and not fut.done():
                return
            self._bg_futures[key] = self._bg.submit(self._run_bg, fn)

    def _run_bg(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # surfaced on the next flush()
            self._bg_error = exc

    def _raise_bg_error(self) -> None:
        exc, self._bg_error = self._bg_error, None
        if exc is not None:
            raise StoreError(f"background compaction failed: {exc}") from exc

    def compact(self) -> None:
        """Fold all committed delta segments into base chunks now (normally automatic)."""
        self._check_usable(write=True)
        self._require_disk("compact")
        self._wait_bg()
        self._compact()

    def _compact(self) -> None:
        disk = self._disk
        assert disk is not None
        with self._lock:
            segs = list(self._committed)
            cmap = self._cmap.copy()
            gen = self._next_gen
            self._next_gen += 1
            self._writing_gens.add(gen)
        try:
            self._compact_into(segs, cmap, gen)
        finally:
            with self._lock:
                self._writing_gens.discard(gen)

    def _compact_into(self, segs: list[Segment], cmap: np.ndarray, gen: int) -> None:
        disk = self._disk
        assert disk is not None
        if not segs:
            return
        touched = np.unique(np.concatenate([s.idx_chunk for s in segs]))
        new_cmap = cmap.copy()
        for c in touched.tolist():
            rows = min(self._chunk_rows, self._num_rows - c * self._chunk_rows)
            recs = disk.read_chunk(c, int(cmap[c])) if cmap[c] else self._init_records(c, rows)
            lo = c * self._chunk_rows
            for s in segs:
                got = s.rows_of_chunk(c)
                if got is not None:
                    recs[got[0] - lo] = got[1]
            disk.write_chunk(c, gen, recs, self._compress)
            new_cmap[c] = gen
        disk.write_chunkmap(gen, new_cmap)
        folded = {s.seq for s in segs}
        with self._flush_lock:
            with self._lock:
                if self._closed:
                    return
                remaining = [s for s in self._committed if s.seq not in folded]
                m = Manifest(self._version, gen, [s.seq for s in remaining], parent=self._parent)
                disk.write_manifest(m)
                self._cmap, self._cmap_gen, self._committed = new_cmap, gen, remaining
                self._stats.compactions += 1
            self._collect_garbage()
        for s in segs:
            s.close()

    def _collect_garbage(self, at_open: bool = False) -> None:
        disk = self._disk
        if disk is None or self._readonly:
            return
        with self._lock:
            live_segs = {s.seq for s in self._committed + self._pending} | self._writing_seqs
            gens = {self._cmap_gen} | self._writing_gens
            # Anything numbered from here on is written after this snapshot: never garbage.
            new_seq, new_gen = self._next_seq, self._next_gen
        disk.collect_garbage(disk.list_versions(), live_segs, gens, new_seq, new_gen, remove_temp=at_open)

    def _wait_bg(self) -> None:
        for fut in list(self._bg_futures.values()):
            fut.result()

    # ------------------------------------------------------------------ memory
    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` of hot and warm memory (dirty rows written back first)."""
        self._check_usable()
        nbytes = budget(nbytes, "nbytes", allow_none=False)
        freed = 0
        with self._lock:
            freed += self._warm.shrink(max(0, self._warm.nbytes - nbytes))
            if freed >= nbytes or self._disk is None:
                return freed
            hot = self._hot
            if hot.resident:
                for c in np.flatnonzero(hot.loaded).tolist():
                    if freed >= nbytes:
                        break
                    lo, hi = hot.chunk_range(c)
                    if hot.inflight[lo:hi].any():
                        continue
                    d = np.flatnonzero(hot.dirty[lo:hi]) + lo
                    if len(d):
                        self._write_back(d, hot.pool_np[d])
                    hot.unload_chunk(c)
                    freed += (hi - lo) * self._row_bytes
            else:
                per = self._row_bytes + SLOT_OVERHEAD
                want = min(hot.used, -(-(nbytes - freed) // per))
                victims = hot.victims(want)
                if len(victims) < want:  # everything was recently used: take any idle slot
                    occ = np.flatnonzero((hot.id_of[: hot.limit] >= 0) & ~hot.inflight[: hot.limit])
                    victims = np.unique(np.concatenate([victims, occ[: want]]))[:want]
                self._evict_slots(victims)
                freed += len(victims) * per
        return freed

    def set_budget(self, hot_bytes: int | None = None, warm_bytes: int | None = None) -> None:
        """Change the budgets at run time (a lower budget evicts at once). None keeps a budget."""
        self._check_usable()
        with self._lock:
            if warm_bytes is not None:
                self._warm.budget = budget(warm_bytes, "warm_bytes", allow_none=False)
                self._warm.shrink(self._warm.budget)
            if hot_bytes is None:
                return
            hot_bytes = budget(hot_bytes, "hot_bytes", allow_none=False)
            hot = self._hot
            if hot.resident:
                over = hot.nbytes() - hot_bytes
                if over > 0:
                    self.evict(over)
                return
            slots = max(1, hot_bytes // (self._row_bytes + SLOT_OVERHEAD))
            if slots < hot.limit:
                tail = np.flatnonzero(hot.id_of[slots : hot.limit] >= 0) + slots
                if hot.inflight[tail].any():
                    raise StoreError("set_budget() cannot shrink the hot tier while a flush is writing; retry after it")
                self._evict_slots(tail)
                hot.set_limit(slots)
            else:
                hot.grow_limit(slots)
            self._hot_budget = hot_bytes

    # ------------------------------------------------------------------ stats, lifecycle
    def stats(self) -> StoreStats:
        """A snapshot of tier sizes, hit/miss counts, dirty rows and I/O totals."""
        with self._lock:
            s = StoreStats(**{k: getattr(self._stats, k) for k in StoreStats.counter_fields()})
            s.hot_bytes = self._hot.nbytes() if not self._closed else 0
            s.hot_budget_bytes = self._hot.budget_bytes() if not self._closed else 0
            s.warm_bytes = self._warm.nbytes
            s.warm_budget_bytes = self._warm.budget
            s.warm_hits, s.warm_misses = self._warm.hits, self._warm.misses
            s.dirty_rows = int(np.count_nonzero(self._hot.dirty)) if not self._closed else 0
            s.compression_ratio = self._warm.compression_ratio
            s.bytes_read = self._disk.bytes_read if self._disk else 0
            s.bytes_written = self._disk.bytes_written if self._disk else 0
            s.disk_bytes = self._disk.disk_bytes() if self._disk else 0
            s.io_wait_seconds = self._io_wait
            s.version = self._version
            s.pending_segments = len(self._pending)
            s.segments = len(self._committed)
        return s

    def close(self) -> None:
        """Release memory, threads and the writer lock. Unflushed updates are discarded."""
        if self._closed:
            return
        for ex in (self._prefetcher, self._bg):
            if ex is not None and self._pid == os.getpid():
                ex.shutdown(wait=True)
        with self._lock:
            self._closed = True
            for s in self._committed + self._pending:
                s.close()
            self._hot.close()
            self._np_views = {}
        self._release_lock()
        if self._ephemeral and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> "EmbeddingStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._pid == os.getpid():
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        mode = "memory" if self._hot_budget is None else f"disk, hot_bytes={self._hot_budget}"
        return (f"EmbeddingStore(path={str(self.path) if self.path else None!r}, num_rows={self._num_rows}, "
                f"dim={self.dim}, dtype={self.dtype}, {mode}, version={self._version})")

    # ------------------------------------------------------------------ guards
    def _check_usable(self, write: bool = False) -> None:
        if self._closed:
            raise StoreClosedError("this EmbeddingStore is closed; open it again with EmbeddingStore.open(path)")
        if write and self._readonly:
            raise ReadOnlyError("this store was opened with readonly=True; open it with readonly=False to write")
        if not self._readonly and os.getpid() != self._pid:
            raise ForkedWriterError(
                "a writable EmbeddingStore cannot be used in a forked child process (e.g. a DataLoader "
                "worker); open a readonly handle there: EmbeddingStore.open(path, readonly=True)"
            )

    def _check_names(self, names: Sequence[str]) -> tuple[str, ...]:
        names = tuple(names)
        for n in names:
            if n not in self._schema.fields:
                raise InvalidArgumentError(f"field {n!r} does not exist; this store has {list(self._schema.names)}")
        return names

    def _take_lock(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(
                f"the store at {str(root)!r} is open for writing elsewhere (one writer per path); "
                f"close it there or open this one with readonly=True"
            ) from None
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                if self._pid == os.getpid():
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
            except OSError:
                pass
            self._lock_fd = None

    def _after_fork_in_child(self) -> None:
        # Threads do not survive fork and a lock may have been held: start clean in the child.
        self._lock = threading.RLock()
        self._flush_lock = threading.Lock()
        self._bg = None
        self._prefetcher = None
        self._bg_futures = {}


def _reinit_after_fork() -> None:
    for store in list(_LIVE):
        store._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)

__all__ = ["EmbeddingStore", "DTYPES"]
