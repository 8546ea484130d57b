"""Hot tier: uncompressed records in RAM on huge pages, within a byte budget.

Two layouts share one interface. *Resident* (``hot_bytes=None``): slot == id, the whole table is
one flat buffer and a lookup is a single gather. *Cached*: a fixed pool of slots, an id -> slot
map and CLOCK eviction, all vectorised in numpy so a batch costs a handful of array operations.
"""

from __future__ import annotations

import numpy as np
import torch

from . import idsets
from .memory import PageBuffer, private_zeros
from .memory import zeros as plain_zeros

# Per-slot bookkeeping of the cached layout: id (8) + reference bit (1) + dirty (1) + in-flight (1).
SLOT_OVERHEAD = 11


class HotTier:
    """``private``: the rows and bookkeeping of a writable store, which forked children do not
    inherit (`memory.PageBuffer`)."""

    def __init__(self, num_rows: int, row_bytes: int, chunk_rows: int, capacity: int | None, *,
                 private: bool = False) -> None:
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        self.chunk_rows = chunk_rows
        self.resident = capacity is None
        self.capacity = num_rows if capacity is None else int(capacity)
        self.limit = self.capacity  # usable slots (set_budget can lower it without reallocating)
        zeros = private_zeros if private else plain_zeros
        self._zeros = zeros
        self.buffer = PageBuffer(self.capacity * row_bytes, private=private)
        self.pool = self.buffer.tensor(self.capacity, row_bytes)  # uint8 (capacity, row_bytes)
        self.pool_np = self.pool.numpy()
        self.dirty = zeros(self.capacity, np.uint8)
        # Slots marked dirty since the last `dirty_slots` (copies, duplicates and rows cleaned
        # since included: a superset), so that a flush finds its rows at the cost of the rows
        # written, not of a scan of every slot; None past `_log_cap` entries (then a scan).
        self._dirty_log: list[np.ndarray] | None = []
        self._log_rows = 0
        self._log_cap = max(1 << 16, self.capacity // 8)
        self.inflight = zeros(self.capacity, np.bool_)
        # memory mode's steady state (every chunk loaded): lookups and the store's get/update skip
        # all residency checks. Never true for a cache of slots.
        self.all_loaded = False
        self.want: np.ndarray | None = None  # per id: reads still expected in the lookahead window
        if self.resident:
            num_chunks = (num_rows + chunk_rows - 1) // chunk_rows
            self.loaded = zeros(num_chunks, np.bool_)
            # Rows of never-written chunks are made one by one as they are first read (a first
            # touch costs its rows, not its chunks): ``row_ok`` marks them in chunks not loaded
            # whole, ``row_count`` counts them per chunk (a chunk whose every row is made counts
            # as loaded). Allocated on first use.
            self.row_ok: np.ndarray | None = None
            self.row_count: np.ndarray | None = None
        else:
            self.slot_of = zeros(num_rows, np.int32)  # slot + 1; 0 = not resident
            self.id_of = zeros(self.capacity, np.int64)
            self.id_of[:] = -1
            self.ref = zeros(self.capacity, np.uint8)
            # free slots as a stack (the top at the end), taken and given back as whole arrays;
            # 4 bytes a slot (a list of Python ints was ~36)
            self._free = zeros(self.capacity, np.int32)
            self._free[:] = np.arange(self.capacity - 1, -1, -1, dtype=np.int32)
            self._nfree = self.capacity
            self.hand = 0
        self.used = 0

    # ---- dirty rows --------------------------------------------------------------------------
    def mark_dirty(self, slots: np.ndarray) -> None:
        """Rows in ``slots`` changed since they were last written out."""
        self.dirty[slots] = 1
        log = self._dirty_log
        if log is not None:
            n = np.size(slots)
            if self._log_rows + n > self._log_cap:
                self._dirty_log = None
            else:
                log.append(np.array(slots, dtype=np.int64, copy=True).reshape(-1))  # (the caller's array may change)
                self._log_rows += n

    def dirty_slots(self) -> np.ndarray:
        """The dirty slots, sorted: from the log where it holds, else a scan of every slot."""
        log = self._dirty_log
        if log is None:
            got = np.flatnonzero(self.dirty)
        elif not log:
            got = np.empty(0, np.int64)
        else:
            cand = idsets.unique(log[0] if len(log) == 1 else np.concatenate(log))
            got = cand[self.dirty[cand] != 0]
        self.forget_log(got)
        return got

    def forget_log(self, dirty: np.ndarray | None = None) -> None:
        """Start the log again from ``dirty``, every slot dirty now (None: nothing is dirty)."""
        if dirty is None or not len(dirty):
            self._dirty_log, self._log_rows = [], 0
        else:
            self._dirty_log, self._log_rows = [dirty], len(dirty)
            if self._log_rows > self._log_cap:
                self._dirty_log = None

    # ---- lookup ------------------------------------------------------------------------------
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slots of ``ids``; -1 where not resident. Marks hits as recently used."""
        if self.resident:
            if self.all_loaded:
                return ids
            c = ids // self.chunk_rows
            ok = self.loaded[c]
            if self.row_ok is not None and not ok.all():
                ok |= self.row_ok[ids]
            return ids if ok.all() else np.where(ok, ids, -1)
        s = self.slot_of[ids].astype(np.int64) - 1
        hit = s[s >= 0]
        self.ref[hit] = 1
        return s

    def nbytes(self) -> int:
        """Bytes of records held now (what the budget bounds)."""
        if self.resident:
            rows = int(self.loaded.sum()) * self.chunk_rows
            if len(self.loaded) and self.loaded[-1]:  # the last chunk may be short
                rows -= len(self.loaded) * self.chunk_rows - self.num_rows
            if self.row_count is not None:
                rows += int(self.row_count[~self.loaded].sum())
            return rows * self.row_bytes
        return self.used * (self.row_bytes + SLOT_OVERHEAD)

    def budget_bytes(self) -> int:
        return self.limit * (self.row_bytes + (0 if self.resident else SLOT_OVERHEAD))

    # ---- cached layout: allocation and eviction ----------------------------------------------
    def victims(self, n: int, protect: np.ndarray | None = None) -> np.ndarray:
        """Choose ``n`` occupied slots to evict by CLOCK (skipping in-flight and protected).

        With a lookahead window known (`want`), rows a coming batch will read are skipped on a
        first lap: rows needed in the window stay, rows not needed in it go first (Belady's rule
        with "not in the window" as "furthest in the future"). If that finds too few, a second
        lap takes any row, as plain CLOCK does.
        """
        out: list[np.ndarray] = []
        need = n
        for honour_want in ((True, False) if self.want is not None else (False,)):
            scanned = 0
            cap = self.limit
            taken = None  # slots picked on this lap: a scan that wraps past them must not pick them again
            while need > 0 and scanned < 3 * cap:
                w = min(max(4 * need, 1024), cap)
                idx = (np.arange(self.hand, self.hand + w) % cap)
                ids = self.id_of[idx]
                occupied = ids >= 0
                cand = occupied & (self.ref[idx] == 0) & ~self.inflight[idx]
                if honour_want:
                    assert self.want is not None
                    cand &= self.want[np.maximum(ids, 0)] == 0
                if protect is not None and len(protect):
                    cand &= ~idsets.isin(idx, protect)
                if taken is not None:
                    cand &= ~idsets.isin(idx, taken)
                picked = idx[cand][:need]
                # Second chance: clear reference bits of what the hand passed over.
                stop = w if len(picked) < need else int(np.flatnonzero(cand)[need - 1]) + 1
                self.ref[idx[:stop]] = 0
                self.hand = (self.hand + stop) % cap
                scanned += stop
                out.append(picked)
                need -= len(picked)
                if need > 0 and len(picked):
                    taken = picked if taken is None else np.concatenate([taken, picked])
            if need <= 0:
                break
            if out:  # a second lap must not count slots picked on the first
                got = idsets.unique(np.concatenate(out))
                out, need = [got], n - len(got)
                if protect is not None and len(protect):
                    protect = np.concatenate([protect, got])
                else:
                    protect = got
        # A second lap of the hand can meet slots picked on the first: never hand one out twice.
        return idsets.unique(np.concatenate(out)) if out else np.zeros(0, np.int64)

    # ---- lookahead -----------------------------------------------------------------------------
    def expect(self, ids: np.ndarray) -> None:
        """Rows ``ids`` will be read by a coming batch: count them in the window (an id repeated
        in ``ids`` counts once: every copy assigns the same count)."""
        if self.want is None:
            self.want = self._zeros(self.num_rows, np.uint8)  # 1 byte per table row, touched pages only
        w = self.want[ids]
        self.want[ids] = w + (w < 255)

    def consumed(self, ids: np.ndarray) -> np.ndarray | None:
        """A batch read rows ``ids``: each leaves the window once (repeats in ``ids`` too); returns
        which positions of ``ids`` were expected (None without a window)."""
        if self.want is None:
            return None
        w = self.want[ids]
        hinted = w > 0
        self.want[ids] = w - hinted
        return hinted

    def take_free(self, n: int) -> np.ndarray:
        """Up to ``n`` free slots (fewer if fewer are free)."""
        k = min(n, self._nfree)
        self._nfree -= k
        return self._free[self._nfree : self._nfree + k][::-1].astype(np.int64)

    def give_back(self, slots: np.ndarray) -> None:
        """Return ``slots`` (taken by `take_free` or just emptied) to the free stack."""
        k = len(slots)
        self._free[self._nfree : self._nfree + k] = slots[::-1]
        self._nfree += k

    @property
    def free_count(self) -> int:
        return self._nfree

    def install(self, ids: np.ndarray, slots: np.ndarray, records: np.ndarray | torch.Tensor | None) -> None:
        """Rows ``ids`` now live in ``slots``, holding ``records``; None: the caller writes every
        byte of those slots next, under the same lock (a write of whole records)."""
        if records is not None:
            self.pool_np[slots] = records
        self.slot_of[ids] = (slots + 1).astype(np.int32)
        self.id_of[slots] = ids
        self.ref[slots] = 1
        self.used += len(slots)

    def drop(self, slots: np.ndarray) -> None:
        """Forget the rows in ``slots`` (already written back if dirty)."""
        ids = self.id_of[slots]
        self.slot_of[ids] = 0
        self.id_of[slots] = -1
        self.dirty[slots] = 0
        self.ref[slots] = 0
        self.give_back(slots)
        self.used -= len(slots)

    def set_limit(self, slots: int) -> None:
        """Usable slot count (<= capacity); the caller has already emptied slots >= slots."""
        self.limit = max(1, min(int(slots), self.capacity))
        free = self._free[: self._nfree]
        free = free[free < self.limit]
        self._nfree = len(free)
        self._free[: self._nfree] = free
        if self.hand >= self.limit:
            self.hand = 0
        self.buffer.release(self.limit * self.row_bytes, (self.capacity - self.limit) * self.row_bytes)

    def grow_limit(self, slots: int) -> None:
        old = self.limit
        self.limit = max(1, min(int(slots), self.capacity))
        self.give_back(np.arange(self.limit - 1, old - 1, -1, dtype=np.int64)[::-1])

    # ---- resident layout ---------------------------------------------------------------------
    def chunk_range(self, chunk: int) -> tuple[int, int]:
        lo = chunk * self.chunk_rows
        return lo, min(lo + self.chunk_rows, self.num_rows)

    def mark_rows(self, ids: np.ndarray) -> None:
        """Rows ``ids`` (sorted, unique, of chunks not loaded) now hold their values in the pool."""
        if self.row_ok is None:
            self.row_ok = self._zeros(self.num_rows, np.bool_)
            self.row_count = self._zeros(len(self.loaded), np.int64)
        assert self.row_count is not None
        self.row_ok[ids] = True
        chunks, counts = np.unique(ids // self.chunk_rows, return_counts=True)
        self.row_count[chunks] += counts
        sizes = np.minimum(self.chunk_rows, self.num_rows - chunks * self.chunk_rows)
        whole = chunks[self.row_count[chunks] >= sizes]
        if len(whole):
            self.loaded[whole] = True

    def fill_chunk(self, chunk: int, records: np.ndarray) -> None:
        """Load ``chunk`` whole from ``records`` (its rows as stored below), keeping the rows
        already made in the pool one by one (they may have changed since)."""
        lo, hi = self.chunk_range(chunk)
        if self.row_ok is not None and self.row_ok[lo:hi].any():
            keep = self.row_ok[lo:hi]
            self.pool_np[lo:hi][~keep] = records[~keep]
        else:
            self.pool_np[lo:hi] = records
        self.loaded[chunk] = True

    def unload_chunk(self, chunk: int) -> None:
        lo, hi = self.chunk_range(chunk)
        if self.row_ok is not None:
            assert self.row_count is not None
            self.row_ok[lo:hi] = False
            self.row_count[chunk] = 0
        self.loaded[chunk] = False
        self.all_loaded = False
        self.dirty[lo:hi] = 0
        self.buffer.release(lo * self.row_bytes, (hi - lo) * self.row_bytes)

    def close(self) -> None:
        self.pool = None  # type: ignore[assignment]
        self.pool_np = None  # type: ignore[assignment]
        self.buffer.close()
