"""Write-back and eviction: room in the hot tier, and dirty rows written below it.

`WriteBack` belongs to `Tiers`. It makes room in the hot tier (CLOCK eviction, `evict`,
`set_budget`), writes dirty rows to pending segments (an eviction's write-back, the background
`clean`, the write-back of a flush through `begin_write_back`/`end_write_back`, a write too large
for the hot tier: `write_around`) and keeps the warm copies of their chunks exact (`patch_warm`).
It is what `Versions` sees as a `versions.WriteBack`; it sees the tiers as `Written` (held weakly:
they hold this). Methods assume the caller holds ``core.lock`` where they say so.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from . import idsets
from .core import StoreCore
from .errors import StoreBusyError, StoreClosedError
from .hot import SLOT_OVERHEAD, HotTier
from .memory import SLICE_ROWS
from .rowcopy import to_np
from .snapshot import Snapshot
from .validate import budget
from .warm import WarmTier

if TYPE_CHECKING:
    from .readahead import ReadAhead
    from .tiers import Layout

# One write-back or flush patches the warm copies of at most this many bytes of chunks (the rest
# of the warm chunks it touches are dropped): in random order a write-back touches every chunk held.
PATCH_BYTES = 32 << 20


class Written(Protocol):
    """What the write-back asks of `Tiers`: the tiers and their field views, the copy-on-write
    records of a write-back in progress, the hot budget, and the read path's records below."""

    hot: HotTier
    warm: WarmTier
    np_views: dict[str, np.ndarray]
    cow: dict[int, np.ndarray] | None
    hot_budget: int | None
    readahead: ReadAhead

    def save_cow(self, slots: np.ndarray) -> None: ...

    def await_device_writes(self) -> None: ...

    def fetch(self, ids: np.ndarray, whole_rows: bool = False) -> Any: ...


