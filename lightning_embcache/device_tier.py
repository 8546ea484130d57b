"""DeviceTier: a store's hot rows, with their optimizer state, in GPU memory within a byte budget.

Rows that live on the GPU train where the model trains: `lookup` is one gather on the device, the
sparse row-wise optimizer updates rows and moments in place there (the fused Triton kernel for
Adam/AdamW), and nothing crosses PCIe in the steady state. A table larger than the budget keeps
the rows it used last (CLOCK). Over a memory-mode table the host table is mapped into the device
(`mapped_host`): missing rows are gathered from it by one kernel and evicted dirty rows scattered
back by another, with no host copy. Otherwise missing rows come up from the host tiers through
reused pinned buffers with ``non_blocking`` copies, and dirty rows pushed out go down the same way.

Every decision (which slot holds which id, what is dirty, what to evict) is made on the host from
the batch's host ids, so the device never has to answer a question: no step waits for the GPU.

Layout: one ``(slots, row_bytes)`` uint8 tensor holding whole store records (weight, optimizer
state, per-row metadata) at the same offsets as the host pool, so a row moves up or down as one
contiguous record and every field is a strided view (`EmbeddingStore.record_view`).

No Lightning imports; `TrainableRows` and the Lightning handle drive it.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

import lightning_embcache.mapped_swap as mapped_swap
from lightning_embcache.device_ahead import Staging
from lightning_embcache.device_slots import SlotMap, TooFewSlots
from lightning_embcache.mapped_host import MappedHost, store_table
from lightning_embcache.pinned import PinnedRing
from lightning_embcache.store import EmbeddingStore, StoreError, rowcopy
from lightning_embcache.store.errors import InvalidArgumentError, OutOfMemoryError
from lightning_embcache.store.memory import private_zeros

#: host bookkeeping per device slot: id (8) + free-list entry (8) + eviction stamp (8) +
#: reference bit (1) + dirty (1); the budget counts it with the record
SLOT_OVERHEAD = 26
#: rows per host<->device transfer when a whole table is loaded or written down (a pinned buffer
#: of this many records stays allocated: 25 MiB for 1.5 KiB records)
TRANSFER_ROWS = 16_384
#: most rows per store call of the tier's background threads (write-back and uploads): just below
#: the store's threshold for copies split over its copy threads. The training and exchange threads
#: keep the GIL busy, and every hand-off to and from those threads waits for it: under a contended
#: GIL one 4,100-row call took 30-57 ms where two or three calls below the threshold took 0.5-18 ms
#: (`python -m benchmarks.owner_host`). The store's lock is free between calls.
STORE_CALL_ROWS = rowcopy.PARALLEL_MIN_ROWS - 1


def store_spans(n: int) -> list[tuple[int, int]]:
    """``[a, b)`` row ranges of equal size, each at most `STORE_CALL_ROWS`, covering ``n`` rows."""
    if n < 1:
        return []
    step = -(-n // -(-n // STORE_CALL_ROWS))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def finite_weights(store: EmbeddingStore, records: Tensor) -> bool:
    """Whether the store's NaN/Inf check (``check_finite``) would pass host ``records``' weights,
    in one pass that releases the GIL once: their sum is finite."""
    if not getattr(store, "_check_finite", True) or not len(records):
        return True
    return math.isfinite(store.record_view(records, "weight").sum(dtype=torch.float32).item())


def _declined(*_: Any) -> bool:
    return False


def _entry(method: Any) -> Any:
    """A tier call of the training thread: its wall time (waits for the prefetch thread, misses
    served from the store) counts as the thread's store I/O (`DeviceTier.io_seconds`)."""

    @functools.wraps(method)
    def call(self: DeviceTier, *args: Any, **kwargs: Any) -> Any:
        with self._io():
            try:
                return method(self, *args, **kwargs)
            except torch.cuda.OutOfMemoryError as exc:
                raise self._out_of_memory(exc) from None

    return call


