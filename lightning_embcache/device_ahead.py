"""Rows brought to the device tier before their lookup asks for them: the next batch's
(`DeviceTier.prefetch`) and the batches `LookaheadSampler` announces (`DeviceTier.upcoming`).

One background thread does the host half of each step's staging: it announces the queued
batches (their rows are then spared by eviction), finds their rows, chooses slots and victims
and re-maps them (`SlotMap.plan`, one C call that releases the interpreter lock), and works out
the slot of every id of the next batch. It makes no CUDA call: CUDA calls from two threads at
once contend inside the driver and cost both threads host time. The thread that next reads the
rows (`join`) queues the swap kernel and uploads its index array together with the next batch's
slots, so that lookup needs neither a search of the map nor an upload of its own.

What the training thread pays per step is then a wait for a job that normally ended long ago,
one upload and one kernel launch; everything that scales with the batch runs beside the step.
"""

from __future__ import annotations

import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

import lightning_embcache.mapped_swap as mapped_swap
from lightning_embcache.device_slots import Plan, TooFewSlots
from lightning_embcache.store import idsets

if TYPE_CHECKING:
    from lightning_embcache.device_tier import DeviceTier


class _Next(NamedTuple):
    """The next lookup's slots, worked out by the job: valid while the map has not moved since."""

    ids: np.ndarray
    pos: np.ndarray
    moves: int


