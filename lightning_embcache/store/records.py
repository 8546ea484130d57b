"""Whole records (weight and every field) read and written at once: `read_records`/`write_records`.

`Records` is the part of `EmbeddingStore` that serves trainers updating a row and its optimizer
state together: one gather or scatter of whole records from the contiguous pool in memory mode,
whole records through the tiers in disk mode (in slices: bounded memory), a batch larger than a
slice written as one pending segment (all or nothing, `update_fields`). It sees the store as
`Trainer` (held weakly: the store holds this).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch

from . import rowcopy
from .core import StoreCore
from .device_access import DeviceAccess, Guarded
from .errors import InvalidArgumentError
from .tiers import SLICE_ROWS, Tiers
from .validate import check_finite


class Trainer(Guarded, Protocol):
    """What the whole-record calls ask of `EmbeddingStore` besides its guards."""

    def _valid_ids(self, ids: Any) -> np.ndarray: ...

    def _note_dirty(self, n: int) -> None: ...

    def update_fields(self, ids: Any, values: Mapping[str, Any]) -> None: ...


class Records:
    """`EmbeddingStore.read_records` and `write_records` (see the module)."""

    def __init__(self, core: StoreCore, tiers: Tiers, access: DeviceAccess, store: Trainer) -> None:
        self._c = core
        self._t = tiers
        self._access = access
        self._s = store  # a weak proxy: the store holds this

    def read(self, ids: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """`EmbeddingStore.read_records`."""
        t0 = time.perf_counter()
        self._s._check_usable()
        idx = self._s._valid_ids(ids)
        shape = (len(idx), self._c.row_bytes)
        if out is not None and (
            type(out) is not torch.Tensor
            or out.dtype != torch.uint8
            or out.is_cuda
            or tuple(out.shape) != shape
            or not out.is_contiguous()
        ):
            raise InvalidArgumentError(
                f"out must be a contiguous CPU uint8 tensor of shape {shape}; got "
                f"{getattr(out, 'dtype', type(out).__name__)} of shape "
                f"{tuple(getattr(out, 'shape', ()))}"
            )
        if out is None and not self._t.hot.resident and len(idx) <= SLICE_ROWS:
            # disk mode, one slice: the tiers' gather of whole records is the result (no copy)
            with self._c.lock:
                self._c.check_open()
                out = torch.from_numpy(self._t.records_into(idx))
            self._c.stats.gets += 1
            self._s._waited(t0)
            return out
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8)
        dest = out.numpy()
        if self._t.hot.resident:  # memory mode: the rows' pool slots are their ids, once made
            with self._c.lock:
                self._c.check_open()
                self._access.resident_rows(idx)
                rowcopy.gather(self._t.hot.pool_np, idx, dest)
        else:  # rows to bring in first: whole records through the tiers, in slices (bounded memory)
            step = len(idx) if self._t.hot.resident else SLICE_ROWS
            for a in range(0, len(idx), max(step, 1)):
                with self._c.lock:
                    self._c.check_open()
                    self._t.records_into(idx[a : a + step], dest[a : a + step])
        self._c.stats.gets += 1
        self._s._waited(t0)
        return out

    def write(self, ids: Any, records: torch.Tensor) -> None:
        """`EmbeddingStore.write_records`."""
        t0 = time.perf_counter()
        self._s._check_usable(write=True)
        idx = self._s._valid_ids(ids)
        if (
            type(records) is not torch.Tensor
            or records.dtype != torch.uint8
            or records.is_cuda
            or tuple(records.shape) != (len(idx), self._c.row_bytes)
        ):
            raise InvalidArgumentError(
                f"records must be a CPU uint8 tensor of shape ({len(idx)}, {self._c.row_bytes}) from "
                f"read_records(); got {getattr(records, 'dtype', type(records).__name__)} of shape "
                f"{tuple(getattr(records, 'shape', ()))}"
            )
        w = self._c.schema.view(records, "weight")
        if self._c.check_finite and len(idx):
            check_finite(w, arg="records (weight)")
        big = not self._t.hot.resident and len(idx) > SLICE_ROWS
        if big:  # staged as one pending segment, all or nothing (see update_fields)
            self._s.update_fields(idx, {n: self._c.schema.view(records, n) for n in self._c.schema.names})
            self._c.stats.updates -= 1  # counted once, below
        else:
            with self._c.lock:
                self._c.check_open()
                if self._t.cow is None and self._access.resident_rows(idx):
                    rowcopy.scatter(self._t.hot.pool_np, idx, records.numpy())
                    self._t.hot.mark_dirty(idx)
                else:  # whole records through the tiers: no field-by-field path
                    self._t.write_records_into(idx, records.numpy())
                    self._s._note_dirty(len(idx))
        self._c.stats.updates += 1
        self._s._waited(t0)