_NO_SLOTS = np.empty(0, np.int64)


class _Down(NamedTuple):
    """Rows on their way from the device to the store: sorted ids, their pinned host copy, the
    event that says the copy is done, the device copy it was made from, and a sequence number."""

    ids: np.ndarray
    host: Tensor
    event: torch.cuda.Event
    dev: Tensor
    seq: int


class DeviceTier:
    """The hot rows of ``store`` on ``device``, within ``budget_bytes`` (see module docstring).

    Notes:
        * Holds ``min(num_rows, budget_bytes // (row_bytes + 26))`` rows; ``26`` bytes per slot
          are host bookkeeping. A table that fits is loaded once and stays (slot == id). A
          table larger than the tier also keeps two int32 per table row on the host (where each
          id sits, and whether it is on its way down), and up to 8 sets of evicted records on
          the GPU beyond the budget while their copies to the host run.
        * The store behind it is the truth at every flush: `write_down()` brings every dirty row
          down before the store flushes, so a flush, a checkpoint and a crash keep their
          guarantees. Rows evicted in between reach the store within the next step or two.
        * NaN/Inf in trained rows are reported when the rows reach the host store (eviction or
          flush): checking on the device would make every step wait for the GPU.
        * Thread-safe: a background flush may call `write_down()` while the training thread runs;
          `prefetch` works in a thread of its own, joined by the next call that needs the slots.
    """

    def __init__(self, store: EmbeddingStore, device: torch.device | str, budget_bytes: int) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise InvalidArgumentError(f"device must be a CUDA device for a device tier; got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise InvalidArgumentError(f"device_bytes must be an int >= 1 (bytes); got {budget_bytes!r}")
        self.store = store
        self.device = device
        self.budget_bytes = budget_bytes
        n, rb = store.num_rows, store.row_bytes
        per_slot = rb + SLOT_OVERHEAD
        capacity = min(n, budget_bytes // per_slot)
        if capacity < 1:
            raise InvalidArgumentError(
                f"device_bytes={budget_bytes} holds no row of {per_slot} bytes (record + bookkeeping); "
                f"give at least {per_slot}, or 0 for no device tier")
        self.capacity = capacity
        self.resident = capacity >= n
        # _lock: slot maps, free list, rows on their way down. _step_lock: a training step's
        # kernels are queued as a whole, so a flush from another thread sees all of a step or none.
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        self._ring_lock = threading.Lock()
        self._stream = torch.cuda.current_stream(device)
        try:
            self.pool = self._make_pool(capacity, rb)
        except torch.cuda.OutOfMemoryError as exc:
            free, total = torch.cuda.mem_get_info(device)
            fits = int(0.9 * free) // per_slot * per_slot
            raise OutOfMemoryError(
                f"the device tier could not allocate {capacity * rb} bytes on {device} for device_bytes="
                f"{budget_bytes} ({free} of {total} bytes free there, the model's tensors included): lower "
                f"device_bytes (about {fits} would fit now), or pass device_bytes=0 to keep the rows in host "
                f"RAM") from exc
        self._views = {name: store.record_view(self.pool, name) for name in store.field_names}
        self.dirty = np.zeros(capacity, np.bool_)
        self._up = PinnedRing()      # host -> device
        self._idx = PinnedRing(32)   # small index tensors host -> device (several per step)
        self._down: list[_Down] = []  # row sets on their way down, oldest first (under _down_cv)
        self._down_cv = threading.Condition()
        self._seq = 0
        self._writer: ThreadPoolExecutor | None = None  # writes `_down` into the store, in order
        self._writer_error: BaseException | None = None
        self._down_ring = PinnedRing(8)  # one buffer per row set in `_down`, never more
        self.loaded_rows = 0
        self.evicted_rows = 0
        self.written_down_rows = 0
        self.up_bytes = 0    # records host -> device (loads), the whole run
        self.down_bytes = 0  # records device -> host (evictions and write-downs)
        self.staged_ahead_rows = 0  # rows a prefetch or an announced batch brought up before their lookup
        self.lookup_rows = 0  # rows looked up (positions), and of those, rows already on the device
        self.lookup_hit_rows = 0
        self._mapped: MappedHost | None = None
        self._nonfinite: Tensor | None = None  # device flag: a mapped write-down met NaN/Inf
        #: the weight words `mapped_swap` checks for NaN/Inf; False: rows move by separate copies
        self._swap_check: tuple[int, int, int] | bool = False
        #: the tier's own store calls go through the store's trusted record copies (one GIL release
        #: each; NaN/Inf checked by one sum); False: the checked public calls in `store_spans`
        #: (the distributed benchmark's ``store=checked``)
        self.trusted_store_calls = True
        # I/O accounting for the profiler's store_io: wall time the calling (training) thread spent
        # in the tier's entry points, and the time of every store call the tier made (any thread),
        # which the store also counts in its own io_wait_seconds
        self.io_seconds = 0.0
        self.store_seconds = 0.0
        self._depth = threading.local()
        self._own_thread = threading.local()  # on_stream: a thread of the tier's own, on its device and stream
        self._staging = Staging(self)  # rows brought up ahead of their lookup
        if self.resident:
            self._load_all()
        else:
            self._map = SlotMap(n, capacity)
            self._down_seq = private_zeros(n, np.int32)  # seq of the newest `_Down` holding the id; 0 = none
            self._mapped = MappedHost.try_register(store_table(store), device)
            if self._mapped is not None:
                self._nonfinite = torch.zeros((), dtype=torch.int32, device=device)
                if mapped_swap.available(self.pool):
                    self._swap_check = mapped_swap.weight_words(self.pool, self.view("weight")) or False

    def _out_of_memory(self, exc: BaseException) -> OutOfMemoryError:
        """The error for a GPU allocation that failed inside a tier call: the rows are as they
        were (a row is marked present only after its copy was queued), so lowering the budget and
        resuming is safe."""
        return OutOfMemoryError(
            f"the GPU ran out of memory while the device tier moved rows on {self.device} (device_bytes="
            f"{self.budget_bytes}, {self.nbytes} bytes of it held by the tier's rows): lower device_bytes to "
            f"leave the model room, or lower the batch size ({str(exc).splitlines()[0] if str(exc) else 'no detail'})")

    def _make_pool(self, capacity: int, row_bytes: int) -> Tensor:
        """The device memory holding the tier's records (`HostMappedTier`: the host table)."""
        return torch.empty((capacity, row_bytes), dtype=torch.uint8, device=self.device)

    @contextmanager
    def _io(self) -> Iterator[None]:
        """Count the outermost entry point's wall time as this thread's I/O wait."""
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth.n = depth
            if not depth:
                self.io_seconds += time.perf_counter() - t0

    def _timed_store(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.store_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ fields and indices
    def view(self, name: str) -> Tensor:
        """Field ``name`` of every slot, as a strided ``(capacity, cols)`` view on the device."""
        return self._views[name]

    def to_device(self, arr: np.ndarray) -> Tensor:
        """A small host array on the device through a pinned buffer, without waiting."""
        if getattr(self._own_thread, "on_stream", False):  # device and stream set already (`_streamed`)
            with self._ring_lock:
                return self._idx.to_device(arr, self.device, self._stream)
        with self._ring_lock, torch.cuda.stream(self._stream):  # the training and prefetch threads
            return self._idx.to_device(arr, self.device, self._stream)

    def _enter_prefetch_thread(self) -> None:
        """The prefetch thread's device and stream, set once for all its jobs (entering them
        per job costs more host time than a job's index upload)."""
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self._stream)
        self._own_thread.on_stream = True

    @property
    def nbytes(self) -> int:
        """Device memory held by the rows (the budget's part that is allocated)."""
        return self.pool.numel()

    # ------------------------------------------------------------------ rows in and out
    @_entry
    def prefetch(self, ids: np.ndarray, protect: np.ndarray | None = None) -> None:
        """Start bringing validated ``ids`` to the device in a background thread; returns at once.

        ``protect``: slots the training thread still uses until the next lookup (this step's
        rows): they are never chosen for eviction. The thread does the host half (`Staging`);
        the next lookup, which waits for it first, queues the copies on its own stream and finds
        its slots worked out already where it looks up these ``ids``.
        """
        if self.resident:
            return
        raw = ids.copy()
        self._staging.submit(raw, [], None if protect is None else protect.copy(), raw)

    @_entry
    def upcoming(self, ids: np.ndarray, protect: np.ndarray | None = None) -> None:
        """A coming batch reads validated ``ids`` (`LookaheadSampler`'s window): bring them up
        in the background and keep them until that batch is looked up; eviction meanwhile takes
        rows no announced batch reads. The batch is announced and its rows staged by a background
        job started right after the next lookup, so the job overlaps a whole training step and
        that lookup never waits for it. A window of more rows than half the tier is not announced
        past that point (a warning names both sizes); its rows load when looked up."""
        if not self.resident:
            self._staging.upcoming(ids)

    def _join(self) -> None:
        """Wait for the prefetch in flight (and raise its error, if any); queue its swap."""
        self._staging.join()

    @contextmanager
    def _streamed(self) -> Iterator[None]:
        """This thread on the tier's device and stream inside the block (entered once for the
        block's calls: `to_device` then skips its own)."""
        if getattr(self._own_thread, "on_stream", False):
            yield
            return
        with torch.cuda.stream(self._stream):
            self._own_thread.on_stream = True
            try:
                yield
            finally:
                self._own_thread.on_stream = False

    @_entry
    def positions(self, ids: np.ndarray, protect: np.ndarray | None = None) -> np.ndarray:
        """The device slot of every position of validated ``ids`` (duplicates allowed)."""
        if self.resident:
            self.lookup_rows += len(ids)
            self.lookup_hit_rows += len(ids)
            return ids
        self._join()
        with self._lock:
            out = self._staging.next_positions(ids)  # worked out by the prefetch job
            s = self._map.find(ids) if out is None else out
            hits = len(ids) if out is not None else int(np.count_nonzero(s >= 0))
            self.lookup_rows += len(ids)
            self.lookup_hit_rows += hits
            if hits == len(ids):  # every row already on the device (the prefetched case): no unique()
                self._staging.consume(ids)
                out = s
        if hits != len(ids):
            uniq, inv = np.unique(ids, return_inverse=True)
            out = self._slots(uniq, protect)[inv]
            with self._lock:
                self._staging.consume(ids)
        assert out is not None
        if self._staging.queued:  # the window's next batches, staged while this step runs
            self._staging.stage(out if protect is None or not len(protect) else np.concatenate([protect, out]))
        return out

    def device_positions(self, pos: np.ndarray) -> Tensor:
        """``pos`` (what `positions` returned) on the device: the copy the prefetch job's
        upload carried where there is one, else uploaded now."""
        dev = self._staging.device_positions(pos)
        return dev if dev is not None else self.to_device(pos)

    @_entry
    def gather(self, ids: np.ndarray, name: str = "weight", protect: np.ndarray | None = None) -> Tensor:
        """Field ``name`` of validated ``ids`` as a new tensor on the device.

        A read of more distinct rows than half the tier (e.g. the whole table for evaluation)
        is served without caching it: rows on the device from there, the rest from the store.
        """
        if self.resident or len(ids) <= self.capacity // 2:
            return self.view(name).index_select(0, self.to_device(self.positions(ids, protect)))
        uniq, inv = np.unique(ids, return_inverse=True)
        if len(uniq) <= self.capacity // 2:
            return self.view(name).index_select(0, self.to_device(self.slots(uniq, protect)[inv]))
        self._join()
        with self._lock:
            self.drain()
            s = self._map.slot_of[uniq].astype(np.int64) - 1
            on = np.flatnonzero(s >= 0)
            off = np.flatnonzero(s < 0)
            dtype, cols = self.store.field_spec(name)
            out = torch.empty((len(uniq), cols), dtype=dtype, device=self.device)
            if len(on):
                out[self.to_device(on)] = self.view(name).index_select(0, self.to_device(s[on]))
            if len(off):
                host = self._timed_store(self.store.get_fields, torch.from_numpy(uniq[off]), (name,))[name]
                out[self.to_device(off)] = host.to(self.device)
            return out.index_select(0, self.to_device(inv))

    @_entry
    def scatter(self, ids: np.ndarray, values: Tensor, protect: np.ndarray | None = None) -> None:
        """Write weights ``values`` (on the device, store dtype) to validated ``ids``; of
        duplicate ids the last one wins, as in `EmbeddingStore.update`."""
        rev_uniq, first_in_rev = np.unique(ids[::-1], return_index=True)
        last = len(ids) - 1 - first_in_rev
        slots = self.slots(rev_uniq, protect)
        with self.writing(slots):
            self.view("weight").index_copy_(0, self.to_device(slots), values.index_select(0, self.to_device(last)))

    # ------------------------------------------------------------------ residency
    @_entry
    def slots(self, ids: np.ndarray, protect: np.ndarray | None = None) -> np.ndarray:
        """Device slots of validated, unique ``ids``, bringing missing rows up first.

        ``protect``: slots that must not be evicted now (rows with gradients not yet applied).
        """
        if self.resident:
            return ids
        self._join()
        return self._slots(ids, protect)

    def _slots(self, ids: np.ndarray, protect: np.ndarray | None, ahead: bool = False) -> np.ndarray:
        """``ahead``: a prefetch brings the rows before their lookup (counted as staged ahead)."""
        with self._lock:
            if self._staging.pending is not None:  # the planned rows' kernel first: this call may evict them
                self._staging.launch()
            s = self._map.find(ids)
            miss = s < 0
            if not miss.any():
                return s
            mids = ids[miss]
            if ahead:
                self.staged_ahead_rows += len(mids)
            if self._staging.plan_now(ids, protect):  # one swap kernel over the mapped table
                return self._map.find(ids)
            # rows move by separate copies: the evicted ones down first
            keep = np.concatenate([s[~miss], protect]) if protect is not None and len(protect) else s[~miss]
            k = len(mids)
            victims = self._victims(k - self._map.nfree, keep) if k > self._map.nfree else _NO_SLOTS
            self._drop(victims)
            got = self._map.take(k)
            self._upload(mids, got)
            s[miss] = got
            return s

    def _victims(self, k: int, keep: np.ndarray) -> np.ndarray:
        """``k`` slots not in ``keep`` to free (`SlotMap.victims`: the announced future first,
        then CLOCK)."""
        try:
            return self._map.victims(k, keep)
        except TooFewSlots as exc:
            raise self._too_few(exc) from None

    def _too_few(self, exc: TooFewSlots) -> StoreError:
        need = exc.kept + exc.needed
        return StoreError(
            f"the device tier holds {self.capacity} rows (device_bytes={self.budget_bytes}) but this step "
            f"needs {need} at once (the batch plus rows whose gradients are not applied "
            f"yet); raise device_bytes to at least "
            f"{need * (self.store.row_bytes + SLOT_OVERHEAD)} or use a smaller batch")

    def _drop(self, slots: np.ndarray) -> None:
        d = slots[self.dirty[slots]]
        if len(d):
            self._send_down(d, evicted=True)
        self._map.release(slots)
        self.dirty[slots] = False
        self.evicted_rows += len(slots)

    def _upload(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Bring rows ``ids`` from the host store into device ``slots`` (non-blocking)."""
        self._upload_rows(ids, slots)

    def _upload_rows(self, ids: np.ndarray, slots: np.ndarray) -> None:
        ids_all, slots_all = ids, slots
        from_store = np.ones(len(ids), np.bool_)
        with self._down_cv:
            # A row still on its way down is newer than the store's copy: take it from the device
            # copy its write-down was made from (stream order makes that copy current), never wait.
            seqs = self._down_seq[ids] if self._down else None
            on_way = np.flatnonzero(seqs) if seqs is not None else ()
            if seqs is not None and len(on_way):  # one pass over the batch; then per row set over these few rows
                for item in self._down:
                    mine = on_way[seqs[on_way] == item.seq]
                    if len(mine):
                        pos = np.searchsorted(item.ids, ids[mine])
                        self.pool.index_copy_(0, self.to_device(slots[mine]),
                                              item.dev.index_select(0, self.to_device(pos)))
                        from_store[mine] = False
        if not from_store.all():
            ids, slots = ids[from_store], slots[from_store]
        if len(ids) and not self._up_mapped(ids, slots):
            staged = self._stage_up(ids).to(self.device, non_blocking=True)
            self._up.done(self._up_slot, self._stream)
            self.pool.index_copy_(0, self.to_device(slots), staged)
        self.up_bytes += len(ids) * self.pool.shape[1]
        self._map.assign(slots_all, ids_all)
        self.loaded_rows += len(ids_all)

    def _up_mapped(self, ids: np.ndarray, slots: np.ndarray) -> bool:
        """Gather rows ``ids`` from the mapped host table into ``slots`` with one kernel (queued
        after every write-down of the same stream); False where the table is not mapped."""
        if self._mapped is None or not self._timed_store(self.store._device_read, ids):
            return False
        both = self.to_device(np.concatenate([slots, ids]))  # one transfer for both index arrays
        self._mapped.gather_into(self.pool, both[: len(slots)], both[len(slots):])
        return True

    def _down_mapped(self, ids: np.ndarray, slots: np.ndarray, *, evicted: bool) -> bool:
        """Scatter the records of ``slots`` into the mapped host table at ``ids`` with one
        kernel; False (nothing done) where the table is not mapped, rows of an earlier write-down
        are still on their way (they must land first), or a flush is copying the table.

        NaN/Inf: rows evicted during a step are checked by the kernels (a flag read at the next
        drain, which refuses the flush); rows of a write-down (before a flush, where waiting is
        fine) are checked first, and non-finite ones take the staged path, whose store call
        refuses them and leaves the store as it was."""
        if self._mapped is None or self._down:
            return False
        mapped, nonfinite = self._mapped, self._nonfinite
        check = getattr(self.store, "_check_finite", True)
        both = self.to_device(np.concatenate([slots, ids]))  # one transfer for both index arrays
        rows = self.pool.index_select(0, both[: len(slots)])
        finite = torch.isfinite(self.store.record_view(rows, "weight")).all() if check else None
        if finite is not None and not evicted and not bool(finite):
            return False

        def enqueue() -> torch.cuda.Event:
            if finite is not None and evicted and nonfinite is not None:  # read at the next drain
                nonfinite.logical_or_(~finite)
            mapped.scatter_from(rows, both[len(slots):])
            done = torch.cuda.Event()
            done.record(self._stream)
            return done

        if not self._timed_store(self.store._device_write, ids, enqueue):
            return False
        self.dirty[slots] = False
        self.written_down_rows += len(ids)
        return True

    def _stage_up(self, ids: np.ndarray) -> Tensor:
        """Records of ``ids`` read from the store straight into the next pinned buffer."""
        rb = self.pool.shape[1]
        self._up_slot, buf = self._up.take(len(ids) * rb)
        out = buf[: len(ids) * rb].view(len(ids), rb)
        tid = torch.from_numpy(ids)
        if self.trusted_store_calls and self._timed_store(self._trusted("read"), tid, out):
            return out
        for a, b in store_spans(len(ids)):
            self._timed_store(self.store.read_records, tid[a:b], out=out[a:b])
        return out

    def _trusted(self, op: str) -> Any:
        """The store's trusted record copy ``op`` (read/write), or one that declines (another store)."""
        return getattr(self.store, f"_{op}_records_trusted", _declined)

    def _load_all(self) -> None:
        n = self.store.num_rows
        for a in range(0, n, TRANSFER_ROWS):
            b = min(n, a + TRANSFER_ROWS)
            self.pool[a:b].copy_(self._stage_up(np.arange(a, b)), non_blocking=True)
            self._up.done(self._up_slot, self._stream)
        self.loaded_rows = n

    # ------------------------------------------------------------------ writes
    def mark_dirty(self, slots: np.ndarray) -> None:
        """Rows a step changed (caller holds `step_lock`; a prefetch never evicts these slots)."""
        self.dirty[slots] = True

    @contextmanager
    def writing(self, slots: np.ndarray) -> Iterator[None]:
        """Queue kernels that write the rows in ``slots`` inside this block: a background
        `write_down` sees all of them or none, and the rows count as dirty after it."""
        with self._step_lock:
            yield
            self.dirty[slots] = True

    def ready(self, ids: np.ndarray) -> None:
        """Before a kernel reads rows ``ids`` at slot == id (a tier holding the whole table)."""

    @property
    def step_lock(self) -> threading.Lock:
        """Held while a training step queues its kernels; `write_down` takes it too."""
        return self._step_lock

    def _send_down(self, slots: np.ndarray, *, evicted: bool, ids: np.ndarray | None = None) -> None:
        """Queue a device->host copy of ``slots``' records (of rows ``ids``, by default the rows
        the map has there); applied to the store in order."""
        if ids is None:
            ids = slots if self.resident else self._map.id_of[slots]
        self.down_bytes += len(ids) * self.pool.shape[1]
        if self._down_mapped(ids, slots, evicted=evicted):
            return
        order = np.argsort(ids)
        ids, slots = ids[order], slots[order]  # sorted: a later upload finds its rows by bisection
        rb = self.pool.shape[1]
        with self._down_cv:
            while len(self._down) >= self._down_ring.size:  # the ring's next buffer is still in use
                self._raise_writer_error()
                self._down_cv.wait()
            i, buf = self._down_ring.take(len(slots) * rb)
            host = buf[: len(slots) * rb].view(len(slots), rb)
            dev = self.pool.index_select(0, self.to_device(slots))
            host.copy_(dev, non_blocking=True)
            self._seq += 1
            item = _Down(ids, host, self._down_ring.done(i, self._stream), dev, self._seq)
            self._down.append(item)
            if not self.resident:
                self._down_seq[ids] = self._seq
        self.dirty[slots] = False
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="embcache-device-writeback")
        self._writer.submit(self._write_item, item)

    def _write_item(self, item: _Down) -> None:
        """The write-back thread: wait for one row set's copy, write it into the store, in order."""
        try:
            item.event.synchronize()
            ids = torch.from_numpy(item.ids)
            if not (self.trusted_store_calls and self._finite(item.host)
                    and self._timed_store(self._trusted("write"), ids, item.host)):
                for a, b in store_spans(len(ids)):
                    self._timed_store(self.store.write_records, ids[a:b], item.host[a:b])
        except BaseException as exc:  # kept in `_down` (nothing lost) and raised by the next wait
            with self._down_cv:
                self._writer_error = exc
                self._down_cv.notify_all()
            return
        with self._down_cv:
            self._down.remove(item)
            if not self.resident:
                mine = item.ids[self._down_seq[item.ids] == item.seq]
                self._down_seq[mine] = 0  # the store has their newest value now
            self.written_down_rows += len(item.ids)
            self._down_cv.notify_all()

    def _finite(self, records: Tensor) -> bool:
        """`finite_weights` of the tier's store. A row set that fails (NaN/Inf, or finite weights
        whose sum overflows) goes through the checked `write_records`, which raises the store's
        own error for NaN/Inf (the rows stay in `_down`: nothing is lost)."""
        return finite_weights(self.store, records)

    def _raise_writer_error(self) -> None:
        if self._writer_error is not None:
            raise StoreError(f"writing rows from the device tier into the store failed: {self._writer_error}") \
                from self._writer_error

    def drain(self) -> int:
        """Wait until every row sent down so far is in the host store; returns rows written."""
        with self._io(), self._down_cv:
            before = self.written_down_rows
            self._drain_through(sys.maxsize)
            return self.written_down_rows - before

    def _await_mapped(self) -> None:
        """Wait for the mapped write-downs queued so far; refuse NaN/Inf weights they carried."""
        if self._mapped is None:
            return
        self.store._await_device_writes()
        if self._nonfinite is not None and bool(self._nonfinite):
            raise StoreError(
                "NaN or Inf weights were trained on the device and reached the host table; the store "
                "refuses to flush them (lower the learning rate or clip gradients, then resume from the "
                "last checkpoint)")

    def write_down(self) -> int:
        """Bring every dirty row down into the host store (before a flush); returns the rows
        that were dirty.

        The training thread waits only while the rows' copies are queued: they are queued under
        the step lock (a step's kernels are queued as a whole, so the copies hold every step
        before and none after), and the store writes they feed run after it is released, while
        training goes on (a `DeferredSync` flush in its worker thread). Returns once they have
        landed in the store."""
        self._join()
        with self._io():
            with self._step_lock, self._lock, torch.cuda.stream(self._stream):
                dirty = np.flatnonzero(self.dirty)
                for a in range(0, len(dirty), TRANSFER_ROWS):
                    self._send_down(dirty[a : a + TRANSFER_ROWS], evicted=False)
                last = self._seq
            self._drain_through(last)
            return len(dirty)

    def _drain_through(self, seq: int) -> None:
        """Wait until the row sets sent down up to sequence number ``seq`` (and every mapped
        write queued so far) are in the host store; later evictions may still be on their way."""
        with self._down_cv:
            while self._down and self._down[0].seq <= seq:  # oldest first: written in order
                self._raise_writer_error()
                self._down_cv.wait()
            self._await_mapped()

    def stats(self) -> dict[str, Any]:
        """Rows held, capacity, bytes, dirty, loaded and evicted rows of the device tier."""
        used = self.capacity if self.resident else self._map.used
        return {"device_rows": used, "device_capacity_rows": self.capacity, "device_bytes": self.nbytes,
                "device_dirty_rows": int(np.count_nonzero(self.dirty)), "device_loaded_rows": self.loaded_rows,
                "device_evicted_rows": self.evicted_rows, "device_mapped_host": self._mapped is not None,
                "host_to_device_bytes": self.up_bytes, "device_to_host_bytes": self.down_bytes,
                "device_staged_ahead_rows": self.staged_ahead_rows, "device_lookup_rows": self.lookup_rows,
                "device_lookup_hit_rows": self.lookup_hit_rows}

    def close(self) -> None:
        """Free the device memory (after `write_down()`: unwritten rows are discarded)."""
        self._staging.close()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self._writer = None
        with self._lock, self._down_cv:
            self._down.clear()
            if self._mapped is not None:
                if not self.store.closed:
                    self.store._await_device_writes()
                else:
                    torch.cuda.current_stream(self.device).synchronize()
                self._mapped.close()
                self._mapped = None
            self.pool = torch.empty(0, dtype=torch.uint8)
            self._views = {}