class WriteBack:
    """The write-back and eviction of a store's tiers (see the module docstring)."""

    def __init__(self, core: StoreCore, layout: Layout, tiers: Written) -> None:
        self._c = core
        self._v = layout
        self._tiers = weakref.ref(tiers)  # (they hold this)
        self._t = cast(Written, weakref.proxy(tiers))

    # ------------------------------------------------------------------ what Versions asks
    def dirty_count(self) -> int:
        """Rows written since they were last written out (caller holds the lock)."""
        return len(self._t.hot.dirty_slots())

    def dirty_slots(self) -> np.ndarray:
        """The hot slots of those rows (caller holds the lock)."""
        return self._t.hot.dirty_slots()

    def forget_dirty(self) -> bool:
        """A store with no files "flushes" by forgetting which rows changed; whether any had."""
        hot = self._t.hot
        if not hot.dirty.any():
            return False
        hot.dirty[:] = 0
        hot.forget_log()
        return True

    def resident(self) -> bool:
        """Whether the whole table lives in the pool (memory mode)."""
        return bool(self._t.hot.resident)

    # ------------------------------------------------------------------ eviction
    def allocate(self, n: int, protect: np.ndarray | None = None) -> np.ndarray:
        """n free slots, evicting (and writing back) cold rows by CLOCK as needed."""
        hot = self._t.hot
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
        hot = self._t.hot
        d = slots[hot.dirty[slots] != 0]
        if len(d):
            self._write_back(hot.id_of[d], hot.pool_np[d])
        self._c.stats.evicted_bytes += len(slots) * self._c.row_bytes
        hot.drop(slots)

    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` of hot and warm memory (dirty rows written back first)."""
        nbytes = cast(int, budget(nbytes, "nbytes", allow_none=False))
        freed = 0
        with self._c.lock:
            if self._c.closed:
                raise StoreClosedError("this EmbeddingStore was closed during evict()")
            freed += self._t.warm.shrink(max(0, self._t.warm.nbytes - nbytes))
            if freed >= nbytes or self._v.disk is None:
                return freed
            hot = self._t.hot
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
                loader = self._t.readahead.loader
                if loader is not None:  # reads ahead land in the slab the new budget replaces
                    loader.cancel()
                warm = self._t.warm
                warm.budget = cast(int, budget(warm_bytes, "warm_bytes", allow_none=False))
                warm.shrink(warm.budget)
            if hot_bytes is None:
                return
            hot_bytes = cast(int, budget(hot_bytes, "hot_bytes", allow_none=False))
            hot = self._t.hot
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
            self._t.hot_budget = hot_bytes

    # ------------------------------------------------------------------ writing rows below
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
        warm = self._t.warm
        if not len(warm) or not len(ids):
            return
        cr = self._c.chunk_rows
        chunks = ids // cr
        held = idsets.isin(chunks, warm.chunks(), b_sorted_unique=True)
        if not held.any():
            return
        ids, chunks = ids[held], chunks[held]
        hot = self._t.hot
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
        tiers = self._tiers()  # held while it runs (the background job holds only this part)
        if tiers is None:
            return
        with self._v.flush_lock:
            with self._c.lock:
                self._v.clean_due = False
                hot = self._t.hot
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
        hot = self._t.hot
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
            hot = self._t.hot
            if not ok:
                hot.mark_dirty(slots)
            hot.inflight[slots] = False
            self._t.cow = None
            self._v.end_segment(seq)

    def _snapshot_reader(self, slots: np.ndarray) -> Snapshot:
        """Start a copy-on-write snapshot of ``slots`` (caller holds the lock and marks them
        in flight): their records as they are now, read later in blocks (snapshot.py)."""
        tiers = self._t
        tiers.await_device_writes()  # rows a device is still writing are read whole
        cow: dict[int, np.ndarray] = {}
        tiers.cow = cow
        hot = tiers.hot
        return Snapshot(self._c.lock, lambda: hot.pool_np, slots, cow)

    def write_around(self, idx, mids, values, load: bool) -> None:
        """A write too large for the hot tier (or larger than one slice): staged, then applied.

        Every row of the call, merged with its stored record where fields are missing, is written
        as one pending segment (streamed in blocks: bounded temporaries); only once that file is
        whole are resident copies updated in place. A write that fails (full disk, permissions)
        therefore leaves no row of the call applied. Caller holds the lock.
        """
        tiers = self._t
        hot = tiers.hot
        uniq, pos = _last_of_each(idx)  # of duplicate ids the last wins

        def records(a: int, b: int) -> np.ndarray:
            ids = uniq[a:b]
            recs = np.zeros((len(ids), self._c.row_bytes), np.uint8)
            slots = hot.lookup(ids)
            res = slots >= 0
            if res.any():
                recs[res] = hot.pool_np[slots[res]]
            if load and not res.all():
                recs[~res] = tiers.fetch(ids[~res])
            rec_t = torch.from_numpy(recs)
            p = torch.from_numpy(pos[a:b])
            for n, v in values.items():
                self._c.schema.view(rec_t, n)[:] = v[p]
            return recs

        disk = self._v.disk
        assert disk is not None, "a store without files has no disk"
        seq = self._v.take_seq()
        # a write that fails raises here, with nothing applied
        self._add_pending(disk.write_segment(seq, uniq, records, durable=False))
        # Resident copies take the write too (the hot tier is read first); they stay dirty. In
        # call order, a slice at a time: of duplicate ids the last still wins, temporaries stay small.
        for a in range(0, len(idx), SLICE_ROWS):
            slots = hot.lookup(idx[a : a + SLICE_ROWS])
            res = slots >= 0
            if res.any():
                if tiers.cow is not None:
                    tiers.save_cow(slots[res])
                at = torch.from_numpy(np.flatnonzero(res) + a)
                for n, v in values.items():
                    tiers.np_views[n][slots[res]] = to_np(v[at])
                hot.mark_dirty(slots[res])


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
