"""What every part of an EmbeddingStore shares: the table's shape, its initial values, the state lock.

`EmbeddingStore` is composed of a `Versions` (versions.py: the files, flushes, compaction) and
a `Tiers` (tiers.py: the hot and warm tiers over them). Both hold this object, not the store:
the shape and schema, the initial value of a never-written row, the lock that guards in-memory
state (``lock``), the statistics, and whether the store was closed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from . import idsets
from .errors import InvalidArgumentError, StoreClosedError
from .initrows import normal_rows
from .schema import Schema
from .stats import StoreStats

InitFn = Callable[[torch.Tensor], torch.Tensor]


class StoreCore:
    """The table's shape and the state every component of one store shares.

    ``num_rows`` is set by the version opened (a grown store's manifests record its size); the
    rest is fixed for the life of the handle. ``lock`` guards in-memory state (get/update take it
    briefly; the writer lock of `Versions` is always taken before it). ``closed`` turns every call
    (and every background job at its next look) away."""

    def __init__(self, root: Path | None, meta: dict, *, readonly: bool, check_finite: bool,
                 init_fn: InitFn | None, ephemeral: bool) -> None:
        self.root = root
        self.ephemeral = ephemeral
        self.meta = meta
        self.schema = Schema.from_json(meta["schema"])
        self.num_rows = int(meta["num_rows"])
        self.chunk_rows = int(meta["chunk_rows"])
        self.row_bytes = self.schema.row_bytes
        self.compress = meta["compression"] == "lz4"
        self.init_kind = meta["init"]
        self.init_fn = init_fn
        self.seed = int(meta["seed"])
        self.init_std = float(meta["init_std"])
        self.readonly = bool(readonly)
        self.check_finite = bool(check_finite)
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.stats = StoreStats()
        self.closed = True  # until the store is fully constructed
        self.row_thread = 0  # the thread of the latest get/update (compaction hands it the GIL)
        self.rows_used_at = -float("inf")  # perf_counter when the latest get/update/lookup of rows returned

    @property
    def dim(self) -> int:
        return self.schema.dim

    @property
    def dtype(self) -> torch.dtype:
        return self.schema.dtype

    @property
    def num_chunks(self) -> int:
        return (self.num_rows + self.chunk_rows - 1) // self.chunk_rows

    def after_fork(self) -> None:
        """In a forked child: a lock another thread held at the fork would never be let go of."""
        self.lock = threading.RLock()
    # ------------------------------------------------------------------ guards
    def check_open(self) -> None:
        """Inside the lock: a close() of another thread may have run since `EmbeddingStore._check_usable`."""
        if self.closed:
            raise StoreClosedError(
                "this EmbeddingStore was closed (by another thread) during the call; "
                "open it again with EmbeddingStore.open(path)"
            )

    def init_rows(self, ids: np.ndarray) -> np.ndarray:
        """Records of never-written ``ids`` (sorted), computed per row (no whole chunk needed)."""
        recs = np.zeros((len(ids), self.row_bytes), np.uint8)
        t = torch.from_numpy(recs)
        if self.init_kind == "callable":
            assert self.init_fn is not None
            vals = self.init_fn(torch.from_numpy(ids))
            if not isinstance(vals, torch.Tensor) or tuple(vals.shape) != (len(ids), self.dim):
                raise InvalidArgumentError(
                    f"init(ids) must return a tensor of shape ({len(ids)}, {self.dim}); got "
                    f"{tuple(vals.shape) if isinstance(vals, torch.Tensor) else type(vals).__name__}"
                )
            self.schema.view(t, "weight")[:] = vals.detach().cpu().to(self.dtype)
        elif self.init_kind == "normal":
            if self.meta.get("init_version", 1) >= 2:
                self.normal_into(self.schema.view(t, "weight"), ids)
            else:  # a store created before per-row init: its rows come from a per-chunk generator
                cr = self.chunk_rows
                chunks = ids // cr
                bounds = idsets.runs(chunks)
                for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                    c = int(chunks[a])
                    rows = min(cr, self.num_rows - c * cr)
                    recs[a:b] = self.init_records(c, rows)[ids[a:b] - c * cr]
                return recs
        for f in self.schema.fields.values():
            if f.name != "weight" and f.fill:
                self.schema.view(t, f.name)[:] = f.fill
        return recs

    def normal_into(self, w: torch.Tensor, ids: np.ndarray) -> None:
        """The seeded normal initial values of ``ids`` into ``w`` (a weight view of records)."""
        if self.dtype == torch.float32:  # straight into the records: no temporary, no copy
            normal_rows(ids, self.dim, self.seed, self.init_std, out=w.numpy())
        else:
            w[:] = torch.from_numpy(normal_rows(ids, self.dim, self.seed, self.init_std)).to(self.dtype)

    def init_in_place(self) -> bool:
        """Whether initial values can be written straight into a fresh (zeroed) pool, from any
        thread: zeros, or the per-row seeded normals, in float32."""
        if self.init_kind == "zeros":
            return True
        return (self.init_kind == "normal" and self.meta.get("init_version", 1) >= 2
                and self.dtype == torch.float32)

    def init_records(self, chunk: int, rows: int) -> np.ndarray:
        recs = np.zeros((rows, self.row_bytes), np.uint8)
        t = torch.from_numpy(recs)
        lo = chunk * self.chunk_rows
        w = self.schema.view(t, "weight")
        if self.init_kind == "normal":
            if self.meta.get("init_version", 1) >= 2:
                self.normal_into(w, np.arange(lo, lo + rows))
            else:  # stores created before per-row init keep their per-chunk generator
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + chunk)
                w[:] = (torch.randn(rows, self.dim, generator=g, dtype=torch.float32) * self.init_std).to(self.dtype)
        elif self.init_kind == "callable":
            assert self.init_fn is not None
            ids = torch.arange(lo, lo + rows)
            vals = self.init_fn(ids)
            if not isinstance(vals, torch.Tensor) or tuple(vals.shape) != (rows, self.dim):
                raise InvalidArgumentError(
                    f"init(ids) must return a tensor of shape ({rows}, {self.dim}); got "
                    f"{tuple(vals.shape) if isinstance(vals, torch.Tensor) else type(vals).__name__}"
                )
            w[:] = vals.detach().cpu().to(self.dtype)
        for f in self.schema.fields.values():
            if f.name != "weight" and f.fill:
                self.schema.view(t, f.name)[:] = f.fill
        return recs



def stop_executor(ex: ThreadPoolExecutor | None, wait: bool = True) -> None:
    """Stop a store's thread ``ex`` (``wait``: for its job to end). The last reference to a store
    may drop on one of its own threads (a prefetch finishing): that thread cannot join itself, and
    closing must go on."""
    if ex is None:
        return
    me = threading.current_thread()
    own = any(t is me for t in getattr(ex, "_threads", ()))
    ex.shutdown(wait=wait and not own, cancel_futures=True)
