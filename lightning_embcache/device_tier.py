"""DeviceTier: a store's hot rows, with their optimizer state, in GPU memory within a byte budget.

Rows that live on the GPU train where the model trains: `lookup` is one gather on the device, the
sparse row-wise optimizer updates rows and moments in place there (the fused Triton kernel for
Adam/AdamW), and nothing crosses PCIe in the steady state. A table larger than the budget keeps
the rows it used last (CLOCK): missing rows come up from the host tiers through reused pinned
buffers with ``non_blocking`` copies, and dirty rows pushed out go down the same way.

Every decision (which slot holds which id, what is dirty, what to evict) is made on the host from
the batch's host ids, so the device never has to answer a question: no step waits for the GPU.

Layout: one ``(slots, row_bytes)`` uint8 tensor holding whole store records (weight, optimizer
state, per-row metadata) at the same offsets as the host pool, so a row moves up or down as one
contiguous record and every field is a strided view (`EmbeddingStore.record_view`).

No Lightning imports; `TrainableRows` and the Lightning handle drive it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_embcache.store import EmbeddingStore, StoreError
from lightning_embcache.store.errors import InvalidArgumentError

#: host bookkeeping per device slot: id (8) + reference bit (1) + dirty (1)
SLOT_OVERHEAD = 10
#: rows per host<->device transfer when a whole table is loaded or written down
TRANSFER_ROWS = 65_536


class _PinnedRing:
    """Reused pinned host buffers for non-blocking copies; a buffer is refilled only after the
    copy that last used it has finished (its event), which by then it normally has."""

    def __init__(self, slots: int = 4) -> None:
        self._bufs: list[Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, Tensor]:
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()  # waits for that one old copy, not for the device
            self._events[i] = None
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 4096) * 5 // 4, dtype=torch.uint8, pin_memory=True)
            self._bufs[i] = buf
        return i, buf

    def done(self, i: int, stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(stream)
        self._events[i] = ev
        return ev


def _as_pinned(buf: Tensor, arr: np.ndarray) -> Tensor:
    """``arr`` copied into the front of pinned ``buf``, as a tensor of arr's dtype and shape."""
    flat = torch.from_numpy(np.ascontiguousarray(arr)).reshape(-1).view(torch.uint8)
    buf[: flat.numel()].copy_(flat)
    dtype = torch.from_numpy(arr[:0]).dtype
    return buf[: flat.numel()].view(dtype).view(arr.shape)


