"""Tier mechanics of EmbeddingStore: filling the hot tier from warm/disk (the read path).

`Tiers` is the component of `EmbeddingStore` that owns the hot and warm tiers and moves rows
between them and the files below. It sees the store's `Versions` only as a `Layout` (where rows
live, the writer lock, the segments its write-back adds: the whole surface, checked by mypy);
`Versions` sees its write-back part (writeback.py) only as a `versions.WriteBack`. Methods
assume the caller holds ``core.lock`` where they say so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from . import idsets, rowcopy
from .chunkrows import DENSE_ROWS, ChunkRows
from .core import StoreCore
from .disk import Disk
from .errors import CorruptStoreError
from .fill import Filler
from .hot import HotTier
from .mappedget import NativeGet
from .memory import SLICE_ROWS, zeros
from .prefetch import Prefetcher
from .readahead import ReadAhead
from .rowcopy import np_dtype, to_np
from .rowindex import gather_deltas
from .warm import WarmTier
from .writeback import WriteBack

if TYPE_CHECKING:
    from .disk import Segment
    from .rowindex import RowIndex

#: a get that misses rows when the hot tier is full evicts others to install them (True), or
#: serves the rows it cannot install in free slots without a slot (False: see `_resolve_rows`)
GETS_EVICT = False


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
    """The hot and warm tiers over the store's files: reads that fill them; eviction and
    write-back are its part ``writeback``.

    Holds the shared `StoreCore` and the store's `Versions` seen as a `Layout` (what it reads
    and appends pending segments to), never the `EmbeddingStore` itself."""

    def __init__(self, core: StoreCore, layout: Layout, hot: HotTier, warm: WarmTier,
                 hot_budget: int | None) -> None:
        self._c = core
        self._v = layout
        self.hot = hot
        self.warm = warm
        self.hot_budget = hot_budget
        # snapshot records of a write-back in progress (`WriteBack.begin_write_back`): a write
        # over a row still being written out keeps its record here first (`save_cow`)
        self.cow: dict[int, np.ndarray] | None = None
        # the newest device write into the table still running (`EmbeddingStore._device_write`):
        # anything with `synchronize()`; host reads of the table wait for it first
        self.device_pending: Any = None
        #: memory mode's first touch makes only the rows read (True) or whole chunks (False);
        #: None: `ROWS_ON_FIRST_TOUCH`. A table the GPU trains in place sets it (`HostMappedTier`).
        self.rows_on_first_touch: bool | None = None
        # the prefetch thread (prefetch.py), lookahead hints and reads ahead (readahead.py), memory
        # mode's making of never-written chunks (fill.py), eviction and write-back (writeback.py);
        # each holds these tiers weakly
        self.writeback = WriteBack(core, layout, self)
        self.prefetch = Prefetcher(core, layout, self)
        self.readahead = ReadAhead(core, layout, self, self.prefetch)
        self.fill = Filler(core, layout, self)
        self.native_get = NativeGet(self)  # `_mapped_get`'s work in one C loop, where it is built
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

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Free the tiers (caller holds both locks, every thread stopped)."""
        if self.readahead.loader is not None:
            self.readahead.loader.close()
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

    def _direct_records(self, idx, slots, mids, records, out=None) -> np.ndarray:
        """Whole records of ``idx``: hot rows from their slots, the others from ``records`` of
        ``mids``; into ``out`` where given (the caller's buffer: no second copy)."""
        hit = np.flatnonzero(slots >= 0)
        # One gather into a new array, then the (few) hot rows over it: filling an empty array
        # through a mask pages in a fresh buffer each call.
        at = np.searchsorted(mids, idx)
        if len(hit):
            at[hit] = 0
        rec = records.take(at, axis=0, out=out, mode="clip")  # (valid positions: "clip" is unbuffered)
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
            return self._direct_records(idx, got.slots, got.mids, got.records, out)
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
        self.hot.mark_dirty(slots)

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
        self.hot.mark_dirty(slots)

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
            self.readahead.follow_window(idx, slots, asked if slab is None else asked & ~missing, for_write)
        if slab is not None:
            return FromSlab(slots, *slab)
        if not n_miss:
            return slots
        mids = idsets.unique(idx[missing])
        if len(mids) > hot.limit or (for_write and len(mids) > hot.limit // 2):
            if for_write:
                self.writeback.write_around(idx, mids, values or {}, load)
                return None
        if len(mids) > hot.limit and not for_write:
            return Direct(slots, mids, self.fetch(mids))
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
        if self.prefetch.fetching is not None and not for_write and missing.any():
            if self.prefetch.await_rows(idx[missing]) is not None:
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
        if rows is None and self.readahead.loader is not None and len(self.readahead.loader):
            self.readahead.adopt_loads(idsets.unique(chunks))  # chunks being read ahead: wait for them
            rows = self.warm.rows_of(chunks, ids - chunks * cr)
        return None if rows is None else (where, rows)

    def _fill_misses(self, idx: np.ndarray, slots: np.ndarray, missing: np.ndarray, mids: np.ndarray, *,
                     load: bool, for_write: bool, values: dict[str, torch.Tensor] | None) -> Resolved:
        """Read the missing rows ``mids`` (with announced ones of coming batches) and install them
        in hot slots, evicting as needed; or serve a get without slots where that is cheaper."""
        hot = self.hot
        ahead = self.readahead.hints_to_read(mids) if load and not for_write and self.readahead.hinted else None
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
        got = self.writeback.allocate(len(mids), protect=slots[~missing])
        if len(got) < len(mids):
            # No room even after eviction (everything in flight or in use by this call).
            hot.give_back(got)
            if for_write:
                self.writeback.write_around(idx, mids, values or {}, load)
                return None
            # the rows served from warm copies join the direct read
            return Direct(slots, *_with_served(mids, records, served, self._c.row_bytes))
        hot.install(mids, got, records)
        slots = hot.slot_of[idx].astype(np.int64) - 1
        if ahead is not None and len(ahead):
            room = self.writeback.allocate(len(ahead), protect=slots)
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
            records, warm = self.fetch(mids, whole_rows=True)
            return records, warm, None, None
        # this miss reads the announced rows of coming batches with its own
        both = idsets.union(mids, ahead)
        records, warm = self.fetch(both, whole_rows=True)
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
        costs a slot's memory (the budget) and the copy in. Rows that take the general path (rows
        in delta segments; without the C loop first reads of a chunk) are installed as before."""
        warm = self.warm
        ahead = self.readahead
        return (not GETS_EVICT and self.hot.want is None and self.prefetch.fetching is None and not ahead.hinted
                and warm.slab is None and not warm.budget and not len(warm) and self._v.chunkrows_reader() is not None
                and (ahead.loader is None or not len(ahead.loader)))

    def _mapped_get(self, idx: np.ndarray) -> Gathered | np.ndarray | None:
        """The steady state of a get over a page-cached table (`_plain_below`): every row not
        hot from its base chunk file (no delta record), mapped and verified whole, in one gather
        in the call's order, hot rows then copied over theirs: no plan, no sort, no slot. Hot
        slots if every row is hot; None (nothing done, nothing counted) if any row needs the
        general path. A handful of array operations a batch, whatever the table: this is what a
        get costs over memmap. With the C helpers (mappedget.py) one loop does it, and verifies
        blocks read for the first time itself; this numpy code is its reference."""
        if len(idx) and self.native_get.ready():  # (an empty call: the numpy path)
            recs = self.native_get(idx)
            return None if recs is None else Gathered(recs)
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
        self.readahead.note_read(took, n_miss)
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

    def load_chunk_resident(self, chunk: int) -> None:
        t0 = time.perf_counter()
        self.hot.fill_chunk(chunk, self._below(chunk))
        self._c.stats.stall_seconds += time.perf_counter() - t0

    # ---- the miss path: one plan per batch, vectorised reads ----------------------------------
    def fetch(self, ids: np.ndarray, whole_rows: bool = False):
        """Records of sorted unique ``ids`` from the warm tier or disk. Caller holds the lock.

        ``whole_rows``: return (records, which rows came from chunks held whole: a warm copy, or
        a chunk read whole just now and kept warm, so that a later read finds it there too)."""
        t0 = time.perf_counter()
        if self.readahead.loader is not None and len(self.readahead.loader):
            # what was read ahead is taken in (the plan finds it warm), without waiting: chunks
            # still in flight that this get needs were waited for in `resolve`; others (rows
            # read around the hot tier) are read here as usual
            self.readahead.adopt_loads()
        self.warm.pin()  # the plan's warm copies stay put until read
        try:
            plan = self.plan_below(ids)
            records, whole = self.read_below(plan)
        finally:
            self.warm.unpin()
        self._c.stats.cold_reads += self.chunks_read(plan)
        took = time.perf_counter() - t0
        self._c.stats.stall_seconds += took
        self.readahead.note_read(took, len(ids))
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

    def moved_since(self, plan: tuple) -> np.ndarray:
        """For each row of a `plan_below` plan: has its newest record below the hot tier moved
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

    def will_need(self, plan: tuple) -> None:
        """Before a prefetch reads its base-chunk rows one run at a time, ask the kernel for all
        their blocks at once (``posix_fadvise(WILLNEED)`` starts the reads and returns): a cold
        batch then waits about one disk latency, not one per row."""
        ids, chunks, seg, _, gens, _, _ = plan
        base = (seg < 0) & (gens > 0)
        if self._v.chunkrows is not None and np.count_nonzero(base) > 1:
            c = chunks[base]
            self._v.chunkrows.will_need(c, ids[base] - c * self._c.chunk_rows, gens[base])

    @staticmethod
    def chunks_read(plan: tuple) -> int:
        """Chunks a plan reads below the hot tier (the ``cold_reads`` count): every chunk of its
        rows except those served by a warm copy."""
        chunks, whole = plan[1], plan[6]
        if not len(chunks):
            return 0
        n = 1 + int(np.count_nonzero(chunks[1:] != chunks[:-1]))
        return n - sum(1 for w in whole if w[3] is not None)

    def plan_below(self, ids: np.ndarray) -> tuple:
        """Where the records of sorted unique ``ids`` live below the hot tier (caller holds the lock).

        One lookup in the row index finds every id's newest delta record; the rest come from base
        chunks (generation from the chunk map) or are never written. Chunks the warm tier holds,
        and chunks most of whose rows are wanted when there is a warm tier to keep them in, are
        read whole. The plan names only files whose bytes it reads never change (a delta record
        it names is punched only after every read planned before its round ended: holes.py), so
        `read_below` runs without the lock.
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

    def read_below(self, plan: tuple, mapped: bool = True) -> tuple[np.ndarray, list]:
        """Run a `plan_below` plan: (records of its ids, [(chunk, records)] read whole).

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
                    cached = self.read_chunk_below(c, *layout)
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

    def read_chunk_below(self, chunk: int, gen: int, delta: tuple | None) -> np.ndarray:
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
        recs = self.read_chunk_below(chunk, *self._v.layout_of(chunk))
        self._c.stats.cold_reads += 1
        if self.warm.budget:
            self.warm.put(chunk, recs)
        return recs

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
