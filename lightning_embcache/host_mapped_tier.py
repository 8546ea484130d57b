"""HostMappedTier: rows that stay in host RAM and train on the GPU in place.

A memory-mode table registered with CUDA (`mapped_host`) is the tier's pool: slot == id, every
lookup is a gather the GPU makes over the bus from host memory, and the fused row optimizer
updates weights and moments there. Nothing is copied on the host and there is no slot to choose,
so a step's host work is the index transfer whatever the table's size; the bus carries only the
batch's records (about 3x a row's weight bytes each way for Adam).

The store stays the truth: every kernel that writes rows is queued under the store's lock
(`EmbeddingStore._device_writing`), which marks the rows dirty, keeps a flush's snapshot whole
(rows a flush is still copying are saved first) and lets host reads wait for the queued writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_embcache.device_tier import TRANSFER_ROWS, DeviceTier
from lightning_embcache.mapped_host import MappedHost, store_table
from lightning_embcache.store import EmbeddingStore, StoreError


class HostMappedTier(DeviceTier):
    """The rows of memory-mode ``store`` trained on ``device`` where they lie in host RAM.

    Build it with `create`, which returns None where the table cannot be mapped (disk mode, a
    readonly store, no CUDA, ``EMBCACHE_MAPPED_HOST=0``). Uses no device memory for rows.
    """

    def __init__(self, store: EmbeddingStore, device: torch.device | str, mapped: MappedHost) -> None:
        self._host = mapped
        super().__init__(store, device, store.num_rows * (store.row_bytes + 26))

    @classmethod
    def create(cls, store: EmbeddingStore, device: torch.device | str) -> HostMappedTier | None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        mapped = MappedHost.try_register(store_table(store), device)
        if mapped is None:
            return None
        # a first batch makes its own rows, not their whole chunks (a 4096-id batch of a 20M-row
        # table would make a fifth of it); the background fill makes the rest
        store._tiers.rows_on_first_touch = True  # a switch of the store's tiers
        return cls(store, device, mapped)

    def _make_pool(self, capacity: int, row_bytes: int) -> Tensor:
        return self._host.dev

    def _load_all(self) -> None:  # the pool is the table
        self.loaded_rows = self.store.num_rows

    @property
    def nbytes(self) -> int:
        return 0

    # ------------------------------------------------------------------ reads and writes
    def ready(self, ids: np.ndarray) -> None:
        if not self._timed_store(self.store._device_read, ids):
            raise StoreError("the store behind this device tier is closed; open it again")

    def positions(self, ids: np.ndarray, protect: np.ndarray | None = None) -> np.ndarray:
        self.ready(ids)
        return ids

    def slots(self, ids: np.ndarray, protect: np.ndarray | None = None) -> np.ndarray:
        self.ready(ids)
        return ids

    @contextmanager
    def writing(self, slots: np.ndarray) -> Iterator[None]:
        with self._step_lock, self.store._device_writing(slots) as queued:
            yield
            done = torch.cuda.Event()
            done.record(self._stream)
            queued(done)
            self.dirty[slots] = True

    def write_down(self) -> int:
        """Wait for the rows' queued writes and refuse NaN/Inf weights among the rows changed
        since the last write-down (before a flush); returns those rows' count."""
        with self._step_lock, self._io():
            dirty = np.flatnonzero(self.dirty)
            if getattr(self.store, "_check_finite", True):
                for a in range(0, len(dirty), TRANSFER_ROWS):
                    rows = self.view("weight").index_select(0, self.to_device(dirty[a : a + TRANSFER_ROWS]))
                    if not bool(torch.isfinite(rows).all()):
                        raise StoreError(
                            "NaN or Inf weights were trained into the host table; the store refuses to flush "
                            "them (lower the learning rate or clip gradients, then resume from the last checkpoint)")
            self.store._await_device_writes()
            self.dirty[dirty] = False
            self.written_down_rows += len(dirty)
            return len(dirty)

    def drain(self) -> int:
        self.store._await_device_writes()
        return 0

    def stats(self) -> dict[str, Any]:
        st = super().stats()
        st["device_mapped_host"] = True
        return st

    def close(self) -> None:
        with self._lock:
            if not self.store.closed:
                self.store._await_device_writes()
            torch.cuda.current_stream(self.device).synchronize()
            self._host.close()
            self.pool = torch.empty(0, dtype=torch.uint8)
            self._views = {}