class DeviceTier:
    """The hot rows of ``store`` on ``device``, within ``budget_bytes`` (see module docstring).

    Notes:
        * Holds ``min(num_rows, budget_bytes // (row_bytes + 10))`` rows; ``10`` bytes per slot
          are host bookkeeping. A table that fits is loaded once and stays (slot == id).
        * The store behind it is the truth at every flush: `write_down()` brings every dirty row
          down before the store flushes, so a flush, a checkpoint and a crash keep their
          guarantees. Rows evicted in between reach the store within the next step or two.
        * NaN/Inf in trained rows are reported when the rows reach the host store (eviction or
          flush): checking on the device would make every step wait for the GPU.
        * Thread-safe: a background flush may call `write_down()` while the training thread runs.
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
        self._lock = threading.RLock()
        self._stream = torch.cuda.current_stream(device)
        self.pool = torch.empty((capacity, rb), dtype=torch.uint8, device=device)
        self._views = {name: store.record_view(self.pool, name) for name in store.field_names}
        self.dirty = np.zeros(capacity, np.bool_)
        self._up = _PinnedRing()      # host -> device
        self._idx = _PinnedRing(8)    # small index tensors host -> device
        self._down: list[tuple[np.ndarray, Tensor, torch.cuda.Event]] = []  # evicted, in flight
        self._down_ring = _PinnedRing()
        self.loaded_rows = 0
        self.evicted_rows = 0
        self.written_down_rows = 0
        if self.resident:
            self._load_all()
        else:
            self.slot_of = np.zeros(n, np.int32)      # slot + 1; 0 = not on the device
            self.id_of = np.full(capacity, -1, np.int64)
            self.ref = np.zeros(capacity, np.uint8)
            self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
            self._nfree = capacity
            self._hand = 0

    # ------------------------------------------------------------------ fields and indices
    def view(self, name: str) -> Tensor:
        """Field ``name`` of every slot, as a strided ``(capacity, cols)`` view on the device."""
        return self._views[name]

    def to_device(self, arr: np.ndarray) -> Tensor:
        """A small host array on the device through a pinned buffer, without waiting."""
        i, buf = self._idx.take(arr.nbytes)
        out = _as_pinned(buf, arr).to(self.device, non_blocking=True)
        self._idx.done(i, self._stream)
        return out

    @property
    def nbytes(self) -> int:
        """Device memory held by the rows (the budget's part that is allocated)."""
        return self.pool.numel()

    # ------------------------------------------------------------------ residency
    def slots(self, ids: np.ndarray, protect: np.ndarray | None = None) -> np.ndarray:
        """Device slots of validated, unique ``ids``, bringing missing rows up first.

        ``protect``: slots that must not be evicted now (rows with gradients not yet applied).
        """
        if self.resident:
            return ids
        with self._lock:
            s = self.slot_of[ids].astype(np.int64) - 1
            miss = s < 0
            self.ref[s[~miss]] = 1
            if not miss.any():
                return s
            mids = ids[miss]
            got = self._allocate(len(mids), keep=np.concatenate([s[~miss], protect])
                                 if protect is not None and len(protect) else s[~miss])
            self._upload(mids, got)
            s[miss] = got
            return s

    def _allocate(self, k: int, keep: np.ndarray) -> np.ndarray:
        if k > self._nfree:
            self._evict(k - self._nfree, keep)
        got = self._free[self._nfree - k : self._nfree].copy()
        self._nfree -= k
        return got

    def _evict(self, k: int, keep: np.ndarray) -> None:
        """Free ``k`` slots by CLOCK over the occupied slots not in ``keep``; dirty ones go down."""
        cap = self.capacity
        blocked = self.id_of < 0  # free slots are not victims
        if len(keep):
            blocked[keep] = True
        order = np.r_[np.arange(self._hand, cap), np.arange(0, self._hand)]
        cand = order[~blocked[order]]
        if len(cand) < k:
            need = cap - len(cand) + k - self._nfree
            raise StoreError(
                f"the device tier holds {cap} rows (device_bytes={self.budget_bytes}) but this step "
                f"needs {need} at once (the batch plus rows whose gradients are not applied yet); "
                f"raise device_bytes to at least {need * (self.store.row_bytes + SLOT_OVERHEAD)} "
                f"or use a smaller batch")
        referenced = self.ref[cand] != 0
        cold = cand[~referenced]
        pick = cold[:k] if len(cold) >= k else np.concatenate([cold, cand[referenced][: k - len(cold)]])
        # the hand sweeps past the victims: rows it passed lose their second chance
        last = int(np.flatnonzero(cand == pick[-1])[0])
        self.ref[cand[: last + 1]] = 0
        self._hand = int(pick[-1] + 1) % cap
        self._drop(pick)

    def _drop(self, slots: np.ndarray) -> None:
        d = slots[self.dirty[slots]]
        if len(d):
            self._send_down(d, evicted=True)
        self.slot_of[self.id_of[slots]] = 0
        self.id_of[slots] = -1
        self.ref[slots] = 0
        self.dirty[slots] = False
        self._free[self._nfree : self._nfree + len(slots)] = slots
        self._nfree += len(slots)
        self.evicted_rows += len(slots)

    def _upload(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Bring rows ``ids`` from the host store into device ``slots`` (non-blocking)."""
        if self._down and self._pending_overlap(ids):
            self.drain()  # a row on its way down must reach the store before it is read again
        recs = self.store.read_records(torch.from_numpy(ids)).numpy()
        i, buf = self._up.take(recs.nbytes)
        staged = _as_pinned(buf, recs).to(self.device, non_blocking=True)
        self._up.done(i, self._stream)
        self.pool.index_copy_(0, self.to_device(slots), staged)
        self.id_of[slots] = ids
        self.slot_of[ids] = (slots + 1).astype(np.int32)
        self.ref[slots] = 1
        self.loaded_rows += len(ids)

    def _load_all(self) -> None:
        n = self.store.num_rows
        for a in range(0, n, TRANSFER_ROWS):
            b = min(n, a + TRANSFER_ROWS)
            recs = self.store.read_records(torch.arange(a, b)).numpy()
            i, buf = self._up.take(recs.nbytes)
            self.pool[a:b].copy_(_as_pinned(buf, recs), non_blocking=True)
            self._up.done(i, self._stream)
        self.loaded_rows = n

    # ------------------------------------------------------------------ writes
    def mark_dirty(self, slots: np.ndarray) -> None:
        with self._lock:
            self.dirty[slots] = True

    def _send_down(self, slots: np.ndarray, *, evicted: bool) -> tuple[np.ndarray, Tensor, torch.cuda.Event]:
        """Queue a device->host copy of ``slots``' records; applied to the store by `drain`."""
        ids = slots if self.resident else self.id_of[slots].copy()
        nbytes = len(slots) * self.pool.shape[1]
        i, buf = self._down_ring.take(nbytes)
        host = buf[:nbytes].view(len(slots), self.pool.shape[1])
        host.copy_(self.pool.index_select(0, self.to_device(slots)), non_blocking=True)
        ev = self._down_ring.done(i, self._stream)
        item = (ids, host, ev)
        self._down.append(item)
        self.dirty[slots] = False
        return item

    def _pending_overlap(self, ids: np.ndarray) -> bool:
        return any(np.isin(ids, item[0], assume_unique=True).any() for item in self._down)

    def drain(self) -> int:
        """Write the rows sent down so far into the host store (waits for their copies)."""
        with self._lock:
            n = 0
            while self._down:
                ids, host, ev = self._down[0]
                ev.synchronize()
                order = np.argsort(ids, kind="stable")
                self.store.write_records(torch.from_numpy(ids[order]), host[torch.from_numpy(order)])
                self._down.pop(0)
                n += len(ids)
            self.written_down_rows += n
            return n

    def write_down(self) -> int:
        """Bring every dirty row down into the host store (before a flush); returns rows written."""
        with self._lock, torch.cuda.stream(self._stream):
            self.drain()
            dirty = np.flatnonzero(self.dirty)
            n = 0
            for a in range(0, len(dirty), TRANSFER_ROWS):
                self._send_down(dirty[a : a + TRANSFER_ROWS], evicted=False)
                n += self.drain()
            return n

    def settle_evictions(self) -> None:
        """Apply evicted rows whose copies have finished (non-blocking; called once per step)."""
        with self._lock:
            while self._down and self._down[0][2].query():
                ids, host, _ = self._down[0]
                order = np.argsort(ids, kind="stable")
                self.store.write_records(torch.from_numpy(ids[order]), host[torch.from_numpy(order)])
                self._down.pop(0)
                self.written_down_rows += len(ids)

    def stats(self) -> dict[str, Any]:
        used = self.capacity if self.resident else self.capacity - self._nfree
        return {"device_rows": used, "device_capacity_rows": self.capacity, "device_bytes": self.nbytes,
                "device_dirty_rows": int(np.count_nonzero(self.dirty)), "device_loaded_rows": self.loaded_rows,
                "device_evicted_rows": self.evicted_rows}

    def close(self) -> None:
        """Free the device memory (after `write_down()`: unwritten rows are discarded)."""
        with self._lock:
            self._down.clear()
            self.pool = torch.empty(0, dtype=torch.uint8)
            self._views = {}
