"""Memory mode's table used in place: rows made on demand, trusted copies, a device's reads and writes.

In memory mode every record lies in the hot tier's pool at its id. `DeviceAccess` is the part of
`EmbeddingStore` that hands that table to the layers over the store that bring their own
checks: the GPU tiers (device_tier.py, host_mapped_tier.py) read and write it in place, and the
device tier's own rows are copied without the public calls' validation (`read_trusted`,
`write_trusted`). Every call refuses (False, nothing done) where the table is not resident or a
flush is copying rows out, and the caller falls back to the public path. It sees the store as
`Guarded` (held weakly: the store holds this); the store keeps its private names for these
(`_device_read`, `_device_write`, ...) as thin delegators, which those layers call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from .core import StoreCore
from .errors import StoreClosedError
from .tiers import SLICE_ROWS, Tiers


class Guarded(Protocol):
    """What device access asks of `EmbeddingStore`: the guards of its calls and their wait count."""

    def _check_usable(self, write: bool = False) -> None: ...

    def _check_state(self, write: bool = False) -> None: ...

    def _waited(self, t0: float, rows: bool = True) -> None: ...


class DeviceAccess:
    """The resident table used in place (see the module)."""

    def __init__(self, core: StoreCore, tiers: Tiers, store: Guarded) -> None:
        self._c = core
        self._t = tiers
        self._s = store  # a weak proxy: the store holds this

    def resident_rows(self, idx: np.ndarray) -> bool:
        """Memory mode: make sure rows ``idx`` (validated) are in the pool, whose slots are the
        ids, making those not made yet; False in disk mode. Caller holds the lock. O(batch): a
        table touched only in part keeps the one-gather paths."""
        hot = self._t.hot
        if not hot.resident:
            return False
        if not hot.all_loaded:  # checked a slice at a time: a huge batch's temporaries stay bounded
            for a in range(0, len(idx), SLICE_ROWS):
                part = idx[a : a + SLICE_ROWS]
                if hot.lookup(part) is not part:
                    self._t.resolve(part, load=True)
        return True

    # Trusted record copies for the device tier's own rows (ids it validated, unique; weights it
    # checked with one sum). Each is one copy that releases the GIL once: a background thread beside
    # a busy training thread waits for the GIL after every release. False: not in memory mode's
    # steady state; nothing was done, use read_records/write_records.
    def read_trusted(self, idx: torch.Tensor, out: torch.Tensor) -> bool:
        t0 = time.perf_counter()
        self._s._check_usable()
        with self._c.lock:
            if self._c.closed or not self.resident_rows(idx.numpy()):
                return False
            torch.index_select(self._t.hot.pool, 0, idx, out=out)  # bounds-checked, intra-op threads
        self._c.stats.gets += 1
        self._s._waited(t0)
        return True

    def write_trusted(self, idx: torch.Tensor, records: torch.Tensor) -> bool:
        t0 = time.perf_counter()
        self._s._check_usable(write=True)
        with self._c.lock:
            i = idx.numpy()
            if self._c.closed or self._t.cow is not None or not self.resident_rows(i):
                return False
            self._t.hot.pool_np[i] = records.numpy()
            self._t.hot.mark_dirty(i)
        self._c.stats.updates += 1
        self._s._waited(t0)
        return True

    # ------------------------------------------------------------------ a device writing the table
    def table(self) -> torch.Tensor | None:
        """Memory mode: the ``(num_rows, row_bytes)`` host tensor holding every record at its id,
        which a device may read and write in place (`mapped_host`); None in disk mode."""
        if self._c.closed or self._c.readonly or not self._t.hot.resident:
            return None
        return self._t.hot.pool

    def write(self, idx: np.ndarray, enqueue: Callable[[], Any]) -> bool:
        """Let a device write the records of validated ``idx`` into `table` in place.

        Under the lock: refuses (False, nothing done) while a flush is copying rows out (its
        snapshot must not change under it) or in disk mode; else makes the rows if needed, marks
        them dirty and calls ``enqueue()``, which queues the device's write and returns an object
        whose ``synchronize()`` waits for it. Host reads of the table wait for it first
        (`Tiers.await_device_writes`), so no reader sees a row half written.
        """
        self._s._check_state(write=True)  # no wait: the device orders its own writes
        with self._c.lock:
            if self._c.closed or self._t.cow is not None or not self._t.hot.resident:
                return False
            with self.writing(idx) as queued:
                queued(enqueue())
        return True

    @contextlib.contextmanager
    def writing(self, idx: np.ndarray) -> Iterator[Callable[[Any], None]]:
        """Queue device kernels that write the records of validated ``idx`` in `table` inside
        this block; pass the object whose ``synchronize()`` waits for them to the callable it
        yields. Under the lock: rows a flush is still copying out are saved first (its snapshot
        stays one moment), the rows are dirty afterwards, and host reads wait for the kernels."""
        self._s._check_state(write=True)
        with self._c.lock:
            if self._c.closed:
                raise StoreClosedError("this EmbeddingStore is closed; open it again with EmbeddingStore.open(path)")
            self.resident_rows(idx)  # made first: making them later would overwrite the device's rows
            if self._t.cow is not None:
                self._t.save_cow(idx)
            queued: list[Any] = []
            yield queued.append
            if queued:
                self._t.device_pending = queued[-1]
            self._t.hot.mark_dirty(idx)
        self._c.stats.updates += 1

    def read(self, idx: np.ndarray) -> bool:
        """Whether a device may read the records of validated ``idx`` from `table` now (memory
        mode; rows not made yet are made first). The device orders its reads after its own
        writes; the host writes nothing to these rows meanwhile but `update` calls."""
        self._s._check_state()
        with self._c.lock:
            return not self._c.closed and self.resident_rows(idx)