class Staging:
    """The tier's rows-ahead pipeline (see the module). Every method but `job` runs on the
    training (or a flushing) thread; the tier's ``_lock`` guards the map and this object's
    queues."""

    def __init__(self, tier: DeviceTier) -> None:
        self._t = weakref.proxy(tier)  # the tier holds this
        self._pool: ThreadPoolExecutor | None = None
        self._fut: Future | None = None
        self.queued: list[np.ndarray] = []  # announced batches (`upcoming`) no job took up yet
        self.pending: Plan | None = None  # a planned swap whose kernel `join` queues
        self._ahead: _Next | None = None  # the job's slots for the next lookup, to upload
        self._next: _Next | None = None  # ... once uploaded (what `next_positions` gives)
        self._next_dev: tuple[np.ndarray, Tensor] | None = None  # ... and their device copy
        self._warned = False

    # ------------------------------------------------------------------ the training thread
    def submit(self, ids: np.ndarray | None, announced: list[np.ndarray], keep: np.ndarray | None,
               expect: np.ndarray | None) -> None:
        """Start a job staging ``ids`` (raw, validated) and the ``announced`` batches; ``keep``:
        slots the step uses until its next lookup; ``expect``: the next lookup's ids, if known."""
        self.join()
        t = self._t
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="embcache-device-prefetch",
                                            initializer=t._enter_prefetch_thread)
        self._fut = self._pool.submit(self.job, ids, announced, keep, expect)

    def upcoming(self, ids: np.ndarray) -> None:
        """Queue an announced batch; the job after the next lookup announces and stages it
        (its sort and the map's bookkeeping stay off the training thread)."""
        with self._t._lock:
            self.queued.append(ids.copy())

    def stage(self, keep: np.ndarray) -> None:
        """After a lookup: start staging the batches announced since the last job."""
        with self._t._lock:
            todo, self.queued = self.queued, []
        if todo:
            self.submit(None, todo, keep, None)

    def consume(self, ids: np.ndarray) -> None:
        """Batch ``ids`` was looked up: its announcement ends (or, still queued, is dropped)."""
        m = self._t._map
        if not m.consume(ids) and not m.window_rows and self.queued:
            first = self.queued[0]
            if len(first) == len(ids) and np.array_equal(first, ids):
                self.queued.pop(0)

    def join(self) -> None:
        """Wait for the job in flight (raising its error) and queue the swap it planned. Any
        thread may wait (a flush thread does); the job's future stays until the next submit."""
        fut = self._fut
        if fut is not None:
            fut.result()
            if self.pending is not None or self._ahead is not None:
                self.launch()

    def launch(self) -> None:
        """Queue the planned swap's transfer and kernel on this thread, uploading the next
        lookup's slots with its index array; a kernel that fails to queue puts the map back."""
        t = self._t
        with t._lock:
            p, nxt = self.pending, self._ahead
            self.pending = self._ahead = None
            if p is None and nxt is None:
                return
            self._queue(p, nxt if nxt is not None and nxt.moves == t._map.moves else None)

    def plan_now(self, ids: np.ndarray, keep: np.ndarray | None) -> bool:
        """A lookup's missing rows by the same swap, planned and queued on this thread (caller
        holds the tier's lock); False (nothing changed) where they must move another way."""
        if not self._plan(ids, keep, ahead=False):
            return False
        p, self.pending = self.pending, None
        if p is not None:
            self._queue(p, None, ahead=False)
        return True

    def _queue(self, p: Plan | None, nxt: _Next | None, ahead: bool = True) -> None:
        """Upload swap ``p``'s index array (and ``nxt``'s slots, in the same copy) and queue its
        kernel on this thread; a kernel that fails to queue puts the map back."""
        t = self._t
        up = p.idx if p is not None else np.empty(0, np.int64)
        if nxt is not None:
            up = np.concatenate([up, nxt.pos])
        launched = [False]
        try:
            with t._streamed():
                dev = t.to_device(up)
                if nxt is not None:
                    self._next_dev = (nxt.pos, dev[len(up) - len(nxt.pos):])
                    self._next = nxt
                if p is not None:
                    self._queue_swap(p, dev[: len(p.idx)], launched)
        except BaseException:
            self._next = self._next_dev = None
            if p is not None and not launched[0]:
                self._unplan(p, ahead)
            raise

    def next_positions(self, ids: np.ndarray) -> np.ndarray | None:
        """The job's slots of ``ids`` if it worked them out for exactly this batch and no row
        moved since (caller holds the tier's lock); None: find them."""
        nxt, self._next = self._next, None
        if nxt is None or nxt.moves != self._t._map.moves:
            return None
        if nxt.ids is not ids and (len(nxt.ids) != len(ids) or not np.array_equal(nxt.ids, ids)):
            return None
        return nxt.pos

    def device_positions(self, pos: np.ndarray) -> Tensor | None:
        """The device copy of ``pos`` if it is the array `next_positions` returned."""
        nd, self._next_dev = self._next_dev, None
        return nd[1] if nd is not None and nd[0] is pos else None

    def close(self) -> None:
        try:
            self.join()
        except Exception:  # closing: a failed hint does not matter any more
            pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = None

    # ------------------------------------------------------------------ the background thread
    def job(self, ids: np.ndarray | None, announced: list[np.ndarray], keep: np.ndarray | None,
            expect: np.ndarray | None) -> None:
        t = self._t
        with t._lock:
            parts = [u for u in (self._announce(b) for b in announced) if u is not None]
            if ids is not None:
                parts.append(idsets.unique(ids))
            if not parts:
                return
            want = parts[0] if len(parts) == 1 else idsets.unique(np.concatenate(parts))
            if len(want) > t.capacity // 2:
                want = want[: t.capacity // 2]
            if expect is None and t._map.window_rows:
                expect = t._map.oldest_announced()
            if self._plan(want, keep):
                if expect is not None:
                    pos = t._map.find(expect)
                    if bool((pos >= 0).all()):
                        self._ahead = _Next(expect, pos, t._map.moves)
                return
            t._slots(want, keep, ahead=True)  # on the tier's device and stream (`_enter_prefetch_thread`)

    def _announce(self, ids: np.ndarray) -> np.ndarray | None:
        """Announce one queued batch (its rows unique and sorted), unless the window is full."""
        t = self._t
        u = idsets.unique(ids)
        if t._map.window_rows + len(u) > t.capacity // 2:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"the lookahead window holds {t._map.window_rows + len(u)} rows but the device tier "
                    f"keeps at most {t.capacity // 2} of them ({t.capacity} slots, device_bytes="
                    f"{t.budget_bytes}); batches past that load their rows when looked up: raise "
                    f"device_bytes or lower the lookahead", stacklevel=2)
            return None
        t._map.announce(ids, unique=u)
        return u

    def _plan(self, ids: np.ndarray, keep: np.ndarray | None, ahead: bool = True) -> bool:
        """Choose slots and victims for unique ``ids`` and re-map them now, leaving the kernel
        to `launch` (caller holds the lock). False (nothing changed) where the rows must move
        another way. ``ahead``: rows brought before their lookup (counted as staged ahead)."""
        t = self._t
        if t._mapped is None or t._down or t._swap_check is False or self.pending is not None:
            return False
        # rows not made yet are made first (memory mode); the hits were made when they came up
        if not t._timed_store(t.store._device_read, ids):
            return False
        try:
            plan = t._map.plan(ids, keep, t.dirty)
        except TooFewSlots as exc:
            raise t._too_few(exc) from None
        if plan is not None:
            self.pending = plan
            if ahead:
                t.staged_ahead_rows += len(plan.idx) // 3
        return True

    # ------------------------------------------------------------------ the swap kernel
    def _queue_swap(self, p: Plan, idx: Tensor, launched: list[bool]) -> None:
        t = self._t
        k, nv = len(p.idx) // 3, len(p.victims)
        written = p.victim_ids[p.dirty]
        check = t._swap_check if getattr(t.store, "_check_finite", True) else None
        assert check is None or isinstance(check, tuple)
        mapped, flag = t._mapped, t._nonfinite
        assert mapped is not None

        def enqueue() -> torch.cuda.Event:
            mapped_swap.swap_rows(t.pool, mapped.dev, idx, flag, check)
            launched[0] = True
            done = torch.cuda.Event()
            done.record(t._stream)
            return done

        if not len(written):
            enqueue()
        elif t._timed_store(t.store._device_write, written, enqueue):
            t.written_down_rows += len(written)
            t.down_bytes += len(written) * t.pool.shape[1]
        else:  # a flush is copying the host table: the dirty victims go down staged, queued before
            # the swap overwrites their slots, and the swap only loads
            t._send_down(p.victims[p.dirty], evicted=True, ids=written)
            idx[k : 2 * k].fill_(-1)  # (`_send_down` counted their bytes)
            enqueue()
        t.evicted_rows += nv
        t.up_bytes += k * t.pool.shape[1]
        t.loaded_rows += k

    def _unplan(self, p: Plan, ahead: bool) -> None:
        """Undo `_plan`'s re-mapping (its kernel was never queued)."""
        t = self._t
        k, nv = len(p.idx) // 3, len(p.victims)
        t._map.release(p.idx[: k - nv])
        t._map.replace(p.victims, p.victim_ids)
        t.dirty[p.victims] = p.dirty
        if ahead:
            t.staged_ahead_rows -= k
