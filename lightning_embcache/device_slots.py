"""Which device slot holds which row, and which slots to free next: the device tier's host
bookkeeping, in numpy, with no device in sight (so it is tested on any machine).

Eviction follows the announced future where there is one: rows a coming batch reads (announced
by `LookaheadSampler` through `announce`) are never chosen while a row no announced batch reads
can go. Among the rest every row's next use lies beyond the window, so all are equal to Belady's
rule; CLOCK (a reference bit per slot, a hand sweeping slices of the slot arrays) breaks the tie in
favour of rows used recently. Every operation costs the batch, never the table: the hand sweeps a
window of a few times the rows it needs.
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import NamedTuple

import numpy as np

from lightning_embcache.native import library as native_lib
from lightning_embcache.store import idsets
from lightning_embcache.store.memory import private_zeros

#: announced batches kept at most: a window whose batches are never looked up (ids mapped
#: elsewhere by the step) stops protecting rows after this many
MAX_WINDOW = 64


_NONE = np.empty(0, np.int64)


class Plan(NamedTuple):
    """What `SlotMap.plan` did: the swap kernel's index array (``k`` slots, then ``k`` host rows
    to write out or -1, then the ``k`` rows to load), the victims, their ids and which of them
    were dirty."""

    idx: np.ndarray
    victims: np.ndarray
    victim_ids: np.ndarray
    dirty: np.ndarray


class TooFewSlots(Exception):
    """Fewer evictable slots than a call needs (every other slot is kept); nothing changed."""

    def __init__(self, kept: int, needed: int) -> None:
        super().__init__(f"{kept} slots kept, {needed} more needed")
        self.kept, self.needed = kept, needed


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]  # type: ignore[no-any-return]  # cheaper than a.ctypes


def _ids(a: np.ndarray) -> np.ndarray:
    """``a`` as a contiguous int64 array (the C loops' element type), copied only where it is not."""
    return np.ascontiguousarray(a, dtype=np.int64)


class SlotMap:
    """``capacity`` device slots over ``num_rows`` ids. Host memory: 4 bytes per table row (where
    each id sits) plus 4 more once a future is announced (its uses still to come), and 27 bytes
    per slot.

    ``native``: run the loops in C (`lightning_embcache.native`, the interpreter lock released)
    where they are built; False: numpy only. Both give the same slots and victims."""

    def __init__(self, num_rows: int, capacity: int, *, native: bool = True) -> None:
        self._c = native_lib() if native else None
        self.num_rows, self.capacity = num_rows, capacity
        # private: not shared with forked DataLoader workers (each page written after a fork
        # would be copied and kept twice)
        self.slot_of = private_zeros(num_rows, np.int32)  # slot + 1; 0 = not on the device
        self.id_of = private_zeros(capacity, np.int64)
        self.id_of[:] = -1
        # one more than the slots: `find` sets the bit of every position, misses (-1) on the last
        self.ref = private_zeros(capacity + 1, np.uint8)
        self._free = private_zeros(capacity, np.int64)
        self._free[:] = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self.nfree = capacity
        #: bumped whenever a row gets or leaves a slot: slots worked out ahead are valid while it stays
        self.moves = 0
        self._hand = 0
        self._stamp = private_zeros(capacity, np.int64)  # == _stamp_id: kept by the current call
        self._stamp_id = 0
        self.want: np.ndarray | None = None  # per id: announced uses still to come
        self._window: deque[np.ndarray] = deque()
        self._raw: deque[np.ndarray] = deque()  # each announced batch's ids as given (a cheap `consume` match)
        self.window_rows = 0  # distinct rows of the announced batches (summed per batch)
        self._hand_c = ctypes.c_int64(0)  # the hand, for the C sweep
        # the map's own arrays never move: their addresses once, not per call
        self._p_slot_of, self._p_id_of = _ptr(self.slot_of), _ptr(self.id_of)
        self._p_ref, self._p_stamp = _ptr(self.ref), _ptr(self._stamp)
        self._p_want = 0

    def _fail(self, what: str) -> None:
        raise IndexError(f"SlotMap.{what}: an id or slot out of range ({self.num_rows} rows, {self.capacity} slots)")

    # ------------------------------------------------------------------ where rows are
    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each of ``ids`` (int64), -1 where not on the device; hits get their reference bit."""
        if self._c is not None:
            ids = _ids(ids)
            out = np.empty(len(ids), np.int64)
            if self._c.em_find(self._p_slot_of, self.num_rows, _ptr(ids), len(ids), self._p_ref, _ptr(out)) < 0:
                self._fail("find")
            return out
        s = self.slot_of[ids].astype(np.int64)
        s -= 1
        self.ref[s] = 1  # a miss (-1) sets the spare last bit, which no slot reads
        return s

    def take(self, k: int) -> np.ndarray:
        """``k`` free slots (the caller has made room: ``k <= nfree``)."""
        got = self._free[self.nfree - k : self.nfree].copy()
        self.nfree -= k
        return got

    def replace(self, victims: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Put rows ``ids`` (not held) in free slots, then in ``victims`` (held slots whose rows
        leave), and return their slots: the same as `release`, `take` and `assign` with fewer
        passes over the batch (the victims never pass through the free list)."""
        got = self.slots_for(victims, len(ids))
        self.moves += 1
        if self._c is not None:
            victims, ids = _ids(victims), _ids(ids)
            if self._c.em_replace(self._p_slot_of, self.num_rows, self._p_id_of, self._p_ref, self.capacity,
                                  _ptr(victims), len(victims), _ptr(got), _ptr(ids), len(ids)) < 0:
                self._fail("replace")
            self.nfree -= len(ids) - len(victims)
            return got
        self.nfree -= len(ids) - len(victims)
        self.slot_of[self.id_of[victims]] = 0
        self.assign(got, ids)
        return got

    def slots_for(self, victims: np.ndarray, k: int) -> np.ndarray:
        """The slots `replace` gives ``k`` rows with ``victims`` (nothing changes): the free
        list's last ``k - len(victims)``, then the victims."""
        free = self._free[self.nfree - (k - len(victims)) : self.nfree]
        return np.concatenate([free, victims]) if len(victims) else free.copy()

    def plan(self, ids: np.ndarray, keep: np.ndarray | None, dirty: np.ndarray) -> Plan | None:
        """Bring sorted unique ``ids`` in: find them, choose victims for the misses beyond the
        free slots (never a hit or a slot in ``keep``; `victims`' rule), re-map, clear the
        victims' ``dirty`` flags (a bool per slot, the caller's), and return the swap kernel's
        index array; None where every row is here already. The same as `find`, `victims` and
        `replace` in a row, in one C call where the loops are built. Raises `TooFewSlots`
        (only the hand, reference bits and stamps changed)."""
        keep = _NONE if keep is None else keep
        self.moves += 1
        if self._c is None:
            return self._plan_numpy(ids, keep, dirty)
        ids, keep = _ids(ids), _ids(keep)
        n = len(ids)
        mids, hits, idx = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(3 * n, np.int64)
        victims, vids, vdirty = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.uint8)
        counts = np.empty(1, np.int64)
        sid, nfree = ctypes.c_int64(self._stamp_id), ctypes.c_int64(self.nfree)
        self._hand_c.value = self._hand
        want = self._p_want if self.want is not None and self.window_rows else None
        k = self._c.em_plan(self._p_slot_of, self.num_rows, self._p_id_of, self._p_ref, self._p_stamp,
                            ctypes.byref(sid), want, self.capacity, ctypes.byref(self._hand_c), _ptr(self._free),
                            ctypes.byref(nfree), _ptr(dirty), _ptr(ids), n, _ptr(keep), len(keep), _ptr(mids),
                            _ptr(hits), _ptr(idx), _ptr(victims), _ptr(vids), _ptr(vdirty), _ptr(counts))
        self._hand, self._stamp_id, self.nfree = self._hand_c.value, sid.value, nfree.value
        if k == -1:
            self._fail("plan")
        if k == -2:  # as `victims` says it: the slots kept, the victims needed
            held = self.slot_of[ids].astype(np.int64) - 1
            kept = np.concatenate([held[held >= 0], keep])
            raise TooFewSlots(len(idsets.unique(kept)) if len(kept) else 0, int((held < 0).sum()) - self.nfree)
        if k == 0:
            return None
        nv = int(counts[0])
        return Plan(idx[: 3 * k], victims[:nv], vids[:nv], vdirty[:nv].view(np.bool_))

    def _plan_numpy(self, ids: np.ndarray, keep: np.ndarray, dirty: np.ndarray) -> Plan | None:
        s = self.find(ids)
        miss = s < 0
        if not miss.any():
            return None
        mids = ids[miss]
        k = len(mids)
        victims = self.victims(k - self.nfree, np.concatenate([s[~miss], keep])) if k > self.nfree else _NONE
        vdirty = dirty[victims]
        vids = self.id_of[victims]
        got = self.replace(victims, mids)
        dirty[victims] = False
        idx = np.concatenate([got, np.full(k - len(victims), -1, np.int64), np.where(vdirty, vids, -1), mids])
        return Plan(idx, victims, vids, vdirty)

    def assign(self, slots: np.ndarray, ids: np.ndarray) -> None:
        self.moves += 1
        self.id_of[slots] = ids
        self.slot_of[ids] = (slots + 1).astype(np.int32)
        self.ref[slots] = 1

    def release(self, slots: np.ndarray) -> None:
        """Give ``slots`` back (their rows leave the device)."""
        self.moves += 1
        self.slot_of[self.id_of[slots]] = 0
        self.id_of[slots] = -1
        self.ref[slots] = 0
        self._free[self.nfree : self.nfree + len(slots)] = slots
        self.nfree += len(slots)

    @property
    def used(self) -> int:
        return self.capacity - self.nfree

    # ------------------------------------------------------------------ the announced future
    def announce(self, ids: np.ndarray, unique: np.ndarray | None = None) -> np.ndarray:
        """A coming batch reads ``ids``: protect them until it is looked up (`consume`); returns
        them unique and sorted (``unique``: already computed by the caller)."""
        u = idsets.unique(ids) if unique is None else unique
        if self.want is None:
            self.want = private_zeros(self.num_rows, np.int32)
            self._p_want = _ptr(self.want)
        if len(self._window) == MAX_WINDOW:
            self._forget()
        self._add_want(u, 1)
        self._window.append(u)
        self._raw.append(ids.copy())
        self.window_rows += len(u)
        return u

    def consume(self, ids: np.ndarray) -> bool:
        """A batch was looked up: if it is the oldest announced one, its rows stop being protected."""
        if not self._window:
            return False
        oldest, raw = self._window[0], self._raw[0]
        same = len(ids) == len(raw) and np.array_equal(ids, raw)  # the batch as announced: no sort
        if not same and (len(ids) < len(oldest) or not np.array_equal(idsets.unique(ids), oldest)):
            return False
        self._forget()
        return True

    def oldest_announced(self) -> np.ndarray | None:
        """The ids (as announced) of the batch looked up next, if any is announced."""
        return self._raw[0] if self._raw else None

    def announced(self, batch: np.ndarray) -> bool:
        """Whether ``batch`` (an array `announce` returned) is still in the window."""
        return any(u is batch for u in self._window)

    def _forget(self) -> None:
        self._raw.popleft()
        u = self._window.popleft()
        self._add_want(u, -1)
        self.window_rows -= len(u)

    def _add_want(self, u: np.ndarray, delta: int) -> None:
        """One more (or one fewer) announced use of each of the distinct ids ``u``."""
        assert self.want is not None
        if self._c is not None:
            u = _ids(u)
            if self._c.em_want(self._p_want, self.num_rows, _ptr(u), len(u), delta) < 0:
                self._fail("announce")
        else:
            self.want[u] += delta

    def clear_window(self) -> None:
        while self._window:
            self._forget()

    # ------------------------------------------------------------------ eviction
    def victims(self, k: int, keep: np.ndarray) -> np.ndarray:
        """Choose ``k`` occupied slots to free, none in ``keep`` (slots in use by this step), and
        none whose row an announced batch reads while another can go. Only the hand, reference
        bits and stamps change; raises `TooFewSlots` (and changes nothing chosen) if fewer than
        ``k`` slots may go."""
        self._stamp_id += 1
        if self._c is not None:
            keep = _ids(keep)
            if self._c.em_stamp(self._p_stamp, self.capacity, _ptr(keep), len(keep), self._stamp_id) < 0:
                self._fail("victims")
        else:
            self._stamp[keep] = self._stamp_id  # duplicates welcome: no unique() of the batch
        picked: list[np.ndarray] = []
        try:
            if self.want is not None and self.window_rows:
                need = self._sweep(k, picked, spare_wanted=True, limit=2 * self.capacity)
            else:
                need = k
            if need:
                self._sweep(need, picked, spare_wanted=False, limit=2 * self.capacity)
        except TooFewSlots:
            for v in picked:
                self._stamp[v] = 0
            raise TooFewSlots(len(idsets.unique(keep)) if len(keep) else 0, k) from None
        return np.concatenate(picked) if picked else np.empty(0, np.int64)

    def _sweep(self, need: int, picked: list[np.ndarray], *, spare_wanted: bool, limit: int) -> int:
        """Move the hand until ``need`` slots are picked or ``limit`` slots were passed; returns
        how many are still needed (raises `TooFewSlots` if any are, when not sparing wanted rows)."""
        if self._c is not None:
            return self._sweep_c(need, picked, spare_wanted=spare_wanted, limit=limit)
        cap, swept = self.capacity, 0
        while need and swept <= limit:
            lo = self._hand
            hi = min(cap, lo + max(4 * need, 4096))
            ids = self.id_of[lo:hi]
            ok = (ids >= 0) & (self._stamp[lo:hi] != self._stamp_id)
            if spare_wanted:
                assert self.want is not None
                ok &= self.want[np.maximum(ids, 0)] == 0
            cold = np.flatnonzero(ok & (self.ref[lo:hi] == 0))
            if len(cold) >= need:
                end = int(cold[need - 1]) + 1
                cold = cold[:need]
            else:
                end = hi - lo
            self.ref[lo : lo + end] = 0  # the hand passed them: their second chance is used
            cold += lo
            self._stamp[cold] = self._stamp_id  # chosen: a later window must not pick them again
            picked.append(cold)
            need -= len(cold)
            self._hand = (lo + end) % cap
            swept += end
        if need and not spare_wanted:
            raise TooFewSlots(0, need)
        return need

    def _sweep_c(self, need: int, picked: list[np.ndarray], *, spare_wanted: bool, limit: int) -> int:
        assert self._c is not None
        out = np.empty(need, np.int64)
        self._hand_c.value = self._hand
        want = self._p_want if spare_wanted and self.want is not None else None
        got = self._c.em_sweep(self._p_id_of, self._p_ref, self._p_stamp, self._stamp_id, want,
                               self.capacity, ctypes.byref(self._hand_c), need, limit, _ptr(out))
        self._hand = self._hand_c.value
        picked.append(out[:got])
        need -= got
        if need and not spare_wanted:
            raise TooFewSlots(0, need)
        return need
