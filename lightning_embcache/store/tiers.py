"""Tier mechanics of EmbeddingStore: filling the hot tier from warm/disk, eviction, write-back.

`Tiers` is the component of `EmbeddingStore` that owns the hot and warm tiers and moves rows
between them and the files below. It sees the store's `Versions` only as a `Layout` (where rows
live, the writer lock, the segments its write-back adds: the whole surface, checked by mypy);
`Versions` sees it only as a `versions.WriteBack` (the write-back of a flush). Methods assume
the caller holds ``core.lock`` where they say so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from . import idsets, rowcopy
from .chunkload import ChunkLoader
from .chunkrows import DENSE_ROWS, ChunkRows
from .core import StoreCore
from .disk import Disk
from .errors import CorruptStoreError, StoreBusyError, StoreClosedError
from .fill import Filler
from .hot import SLOT_OVERHEAD, HotTier
from .memory import zeros
from .prefetch import Prefetcher
from .readahead import ReadAhead
from .rowindex import gather_deltas
from .snapshot import Snapshot
from .validate import budget
from .warm import WarmTier

if TYPE_CHECKING:
    from .disk import Segment
    from .rowindex import RowIndex

# One write-back or flush patches the warm copies of at most this many bytes of chunks (the rest
# of the warm chunks it touches are dropped): in random order a write-back touches every chunk held.
PATCH_BYTES = 32 << 20
#: a get that misses rows when the hot tier is full evicts others to install them (True), or
#: serves the rows it cannot install in free slots without a slot (False: see `_resolve_rows`)
GETS_EVICT = False
# Calls larger than this are resolved (and, in disk mode, served) in slices of this many rows, so
# one call's temporaries stay bounded whatever its batch (docs/store.md, "Memory").
SLICE_ROWS = 8192


@dataclass(frozen=True)
class Direct:
    """A read served without installing rows ``mids`` (sorted, unique) in the hot tier: too many
    for it, or rows of chunks held whole in the warm tier. ``slots`` for the ids of the call (-1
    where not hot), ``records`` for ``mids`` (`Tiers._direct_records`)."""

    slots: np.ndarray
    mids: np.ndarray
    records: np.ndarray


@dataclass(frozen=True)
class FromSlab:
    """A read whose missing rows all lie in chunks held raw in the warm tier's slab: ``slots``
    for the ids of the call (-1 where not hot), and for the positions ``missing`` of the others
    their ``rows`` in the slab (`Tiers._warm_records`)."""

    slots: np.ndarray
    missing: np.ndarray
    rows: np.ndarray


@dataclass(frozen=True)
class Gathered:
    """A read served whole: ``records`` of the ids of the call, in order (`Tiers._mapped_get`)."""

    records: np.ndarray


#: what `Tiers.resolve` gives: hot slots per id; None for a write that went around the hot
#: tier; or a read served another way
Resolved = np.ndarray | Direct | FromSlab | Gathered | None


def np_dtype(dtype: torch.dtype) -> np.dtype:
    # bfloat16 has no numpy dtype: move its bits as int16
    return np.dtype(np.int16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


#: memory mode's first touch of a never-written chunk makes only the rows read (True) or the
#: whole chunk (False, the default: a cache-sized device tier over a host table ran 3x slower
#: with rows made one by one, its record copies meeting a table that stays partly made). A store
#: whose table the GPU trains in place sets its own ``_rows_on_first_touch`` (`HostMappedTier`).
ROWS_ON_FIRST_TOUCH = False


class Layout(Protocol):
    """All `Tiers` uses of the files below it (`Versions` implements it): where rows live, the
    writer lock, and the segments its write-back adds."""

    disk: Disk | None  # None: a store without files
    cmap: np.ndarray  # per chunk: generation of its base file (0: never written)
    rows: RowIndex | None  # newest delta record of each id
    chunkrows: ChunkRows | None  # reads of base chunk files (`chunkrows_reader` makes it)
    below_token: int  # moves whenever rows below the hot tier change
    clean_due: bool  # a background write-back was asked for
    flush_lock: Any  # the writer lock (taken before ``core.lock``)

    def layout_of(self, chunk: int) -> tuple[int, tuple | None]: ...

    def find_below(self, rows: RowIndex, ids: np.ndarray, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def chunkrows_reader(self) -> ChunkRows | None: ...

    def take_seq(self) -> int: ...

    def begin_segment(self) -> int: ...

    def end_segment(self, seq: int) -> None: ...

    def add_pending(self, seg: Segment) -> None: ...

    def saw_damage(self, exc: CorruptStoreError) -> None: ...


class Tiers:
    """The hot and warm tiers over the store's files: reads that fill them, eviction, write-back.

    Holds the shared `StoreCore` and the store's `Versions` seen as a `Layout` (what it reads
    and appends pending segments to), never the `EmbeddingStore` itself."""

    def __init__(self, core: StoreCore, layout: Layout, hot: HotTier, warm: WarmTier,
                 hot_budget: int | None) -> None:
        self._c = core
        self._v = layout
        self.hot = hot
        self.warm = warm
        self.hot_budget = hot_budget
        self.cow: dict[int, np.ndarray] | None = None  # snapshot records of a flush in progress
        # the newest device write into the table still running (`EmbeddingStore._device_write`):
        # anything with `synchronize()`; host reads of the table wait for it first
        self.device_pending: Any = None
        #: memory mode's first touch makes only the rows read (True) or whole chunks (False);
        #: None: `ROWS_ON_FIRST_TOUCH`. A table the GPU trains in place sets it (`HostMappedTier`).
        self.rows_on_first_touch: bool | None = None
        # the prefetch thread (prefetch.py), lookahead hints and reads ahead (readahead.py), memory
        # mode's making of never-written chunks (fill.py); each holds these tiers weakly
        self.prefetch = Prefetcher(core, layout, self)
        self.readahead = ReadAhead(core, layout, self, self.prefetch)
        self.fill = Filler(core, layout, self)
        self._chunk_scratch: np.ndarray | None = None  # `_distinct`'s per-chunk scratch (4 bytes a chunk)
        self._positions = np.arange(1024, dtype=np.int32)  # 0, 1, ...: `_distinct`'s positions, reused
        if core.root is None and core.init_kind == "zeros" and not any(f.fill for f in core.schema.fields.values()):
            hot.loaded[:] = True  # the zero-filled pool already holds every row's initial value
            hot.all_loaded = True
        self.np_views = {n: self._field_np(n) for n in core.schema.names}

    @property
    def _disk(self) -> Disk:
        """The store's disk, where the caller runs only for a store with files."""
        disk = self._v.disk
        assert disk is not None, "a store without files has no disk"
        return disk

    @property
    def _chunkrows(self) -> ChunkRows:
        """The reader of base chunk files, where a plan made it (`Versions.chunkrows_reader`)."""
        reader = self._v.chunkrows
        assert reader is not None, "no plan made the chunk reader"
        return reader

    # ------------------------------------------------------------------ what Versions asks (WriteBack)
    def dirty_count(self) -> int:
        """Rows written since they were last written out (caller holds the lock)."""
        return int(np.count_nonzero(self.hot.dirty))

    def dirty_slots(self) -> np.ndarray:
        """The hot slots of those rows (caller holds the lock)."""
        return np.flatnonzero(self.hot.dirty)

    def forget_dirty(self) -> bool:
        """A store with no files "flushes" by forgetting which rows changed; whether any had."""
        if not self.hot.dirty.any():
            return False
        self.hot.dirty[:] = 0
        return True

    def resident(self) -> bool:
        """Whether the whole table lives in the pool (memory mode)."""
        return bool(self.hot.resident)

    # ------------------------------------------------------------------ the parts (prefetch.py, readahead.py, fill.py)
    def prefetch_later(self, idx: np.ndarray) -> None:
        """Queue a prefetch of validated ``idx`` on the prefetch thread; returns at once."""
        self.prefetch.later(idx)

    def stop_prefetch(self, wait: bool = True) -> None:
        self.prefetch.stop(wait)

    def stop_fill(self, wait: bool = True) -> None:
        self.fill.stop(wait)

    def upcoming(self, idx: np.ndarray) -> None:
        """`EmbeddingStore.upcoming` of validated ids (`ReadAhead.upcoming`)."""
        self.readahead.upcoming(idx)

    def read_seconds_per_row(self) -> float:
        """Recent wall time per row read below the hot tier (`ReadAhead.read_seconds_per_row`)."""
        return self.readahead.read_seconds_per_row()

    def materialize(self) -> None:
        """Bring every chunk of a memory-mode table into its pool now (`Filler.materialize`)."""
        self.fill.materialize()

    def start_filling(self) -> None:
        """Make a memory-mode table's never-written chunks in the background (`Filler.start_filling`)."""
        self.fill.start_filling()

    # The names the read path (`_resolve_rows` and the methods it calls) uses of the parts.
    @property
    def _fetching(self) -> np.ndarray | None:
        return self.prefetch.fetching

    @property
    def _loader(self) -> ChunkLoader | None:
        return self.readahead.loader

    @property
    def _hinted(self) -> list | None:
        return self.readahead.hinted

    def _await_prefetch(self, ids: np.ndarray) -> np.ndarray | None:
        return self.prefetch.await_rows(ids)

    def _hints_to_read(self, mids: np.ndarray) -> np.ndarray | None:
        return self.readahead.hints_to_read(mids)

    def _follow_window(self, idx: np.ndarray, slots: np.ndarray, missing: np.ndarray, for_write: bool) -> None:
        self.readahead.follow_window(idx, slots, missing, for_write)

    def _adopt_loads(self, wait_for: np.ndarray | None = None) -> None:
        self.readahead.adopt_loads(wait_for)

    def _note_read(self, seconds: float, rows: int) -> None:
        self.readahead.note_read(seconds, rows)

    # What the parts ask of the tiers (`prefetch.Reads`, `fill.Filled`): the read path's plan,
    # reads and installs, called through the names it has.
    def plan_below(self, ids: np.ndarray) -> tuple:
        return self._plan_below(ids)

    def read_below(self, plan: tuple, mapped: bool = True) -> tuple[np.ndarray, list]:
        return self._read_below(plan, mapped=mapped)

    def read_chunk_below(self, chunk: int, gen: int, delta: tuple | None) -> np.ndarray:
        return self._read_chunk_below(chunk, gen, delta)

    def will_need(self, plan: tuple) -> None:
        self._will_need(plan)

    def moved_since(self, plan: tuple) -> np.ndarray:
        return self._moved_since(plan)

    def chunks_read(self, plan: tuple) -> int:
        return self._chunks_read(plan)

    def allocate(self, n: int, protect: np.ndarray | None = None) -> np.ndarray:
        return self._allocate(n, protect=protect)

    def note_read(self, seconds: float, rows: int) -> None:
        self.readahead.note_read(seconds, rows)

    def load_chunk_resident(self, chunk: int) -> None:
        self._load_chunk_resident(chunk)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Free the tiers (caller holds both locks, every thread stopped)."""
        if self._loader is not None:
            self._loader.close()
        self.hot.close()
        self.warm.close()
        self.np_views = {}

    def after_fork(self) -> None:
        """In a forked child: no thread survived the fork."""
        self.prefetch.executor = None
        self.fill.executor = None

    def fill_stats(self, s: Any) -> None:
        """The tiers' share of `EmbeddingStore.stats` (caller holds the lock)."""
        open_ = not self._c.closed
        s.hot_bytes = self.hot.nbytes() if open_ else 0
        s.hot_budget_bytes = self.hot.budget_bytes() if open_ else 0
        s.warm_bytes = self.warm.nbytes
        s.warm_budget_bytes = self.warm.budget
        s.warm_hits, s.warm_misses = self.warm.hits, self.warm.misses
        s.warm_bytes_read, s.warm_bytes_written = self.warm.bytes_read, self.warm.bytes_written
        s.dirty_rows = int(np.count_nonzero(self.hot.dirty)) if open_ else 0
        s.compression_ratio = self.warm.compression_ratio

    def await_device_writes(self) -> None:
        """Wait for the device writes queued into the table so far (`_device_write`)."""
        pending = self.device_pending
        if pending is not None:
            pending.synchronize()
            if self.device_pending is pending:
                self.device_pending = None

    def _field_np(self, name: str) -> np.ndarray:
        f = self._c.schema.fields[name]
        pool = self.hot.pool_np
        if len(self._c.schema.fields) == 1:
            return pool.view(np_dtype(f.dtype))
        return pool[:, f.offset : f.offset + f.nbytes].view(np_dtype(f.dtype))

    def gather(self, slots: np.ndarray, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {n: self.take(slots, n) for n in names}

    def take(self, slots: np.ndarray, name: str) -> torch.Tensor:
        # numpy's take beat torch's index_select by ~30% on these 512-byte row gathers (bench store,
        # one thread); memory mode's per-step get uses index_select for its built-in bounds check.
        # A field of a multi-field record is a strided view of the pool, and `take` on a
        # non-contiguous array first copies the *whole* array (cost would follow the table):
        # plain fancy indexing gathers only the rows asked for.
        view = self.np_views[name]
        out = torch.from_numpy(view.take(slots, axis=0) if view.flags.c_contiguous else view[slots])
        return out.view(torch.bfloat16) if self._c.schema.fields[name].dtype == torch.bfloat16 else out

    def gather_warm(self, idx, slots, missing, rows, names) -> dict[str, torch.Tensor]:
        """Serve a read whose missing rows lie in the warm tier's slab (`FromSlab`)."""
        return self.fields_of(self._warm_records(idx, slots, missing, rows), names)

    def _warm_records(self, idx, slots, missing, rows) -> np.ndarray:
        """Whole records of ``idx``: ``missing`` positions from the warm slab's ``rows``, the rest hot."""
        slab = self.warm.slab
        assert slab is not None
        rec = slab.rows.take(rows, axis=0)
        if len(missing) < len(idx):  # some rows are hot (updated this epoch, or read ahead)
            full = np.empty((len(idx), self._c.row_bytes), np.uint8)
            full[missing] = rec
            hit = np.flatnonzero(slots >= 0)
            full[hit] = self.hot.pool_np.take(slots[hit], axis=0)
            rec = full
        return rec

    def fields_of(self, rec: np.ndarray, names: Sequence[str]) -> dict[str, torch.Tensor]:
        fields = self._c.schema.fields
        if len(fields) == 1:  # the record is the weight: a view of this new buffer
            dtype = fields["weight"].dtype
            if dtype != torch.bfloat16:  # (numpy's view and from_numpy cost a third of torch's view)
                return {n: torch.from_numpy(rec.view(self.np_views[n].dtype)) for n in names}
            return {n: self._c.schema.view(torch.from_numpy(rec), n) for n in names}
        t = torch.from_numpy(rec)
        return {n: self._c.schema.view(t, n).clone() for n in names}

    def gather_direct(self, idx, slots, mids, records, names) -> dict[str, torch.Tensor]:
        """Serve a read without installing rows ``mids`` (`Direct`): hot rows from their
        slots, the others from ``records``."""
        return self.fields_of(self._direct_records(idx, slots, mids, records), names)

    def _direct_records(self, idx, slots, mids, records) -> np.ndarray:
        """Whole records of ``idx``: hot rows from their slots, the others from ``records`` of ``mids``."""
        hit = np.flatnonzero(slots >= 0)
        # One gather into a new array, then the (few) hot rows over it: filling an empty array
        # through a mask pages in a fresh buffer each call.
        at = np.searchsorted(mids, idx)
        if len(hit):
            at[hit] = 0
        rec = records.take(at, axis=0)
        if len(hit):
            rec[hit] = self.hot.pool_np.take(slots[hit], axis=0)
        return rec

    def records_into(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Whole records of ``idx`` into ``out`` (n, row_bytes), filling misses; caller holds the
        lock. One gather of whole records, whatever the tier: no field-by-field path. ``out``
        None: into a new array of the store's own (the gather's output, no second copy)."""
        got = self.resolve(idx, load=True)
        if isinstance(got, Gathered):
            rec = got.records
        elif isinstance(got, FromSlab):
            rec = self._warm_records(idx, got.slots, got.missing, got.rows)
        elif isinstance(got, Direct):
            rec = self._direct_records(idx, got.slots, got.mids, got.records)
        else:
            if out is None:
                return self.hot.pool_np.take(cast(np.ndarray, got), axis=0)  # (contiguous pool)
            rowcopy.gather(self.hot.pool_np, cast(np.ndarray, got), out)
            return out
        if out is None:
            return rec
        out[:] = rec
        return out

    def write_records_into(self, idx: np.ndarray, records: np.ndarray) -> None:
        """Write whole ``records`` of unique ``idx``; caller holds the lock. Resolved before
        anything is written (a write-back that fails making room raises with nothing applied)."""
        values = {n: self._c.schema.view(torch.from_numpy(records), n) for n in self._c.schema.names}
        slots = cast("np.ndarray | None", self.resolve(idx, load=False, for_write=True, values=values))
        if slots is None:  # too large for the hot tier: written around it
            return
        if self.cow is not None:
            self.save_cow(slots)
        rowcopy.scatter(self.hot.pool_np, slots, records)
        self.hot.dirty[slots] = 1

    def _snapshot_reader(self, slots: np.ndarray) -> Snapshot:
        """Start a copy-on-write snapshot of ``slots`` (caller holds the lock and marks them
        in flight): their records as they are now, read later in blocks (snapshot.py)."""
        self.await_device_writes()  # rows a device is still writing are read whole
        self.cow = {}
        return Snapshot(self._c.lock, lambda: self.hot.pool_np, slots, self.cow)

    def save_cow(self, slots: np.ndarray) -> None:
        """Before overwriting rows a flush is still writing, keep their snapshot records."""
        cow = self.cow
        assert cow is not None
        hit = slots[self.hot.inflight[slots]]
        for s in idsets.unique(hit).tolist():
            if s not in cow:
                cow[s] = self.hot.pool_np[s].copy()

    def scatter(self, slots: np.ndarray, vals: dict[str, torch.Tensor]) -> None:
        """Write rows into hot slots and mark them dirty; of duplicate slots the last write wins
        (numpy's fancy assignment runs in order, unlike index_copy_, whose duplicates are undefined)."""
        if self.cow is not None:
            self.save_cow(slots)
        for n, v in vals.items():
            self.np_views[n][slots] = to_np(v)
        self.hot.dirty[slots] = 1

    def resolve(self, idx: np.ndarray, *, load: bool, for_write: bool = False,
                 values: dict[str, torch.Tensor] | None = None) -> Resolved:
        """Slots holding ``idx``, filling misses from below. Caller holds the lock.

        For a write covering every field (``load=False``) missing rows are not read from below.
        Returns None when a write was too large for the hot tier and went straight to disk; a
        read may instead be served without hot slots (`Direct`, `FromSlab`); writes and memory
        mode always get slots (or None).
        """
        try:
            return self._resolve_rows(idx, load=load, for_write=for_write, values=values)
        except CorruptStoreError as exc:
            self._v.saw_damage(exc)  # fail-stop (Versions.saw_damage)
            raise

    def _resolve_rows(self, idx: np.ndarray, *, load: bool, for_write: bool = False,
                      values: dict[str, torch.Tensor] | None = None) -> Resolved:
        hot = self.hot
        if hot.resident:  # slots are the ids: resolving means loading missing rows, slice by slice
            return self._resolve_resident(idx)
        if load and not for_write and self._plain_below():
            got = self._mapped_get(idx)
            if got is not None:
                return got
        slots, missing, asked = self._lookup(idx, for_write)
        n_miss = int(missing.sum())
        reading = bool(n_miss) and load and not for_write
        slab = self._slab_rows(idx, missing) if reading and self.warm.slab is not None else None
        if hot.want is not None:
            # rows served from warm chunks were in memory when read: the lookahead did its work
            self._follow_window(idx, slots, asked if slab is None else asked & ~missing, for_write)
        if slab is not None:
            return FromSlab(slots, *slab)
        if not n_miss:
            return slots
        mids = idsets.unique(idx[missing])
        if len(mids) > hot.limit or (for_write and len(mids) > hot.limit // 2):
            if for_write:
                self.write_around(idx, mids, values or {}, load)
                return None
        if len(mids) > hot.limit and not for_write:
            return Direct(slots, mids, self._fetch(mids))
        return self._fill_misses(idx, slots, missing, mids, load=load, for_write=for_write, values=values)

    def _resolve_resident(self, idx: np.ndarray) -> np.ndarray:
        """Memory mode: the slots are the ids; rows not made yet are loaded, a slice at a time."""
        hot = self.hot
        if hot.all_loaded:
            return idx
        n_miss = 0
        for a in range(0, len(idx), SLICE_ROWS):
            part = idx[a : a + SLICE_ROWS]
            slots = hot.lookup(part)
            if slots is not part:
                miss = part[slots < 0]
                self._load_resident(miss)
                n_miss += len(miss)
        if n_miss:  # a scan of the chunk flags only on a step that loaded chunks, never per step
            hot.all_loaded = bool(hot.loaded.all())
        self._c.stats.hot_misses += n_miss
        self._c.stats.hot_hits += len(idx) - n_miss
        return idx

    def _lookup(self, idx: np.ndarray, for_write: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Hot slots of ``idx`` (-1: not hot), which are missing, and which were missing when the
        call came (the hit statistics count these): a read waits for rows a prefetch is reading."""
        hot = self.hot
        slots = hot.lookup(idx)
        missing = slots < 0
        asked = missing
        if self._fetching is not None and not for_write and missing.any():
            if self._await_prefetch(idx[missing]) is not None:
                slots = hot.lookup(idx)  # rows the prefetch brought in while we waited
                missing = slots < 0
        n_asked = int(asked.sum())
        self._c.stats.hot_hits += len(idx) - n_asked
        self._c.stats.hot_misses += n_asked
        return slots, missing, asked

    def _slab_rows(self, idx: np.ndarray, missing: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Where every missing row lies in a chunk held raw in the warm tier (`ChunkShuffleSampler`
        order once its window is read): their positions and rows in the slab, so one gather in
        request order serves them, with no plan below the hot tier and no slot (each such row is
        read once an epoch); else None. The copies are current (see `_fill_misses`)."""
        where = np.flatnonzero(missing)
        ids = idx[where]
        cr = self._c.chunk_rows
        chunks = ids // cr
        rows = self.warm.rows_of(chunks, ids - chunks * cr)
        if rows is None and self._loader is not None and len(self._loader):
            self._adopt_loads(idsets.unique(chunks))  # chunks being read ahead: wait for them
            rows = self.warm.rows_of(chunks, ids - chunks * cr)
        return None if rows is None else (where, rows)

    def _fill_misses(self, idx: np.ndarray, slots: np.ndarray, missing: np.ndarray, mids: np.ndarray, *,
                     load: bool, for_write: bool, values: dict[str, torch.Tensor] | None) -> Resolved:
        """Read the missing rows ``mids`` (with announced ones of coming batches) and install them
        in hot slots, evicting as needed; or serve a get without slots where that is cheaper."""
        hot = self.hot
        ahead = self._hints_to_read(mids) if load and not for_write and self._hinted else None
        records, warm, ahead, ahead_records = self._fetch_misses(mids, ahead, load)
        served = None
        if not for_write and warm is not None and warm.any():
            # A get's rows whose chunk is held whole in memory (a warm copy, or read whole just
            # now and kept warm) are served from it and not installed: in `ChunkShuffleSampler`
            # order each row is read once an epoch, so a slot (allocation, eviction, the copy in
            # and out) would be pure cost. The copy is current: every change below the hot tier
            # patches (or drops) the warm copies of its chunks (`patch_warm`), and rows hot here
            # (dirty or not) are served from the hot tier. An update of such a row takes a slot as usual.
            if warm.all():
                return Direct(slots, mids, records)
            served = (mids[warm], records[warm])
            mids, records = mids[~warm], records[~warm]
        if not for_write and ahead is None and not GETS_EVICT and hot.free_count < len(mids):
            # A get installs what fits in free slots and serves the rest without a slot: it evicts
            # nothing. Reading such a row again costs a gather from the page cache (or a warm
            # copy), about what its install costs, while evicting for it cost a CLOCK scan, the
            # install, and perhaps a write-back of a dirty row a training run still wants. So an
            # evaluation pass (get only) leaves a training run's hot tier as it found it; an
            # update of rows takes their slots as ever.
            got = hot.take_free(hot.free_count)
            if len(got):
                hot.install(mids[: len(got)], got, records[: len(got)])
                mids, records = mids[len(got) :], records[len(got) :]
            mids, records = _with_served(mids, records, served, self._c.row_bytes)
            return Direct(hot.slot_of[idx].astype(np.int64) - 1 if len(got) else slots, mids, records)
        got = self._allocate(len(mids), protect=slots[~missing])
        if len(got) < len(mids):
            # No room even after eviction (everything in flight or in use by this call).
            hot.give_back(got)
            if for_write:
                self.write_around(idx, mids, values or {}, load)
                return None
            # the rows served from warm copies join the direct read
            return Direct(slots, *_with_served(mids, records, served, self._c.row_bytes))
        hot.install(mids, got, records)
        slots = hot.slot_of[idx].astype(np.int64) - 1
        if ahead is not None and len(ahead):
            room = self._allocate(len(ahead), protect=slots)
            if len(room):
                hot.install(ahead[: len(room)], room, ahead_records[: len(room)])
                self._c.stats.prefetched_rows += len(room)
        if served is not None:
            return Direct(hot.slot_of[idx].astype(np.int64) - 1, *served)
        return slots

    def _fetch_misses(self, mids: np.ndarray, ahead: np.ndarray | None, load: bool) -> tuple:
        """(records of ``mids``, which came from whole chunks or None, announced rows ``ahead``
        still to install and their records). ``load`` False (a write of every field): no records,
        None, where that write fills every byte of the slots it is given (zeros first would only
        page in and write a buffer of the batch's size); zeros where records have padding."""
        if ahead is None:
            if not load:
                schema = self._c.schema
                if sum(f.nbytes for f in schema.fields.values()) == schema.row_bytes:  # (no padding)
                    return None, None, None, None
                return np.zeros((len(mids), self._c.row_bytes), np.uint8), None, None, None
            records, warm = self._fetch(mids, whole_rows=True)
            return records, warm, None, None
        # this miss reads the announced rows of coming batches with its own
        both = idsets.union(mids, ahead)
        records, warm = self._fetch(both, whole_rows=True)
        mine = idsets.isin(both, mids, b_sorted_unique=True)
        ahead, ahead_records, records = both[~mine], records[~mine], records[mine]
        # announced rows of warm chunks are served from those when their get comes
        ahead_warm, warm = warm[~mine], warm[mine]
        if ahead_warm.any():
            ahead, ahead_records = ahead[~ahead_warm], ahead_records[~ahead_warm]
        return records, warm, ahead, ahead_records

    def _plain_below(self) -> bool:
        """Whether a get missing rows may try `_mapped_get` (caller holds the lock): no warm tier,
        no lookahead window, no prefetch in flight.

        Rows it serves are not installed in the hot tier, free slots or not: reading one again
        costs a gather from the page cache, about what a hot hit costs, while installing it
        costs a slot's memory (the budget) and the copy in. Rows that take the general path
        (first reads of a chunk, rows in delta segments, rows on disk) are installed as before."""
        warm = self.warm
        return (not GETS_EVICT and self.hot.want is None and self._fetching is None and not self._hinted
                and warm.slab is None and not warm.budget and not len(warm) and self._v.chunkrows is not None
                and (self._loader is None or not len(self._loader)))

    def _mapped_get(self, idx: np.ndarray) -> Gathered | np.ndarray | None:
        """The steady state of a get over a page-cached table (`_plain_below`): every row not
        hot from its base chunk file (no delta record), mapped and verified whole, in one gather
        in the call's order, hot rows then copied over theirs: no plan, no sort, no slot. Hot
        slots if every row is hot; None (nothing done, nothing counted) if any row needs the
        general path. A handful of array operations a batch, whatever the table: this is what a
        get costs over memmap."""
        hot = self.hot
        raw = hot.slot_of[idx]  # slot + 1; 0: not hot
        n_hot = np.count_nonzero(raw)  # (a C call: ndarray.any() costs three times as much)
        if n_hot == len(idx):  # every row hot: slots, as `_lookup` gives them
            slots = raw.astype(np.int64) - 1
            hot.ref[slots] = 1
            self._c.stats.hot_hits += len(idx)
            return slots
        hit = raw.nonzero()[0] if n_hot else None  # (the methods: np.flatnonzero/argmin wrap them in Python)
        rows = self._v.rows
        if rows is not None and len(rows) and rows.any_of(idx[raw == 0] if n_hot else idx):
            return None
        cr = self._c.chunk_rows
        chunks = idx // cr
        t0 = time.perf_counter()
        # (a hot row's position gathers a copy of a missed row's, then takes its own record)
        stand_in = int(raw.argmin()) if n_hot else 0  # a missed row (raw 0)
        recs = self._chunkrows.gather_verified(idx, chunks, self._v.cmap[chunks], hit, stand_in)
        if recs is None:
            return None
        took = time.perf_counter() - t0
        n_miss = len(idx) - n_hot
        stats = self._c.stats
        stats.stall_seconds += took
        self._note_read(took, n_miss)
        stats.hot_misses += n_miss
        if hit is not None:
            stats.hot_hits += n_hot
            slots = raw[hit] - 1
            hot.ref[slots] = 1
            recs[hit] = hot.pool_np.take(slots, axis=0)
            chunks[hit] = chunks[stand_in]  # (chunks read: of the missed rows only)
        stats.cold_reads += self._distinct(chunks)
        return Gathered(recs)

    def _distinct(self, chunks: np.ndarray) -> int:
        """How many distinct values ``chunks`` holds, without a sort (a sort of a batch's 512 ids
        cost more than the rest of `_mapped_get` here): each chunk's scratch entry keeps one
        position that wrote it. Caller holds the lock."""
        n = len(chunks)
        scratch, at = self._chunk_scratch, self._positions
        if scratch is None or len(at) < n:
            at = self._positions = np.arange(max(n, 1024), dtype=np.int32)
        nc = -(-self._c.num_rows // self._c.chunk_rows)
        if scratch is None or len(scratch) < nc:  # (a table that grew has more chunks)
            scratch = self._chunk_scratch = zeros(nc, np.dtype(np.int32))
        at = at[:n]
        scratch[chunks] = at
        return int(np.count_nonzero(scratch[chunks] == at))

    def _allocate(self, n: int, protect: np.ndarray | None = None) -> np.ndarray:
        """n free slots, evicting (and writing back) cold rows by CLOCK as needed."""
        hot = self.hot
        got = hot.take_free(n)
        if len(got) < n:
            victims = hot.victims(n - len(got), protect)
            if len(victims):
                try:
                    self._evict_slots(victims)  # a failed write-back evicts nothing
                except BaseException:
                    hot.give_back(got)
                    raise
                more = hot.take_free(n - len(got))
                got = np.concatenate([got, more])
        return got

    def _evict_slots(self, slots: np.ndarray) -> None:
        hot = self.hot
        d = slots[hot.dirty[slots] != 0]
        if len(d):
            self._write_back(hot.id_of[d], hot.pool_np[d])
        self._c.stats.evicted_bytes += len(slots) * self._c.row_bytes
        hot.drop(slots)

    def _write_back(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Write evicted dirty rows to a pending segment (part of the next flush's version)."""
        assert self._v.disk is not None
        order = np.argsort(ids, kind="stable")
        seq = self._v.take_seq()
        self._add_pending(self._v.disk.write_segment(seq, ids[order], np.ascontiguousarray(records[order]),
                                                   durable=False))

    def _add_pending(self, seg: Any) -> None:
        """A segment this handle just wrote without publishing it (write-back, a write around the
        hot tier) becomes part of the rows below the hot tier: indexed, and its rows' warm chunks
        patched (`patch_warm`). Caller holds the lock."""
        self._v.add_pending(seg)
        self.patch_warm(seg.ids)

    def patch_warm(self, ids: np.ndarray) -> None:
        """Rows ``ids`` (sorted) just got a new record below the hot tier, and they are hot with
        that value (a write-back, a flush) or newer (updated since: dirty again, so they reach
        the tier below again before they can leave the hot tier): the warm copies of their
        chunks take the hot values and stay exact. Dropping them instead made training in
        `ChunkShuffleSampler` order read each chunk of the window again after every write-back
        and flush. A chunk with a row not hot (a write around the hot tier), held compressed
        (`WarmTier.patch`), or past PATCH_BYTES of copies in one call is dropped. Caller holds the
        lock."""
        warm = self.warm
        if not len(warm) or not len(ids):
            return
        cr = self._c.chunk_rows
        chunks = ids // cr
        held = idsets.isin(chunks, warm.chunks(), b_sorted_unique=True)
        if not held.any():
            return
        ids, chunks = ids[held], chunks[held]
        hot = self.hot
        if hot.resident:
            warm.discard_many(chunks)
            return
        slots = hot.slot_of[ids].astype(np.int64) - 1
        bounds = idsets.runs(chunks)
        room = PATCH_BYTES
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            c, s = int(chunks[a]), slots[a:b]
            if room <= 0 or (s < 0).any() or not warm.patch(c, ids[a:b] - c * cr, hot.pool_np[s]):
                warm.discard(c)
            else:
                room -= cr * self._c.row_bytes

    def clean(self) -> None:
        """Background write-back: turn dirty hot rows that are not recently used into clean ones.

        The rows stay resident; their values go to a pending segment (part of the next flush), so
        a later eviction of them is free. Holds the flush lock so no flush can publish a version
        while cleaned rows are neither dirty nor in a published segment.
        """
        with self._v.flush_lock:
            with self._c.lock:
                self._v.clean_due = False
                hot = self.hot
                if self._c.closed or hot.resident or self._v.disk is None:
                    return
                slots = np.flatnonzero(hot.dirty[: hot.limit])
                cold = slots[hot.ref[slots] == 0]
                take = cold if len(cold) >= len(slots) // 2 else slots
                if len(take) < max(1, hot.limit // 8):
                    return
                ids, take, records, seq = self.begin_write_back(take)
            try:
                seg = self._v.disk.write_segment(seq, ids, records, durable=False)
            except BaseException:
                self.end_write_back(take, seq, ok=False)
                raise
            with self._c.lock:
                self.end_write_back(take, seq, ok=True)
                self._add_pending(seg)
                self._c.stats.cleaned_rows += len(ids)

    def begin_write_back(self, slots: np.ndarray):
        """Start writing dirty ``slots`` out (caller holds the lock): their ids sorted, a
        copy-on-write reader of their records, a segment number. They stop being dirty and cannot
        be evicted until `end_write_back`."""
        hot = self.hot
        ids = slots if hot.resident else hot.id_of[slots]
        order = np.argsort(ids, kind="stable")
        ids, slots = ids[order], slots[order]
        records = self._snapshot_reader(slots)
        hot.dirty[slots] = 0
        hot.inflight[slots] = True
        seq = self._v.begin_segment()  # these rows' values below the hot tier change
        return ids, slots, records, seq

    def end_write_back(self, slots: np.ndarray, seq: int, *, ok: bool) -> None:
        """Finish `begin_write_back`; on failure the rows are dirty again (nothing is lost)."""
        with self._c.lock:
            if not ok:
                self.hot.dirty[slots] = 1
            self.hot.inflight[slots] = False
            self.cow = None
            self._v.end_segment(seq)

    def write_around(self, idx, mids, values, load: bool) -> None:
        """A write too large for the hot tier (or larger than one slice): staged, then applied.

        Every row of the call, merged with its stored record where fields are missing, is written
        as one pending segment (streamed in blocks: bounded temporaries); only once that file is
        whole are resident copies updated in place. A write that fails (full disk, permissions)
        therefore leaves no row of the call applied. Caller holds the lock.
        """
        hot = self.hot
        uniq, pos = _last_of_each(idx)  # of duplicate ids the last wins

        def records(a: int, b: int) -> np.ndarray:
            ids = uniq[a:b]
            recs = np.zeros((len(ids), self._c.row_bytes), np.uint8)
            slots = hot.lookup(ids)
            res = slots >= 0
            if res.any():
                recs[res] = hot.pool_np[slots[res]]
            if load and not res.all():
                recs[~res] = self._fetch(ids[~res])
            rec_t = torch.from_numpy(recs)
            p = torch.from_numpy(pos[a:b])
            for n, v in values.items():
                self._c.schema.view(rec_t, n)[:] = v[p]
            return recs

        seq = self._v.take_seq()
        # a write that fails raises here, with nothing applied
        self._add_pending(self._disk.write_segment(seq, uniq, records, durable=False))
        # Resident copies take the write too (the hot tier is read first); they stay dirty. In
        # call order, a slice at a time: of duplicate ids the last still wins, temporaries stay small.
        for a in range(0, len(idx), SLICE_ROWS):
            slots = hot.lookup(idx[a : a + SLICE_ROWS])
            res = slots >= 0
            if res.any():
                if self.cow is not None:
                    self.save_cow(slots[res])
                at = torch.from_numpy(np.flatnonzero(res) + a)
                for n, v in values.items():
                    self.np_views[n][slots[res]] = to_np(v[at])
                hot.dirty[slots[res]] = 1

    def _load_resident(self, miss: np.ndarray) -> None:
        """Bring rows ``miss`` of a memory-mode table into its pool: their chunks whole, once (with
        `ROWS_ON_FIRST_TOUCH`, rows of chunks never written anywhere are made one by one from their
        initial values instead). Caller holds the lock."""
        if not len(miss):
            return
        t0 = time.perf_counter()
        cr = self._c.chunk_rows
        chunks = idsets.unique(miss // cr)
        if not (ROWS_ON_FIRST_TOUCH if self.rows_on_first_touch is None else self.rows_on_first_touch):
            fresh = chunks[:0]
        elif self._v.rows is None or not len(self._v.rows):  # no delta records: only the chunk map decides
            fresh = chunks if self._v.disk is None else chunks[self._v.cmap[chunks] == 0]
        else:
            fresh = np.asarray([c for c in chunks.tolist() if self._v.layout_of(c) == (0, None)], np.int64)
        if len(fresh) < len(chunks):
            for c in np.setdiff1d(chunks, fresh, assume_unique=True).tolist():
                self.hot.fill_chunk(c, self._below(c))
        if len(fresh):
            rows = idsets.unique(miss[idsets.isin(miss // cr, fresh, b_sorted_unique=True)])
            self.hot.pool_np[rows] = self._c.init_rows(rows)
            self.hot.mark_rows(rows)
        self._c.stats.stall_seconds += time.perf_counter() - t0

    def _load_chunk_resident(self, chunk: int) -> None:
        t0 = time.perf_counter()
        self.hot.fill_chunk(chunk, self._below(chunk))
        self._c.stats.stall_seconds += time.perf_counter() - t0

    # ---- the miss path: one plan per batch, vectorised reads ----------------------------------
    def _fetch(self, ids: np.ndarray, whole_rows: bool = False):
        """Records of sorted unique ``ids`` from the warm tier or disk. Caller holds the lock.

        ``whole_rows``: return (records, which rows came from chunks held whole: a warm copy, or
        a chunk read whole just now and kept warm, so that a later read finds it there too)."""
        t0 = time.perf_counter()
        if self._loader is not None and len(self._loader):
            # what was read ahead is taken in (the plan finds it warm), without waiting: chunks
            # still in flight that this get needs were waited for in `resolve`; others (rows
            # read around the hot tier) are read here as usual
            self._adopt_loads()
        self.warm.pin()  # the plan's warm copies stay put until read
        try:
            plan = self._plan_below(ids)
            records, whole = self._read_below(plan)
        finally:
            self.warm.unpin()
        self._c.stats.cold_reads += self._chunks_read(plan)
        took = time.perf_counter() - t0
        self._c.stats.stall_seconds += took
        self._note_read(took, len(ids))
        if self.warm.budget:
            for c, recs in whole:
                self.warm.put(c, recs)
        if not whole_rows:
            return records
        mask = np.zeros(len(ids), np.bool_)
        for c, a, b, cached, _ in plan[6]:
            if cached is not None or c in self.warm:  # (not a chunk too large for the tier)
                mask[a:b] = True
        return records, mask

    def _moved_since(self, plan: tuple) -> np.ndarray:
        """For each row of a `_plan_below` plan: has its newest record below the hot tier moved
        since (a write-back or flush wrote a newer one)? Caller holds the lock. Every change of a
        row below the hot tier writes a new record (records are never modified in place), so a
        row whose record is where the plan found it still has the value that was read."""
        ids, chunks, seg, pos, gens, segs, whole = plan
        rows = self._v.rows
        if rows is not None and len(rows):
            now_seg, now_pos = self._v.find_below(rows, ids, chunks)
        else:
            now_seg, now_pos = np.full(len(ids), -1, np.int32), np.zeros(len(ids), np.int32)

        def seqs(lst: list, numbers: np.ndarray) -> np.ndarray:
            table = np.fromiter((g.seq for g in lst), np.int64, len(lst)) if lst else np.zeros(1, np.int64)
            return np.where(numbers >= 0, table[np.maximum(numbers, 0)], -1)

        before = seqs(segs, seg)
        after = seqs(rows.segs if rows is not None else [], now_seg)
        moved = before != after
        if self._v.disk is not None:
            # A row read from its base chunk, whose chunk a compaction rewrote since (folding a
            # delta written after the plan), is found in a base chunk before and after: -1 both.
            moved |= self._v.cmap[chunks] != gens
        if pos is not None:
            moved |= (now_pos != pos) & (after >= 0)
        for _c, a, b, _cached, _ in whole:  # whole chunks (warm copies) carry no positions: redo
            moved[a:b] = True
        return moved

    def _will_need(self, plan: tuple) -> None:
        """Before a prefetch reads its base-chunk rows one run at a time, ask the kernel for all
        their blocks at once (``posix_fadvise(WILLNEED)`` starts the reads and returns): a cold
        batch then waits about one disk latency, not one per row."""
        ids, chunks, seg, _, gens, _, _ = plan
        base = (seg < 0) & (gens > 0)
        if self._v.chunkrows is not None and np.count_nonzero(base) > 1:
            c = chunks[base]
            self._v.chunkrows.will_need(c, ids[base] - c * self._c.chunk_rows, gens[base])

    @staticmethod
    def _chunks_read(plan: tuple) -> int:
        """Chunks a plan reads below the hot tier (the ``cold_reads`` count): every chunk of its
        rows except those served by a warm copy."""
        chunks, whole = plan[1], plan[6]
        if not len(chunks):
            return 0
        n = 1 + int(np.count_nonzero(chunks[1:] != chunks[:-1]))
        return n - sum(1 for w in whole if w[3] is not None)

    def _plan_below(self, ids: np.ndarray) -> tuple:
        """Where the records of sorted unique ``ids`` live below the hot tier (caller holds the lock).

        One lookup in the row index finds every id's newest delta record; the rest come from base
        chunks (generation from the chunk map) or are never written. Chunks the warm tier holds,
        and chunks most of whose rows are wanted when there is a warm tier to keep them in, are
        read whole. The plan names only files whose bytes it reads never change (a delta record
        it names is punched only after every read planned before its round ended: holes.py), so
        `_read_below` runs without the lock.
        """
        cr = self._c.chunk_rows
        chunks = ids // cr
        rows = self._v.rows
        if rows is not None and len(rows):
            seg, pos = self._v.find_below(rows, ids, chunks)
        else:
            seg, pos = np.full(len(ids), -1, np.int32), None
        gens = self._v.cmap[chunks] if self._v.disk is not None else np.zeros(len(ids), np.int32)
        whole = []
        warm = self.warm
        if len(ids) and (warm.budget or len(warm)):
            bounds = idsets.runs(chunks)
            uc = chunks[bounds[:-1]]
            pick = np.zeros(len(uc), np.bool_)
            if len(warm):
                pick |= idsets.isin(uc, warm.chunks(), b_sorted_unique=True)
            if warm.budget:
                counts = np.diff(bounds)
                pick |= counts * DENSE_ROWS >= cr  # dense: read whole and keep it warm
                want = self.hot.want
                if want is not None and not pick.all():
                    # Chunks of which coming batches announced enough rows (`upcoming`) are
                    # read whole now too: the first batch of a `ChunkShuffleSampler` window
                    # meets each of its chunks with a few rows, and reading those rows alone
                    # opened each file for them just before the next batch read it whole.
                    # Only where that scans few bytes per row asked (not a random order's
                    # hundreds of chunks with a row each).
                    full = self._c.num_rows // cr
                    few = np.flatnonzero(~pick)
                    few = few[uc[few] < full]
                    if len(few) and len(few) * cr <= 64 * len(ids):
                        ahead = np.count_nonzero(want[: full * cr].reshape(full, cr)[uc[few]], axis=1)
                        pick[few] = (counts[few] + ahead) * DENSE_ROWS >= cr
            for i in np.flatnonzero(pick).tolist():
                c = int(uc[i])
                cached = warm.get(c)
                whole.append((c, int(bounds[i]), int(bounds[i + 1]), cached,
                              None if cached is not None else self._v.layout_of(c)))
        self._v.chunkrows_reader()
        return ids, chunks, seg, pos, gens, (rows.segs if rows is not None else []), whole

    def _read_below(self, plan: tuple, mapped: bool = True) -> tuple[np.ndarray, list]:
        """Run a `_plan_below` plan: (records of its ids, [(chunk, records)] read whole).

        Touches no mutable store state (the prefetch thread runs it without the lock): rows of
        base chunks are gathered from maps of their files (``mapped``; else read with io_uring,
        many in flight: the prefetch thread's rows are likely on disk), delta records with one
        gather per segment touched, never-written rows computed per row.
        """
        ids, chunks, seg, pos, gens, segs, whole = plan
        cr, rb = self._c.chunk_rows, self._c.row_bytes
        out = np.empty((len(ids), rb), np.uint8)
        read_whole = []
        if whole:
            sparse = np.ones(len(ids), np.bool_)
            local = ids - chunks * cr
            for c, a, b, cached, layout in whole:
                sparse[a:b] = False
                if cached is None:
                    cached = self._read_chunk_below(c, *layout)
                    read_whole.append((c, cached))
                # into its place in ``out``, without a temporary
                cached.reshape(-1, rb).take(local[a:b], axis=0, out=out[a:b])
        below = seg < 0
        if whole:
            below &= sparse
        base = below & (gens > 0)
        if base.any():
            sel = np.flatnonzero(base)
            c = chunks[sel]
            out[sel] = self._chunkrows.read(c, ids[sel] - c * cr, gens[sel], mapped=mapped)
        fresh = below & (gens == 0)
        if fresh.any():
            sel = np.flatnonzero(fresh)
            out[sel] = self._c.init_rows(ids[sel])
        if pos is not None:
            delta = seg >= 0
            if whole:
                delta &= sparse
            if delta.any():
                sel = np.flatnonzero(delta)
                gather_deltas(out, sel, seg[sel], pos[sel], segs,
                              self._v.chunkrows.cache_counts if self._v.chunkrows is not None else None)
        return out, read_whole

    def _read_chunk_below(self, chunk: int, gen: int, delta: tuple | None) -> np.ndarray:
        """A whole chunk's records from a `Layout.layout_of` snapshot; touches no mutable store state."""
        rows = min(self._c.chunk_rows, self._c.num_rows - chunk * self._c.chunk_rows)
        recs = self._disk.read_chunk(chunk, gen) if gen else self._c.init_records(chunk, rows)
        if delta is not None:
            ids, seg, pos, segs = delta
            gather_deltas(recs, ids - chunk * self._c.chunk_rows, seg, pos, segs)
        return recs

    def _below(self, chunk: int) -> np.ndarray:
        """A chunk's records as stored below the hot tier: warm copy, else base + deltas."""
        rows = min(self._c.chunk_rows, self._c.num_rows - chunk * self._c.chunk_rows)
        cached = self.warm.get(chunk)
        if cached is not None:
            return cached.reshape(rows, self._c.row_bytes)
        recs = self._read_chunk_below(chunk, *self._v.layout_of(chunk))
        self._c.stats.cold_reads += 1
        if self.warm.budget:
            self.warm.put(chunk, recs)
        return recs

    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` of hot and warm memory (dirty rows written back first)."""
        nbytes = cast(int, budget(nbytes, "nbytes", allow_none=False))
        freed = 0
        with self._c.lock:
            if self._c.closed:
                raise StoreClosedError("this EmbeddingStore was closed during evict()")
            freed += self.warm.shrink(max(0, self.warm.nbytes - nbytes))
            if freed >= nbytes or self._v.disk is None:
                return freed
            hot = self.hot
            if hot.resident:
                held = hot.loaded if hot.row_count is None else hot.loaded | (hot.row_count > 0)
                for c in np.flatnonzero(held).tolist():
                    if freed >= nbytes:
                        break
                    lo, hi = hot.chunk_range(c)
                    if hot.inflight[lo:hi].any():
                        continue
                    rows = hi - lo if hot.loaded[c] else int(hot.row_count[c])  # type: ignore[index]
                    d = np.flatnonzero(hot.dirty[lo:hi]) + lo
                    if len(d):
                        self._write_back(d, hot.pool_np[d])
                    hot.unload_chunk(c)
                    freed += rows * self._c.row_bytes
            else:
                per = self._c.row_bytes + SLOT_OVERHEAD
                want = min(hot.used, -(-(nbytes - freed) // per))
                victims = hot.victims(want)
                if len(victims) < want:  # everything was recently used: take any idle slot
                    occ = np.flatnonzero((hot.id_of[: hot.limit] >= 0) & ~hot.inflight[: hot.limit])
                    victims = idsets.unique(np.concatenate([victims, occ[: want]]))[:want]
                self._evict_slots(victims)
                freed += len(victims) * per
        return freed

    def set_budget(self, hot_bytes: int | None = None, warm_bytes: int | None = None) -> None:
        """Change the budgets at run time (a lower budget evicts at once). None keeps a budget.

        Waits for a flush or background write-back in progress (rows they write cannot move)."""
        if warm_bytes is not None:
            budget(warm_bytes, "warm_bytes", allow_none=False)
        if hot_bytes is not None:
            budget(hot_bytes, "hot_bytes", allow_none=False)
        with self._v.flush_lock, self._c.lock:
            if self._c.closed:
                raise StoreClosedError("this EmbeddingStore was closed during set_budget()")
            if warm_bytes is not None:
                if self._loader is not None:  # reads ahead land in the slab the new budget replaces
                    self._loader.cancel()
                self.warm.budget = cast(int, budget(warm_bytes, "warm_bytes", allow_none=False))
                self.warm.shrink(self.warm.budget)
            if hot_bytes is None:
                return
            hot_bytes = cast(int, budget(hot_bytes, "hot_bytes", allow_none=False))
            hot = self.hot
            if hot.resident:
                over = hot.nbytes() - hot_bytes
                if over > 0:
                    self.evict(over)
                return
            slots = max(1, hot_bytes // (self._c.row_bytes + SLOT_OVERHEAD))
            if slots < hot.limit:
                tail = np.flatnonzero(hot.id_of[slots : hot.limit] >= 0) + slots
                if hot.inflight[tail].any():  # not while holding the writer lock; kept as a guard
                    raise StoreBusyError(
                        "set_budget() cannot shrink the hot tier while a flush is writing; retry after it"
                    )
                self._evict_slots(tail)
                hot.set_limit(slots)
            else:
                hot.grow_limit(slots)
            self.hot_budget = hot_bytes

def _last_of_each(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct ids of ``idx`` and the position of each one's last occurrence.

    A stable sort keeps equal ids in call order, so the last of each run is the last write. Peak
    temporaries: about 20 bytes per id (`np.unique(..., return_index=True)` on the reversed ids,
    which this replaces, took about 40)."""
    if not len(idx):
        return idx[:0].copy(), np.zeros(0, np.int64)
    order = np.argsort(idx, kind="stable")
    srt = idx[order]
    last = np.empty(len(srt), bool)
    last[-1] = True
    np.not_equal(srt[1:], srt[:-1], out=last[:-1])
    uniq = srt[last]
    del srt
    return uniq, order[last]


def _with_served(mids: np.ndarray, records: np.ndarray, served: tuple | None,
                 row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``mids`` and their ``records`` joined by the rows ``served`` from warm copies, sorted."""
    if served is None:
        return mids, records
    both = idsets.union(mids, served[0])
    recs = np.empty((len(both), row_bytes), np.uint8)
    recs[np.searchsorted(both, mids)] = records
    recs[np.searchsorted(both, served[0])] = served[1]
    return both, recs
