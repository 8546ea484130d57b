"""EmbeddingStore: a row per id, tiered (hot RAM -> LZ4 warm -> disk), durable by flush.

Reads and writes go to the hot tier; misses are filled from the warm tier or from disk (base
chunk + delta segments). ``flush()`` writes only the dirty rows as one delta segment plus a small
manifest, so its cost follows the dirty bytes; background compaction folds segments into base
chunks. The store never imports Lightning.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from . import creation, foldproc, growth, guards
from .core import InitFn, StoreCore
from .creation import StridedNormal, strided_normal_spec
from .device_access import DeviceAccess, Guarded
from .disk import Disk
from .errors import (
    CorruptStoreError,
    InvalidArgumentError,
    InvalidTypeError,
)
from .hot import SLOT_OVERHEAD, HotTier
from .records import Records, Trainer
from .schema import DTYPES, Schema
from .stats import StoreStats, snapshot
from .tiers import SLICE_ROWS, Direct, FromSlab, Gathered, Tiers, to_np
from .validate import (
    MAX_CHUNK_ROWS,
    MAX_ROWS,
    as_ids,
    as_values,
    budget,
    check_meta,
    finite_float,
    positive_int,
    version_arg,
)
from .versions import Versions
from .warm import WarmTier

Init = str | InitFn
PathLike = str | os.PathLike | None


_LIVE: weakref.WeakSet[EmbeddingStore] = weakref.WeakSet()


class EmbeddingStore:
    """Rows keyed by int id with byte-budgeted tiers and crash-safe, versioned flushes.

    Example::

        with EmbeddingStore.create("runs/latents", num_rows=10_000_000, dim=64,
                                   hot_bytes=256 << 20, warm_bytes=128 << 20) as store:
            z = store.get(ids)              # (len(ids), 64) float32
            store.update(ids, z - 0.1 * g)  # last write of a duplicate id wins
            version = store.flush()         # durable when it returns

    Notes:
        ``hot_bytes=None`` keeps the whole table resident (memory mode); a budget turns on disk
        mode, where RAM use stays within ``hot_bytes + warm_bytes`` plus 4 bytes per table row
        for the id map (allocated only where touched). One writer per path; a writable store
        cannot be used in a forked child (open a ``readonly=True`` handle there).

    Raises:
        StoreError: and its subclasses, each naming the argument, its value and what is allowed.
    """

    # Composed of three parts (docs/architecture.md): ``_core`` (`StoreCore`: shape, initial
    # values, the state lock), ``_versions`` (`Versions`: the files, the writer lock, flushes,
    # compaction) and ``_tiers`` (`Tiers`: the hot and warm tiers). This class checks arguments
    # and state, then delegates; the parts never hold the store.

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        path: PathLike,
        num_rows: int,
        dim: int,
        dtype: torch.dtype = torch.float32,
        chunk_rows: int = 1024,
        hot_bytes: int | None = None,
        warm_bytes: int = 0,
        compression: str | None = None,
        init: Init = "zeros",
        *,
        seed: int = 0,
        init_std: float = 1.0,
        check_finite: bool = True,
        fields: Mapping[str, tuple] | None = None,
        materialize: bool = False,
    ) -> EmbeddingStore:
        """Create a new store (``path=None``: ephemeral, deleted on close).

        ``materialize=True`` (memory mode, ``hot_bytes=None``): every row's initial value is made
        now, in large vectorised blocks, instead of chunk by chunk on first use, so the first
        steps of a fit run at the steady speed (pay it once, up front)."""
        if not isinstance(materialize, bool):
            raise InvalidTypeError(f"materialize must be True or False; got {materialize!r}")
        if materialize and hot_bytes is not None:
            raise InvalidArgumentError(
                f"materialize=True fills a memory-mode table (hot_bytes=None) up front; got hot_bytes={hot_bytes!r}. "
                "In disk mode never-written rows cost nothing until read: leave materialize=False")
        num_rows = positive_int(num_rows, "num_rows", maximum=MAX_ROWS)
        dim = positive_int(dim, "dim", maximum=1 << 20)
        chunk_rows = positive_int(chunk_rows, "chunk_rows", maximum=MAX_CHUNK_ROWS)
        seed = positive_int(seed, "seed", minimum=0, maximum=(1 << 63) // 1_000_004)
        init_std = finite_float(init_std, "init_std")
        hot_bytes = budget(hot_bytes, "hot_bytes", allow_none=True)
        warm_bytes = cast(int, budget(warm_bytes, "warm_bytes", allow_none=False))
        foldproc.setting()  # a bad EMBCACHE_COMPACTION_PROCESS is named before anything is made
        meta = creation.new_meta(num_rows, dim, dtype, chunk_rows, compression, init, seed, init_std, fields)
        ephemeral = path is None
        root, made = creation.new_folder(path, hot_bytes)
        try:
            store = cls(
                root,
                meta,
                None,
                readonly=False,
                hot_bytes=hot_bytes,
                warm_bytes=warm_bytes,
                check_finite=check_finite,
                init_fn=None if isinstance(init, str) else init,
                ephemeral=ephemeral,
                create=True,
            )
            if materialize:
                try:
                    store._tiers.fill.materialize()
                except BaseException:
                    store.close()
                    raise
            return store
        except BaseException:
            creation.remove_failed(root, made, ephemeral)  # a correct create at the same path must work
            raise

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        version: int | None = None,
        readonly: bool = False,
        hot_bytes: int | None = None,
        warm_bytes: int = 0,
        *,
        check_finite: bool = True,
        init: InitFn | None = None,
    ) -> EmbeddingStore:
        """Open an existing store at its latest version, or at a retained ``version``."""
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidTypeError(f"path must be a str or os.PathLike; got {type(path).__name__}")
        root = Path(path)
        hot_bytes = budget(hot_bytes, "hot_bytes", allow_none=True)
        warm_bytes = cast(int, budget(warm_bytes, "warm_bytes", allow_none=False))
        foldproc.setting()  # a bad EMBCACHE_COMPACTION_PROCESS is named before anything is made
        if version is not None:
            version = version_arg(version, "version")
        if not root.is_dir():
            raise InvalidArgumentError(f"path={str(root)!r} is not a store directory (it does not exist)")
        if not (root / "META").exists():
            raise CorruptStoreError(root, "not a lightning_embcache store (no META file)")
        meta = Disk.read_meta(root)
        check_meta(meta, root / "META")
        if meta["init"] == "callable" and init is None:
            spec = strided_normal_spec(meta.get("init_spec"))
            if spec is None:
                raise InvalidArgumentError(
                    f"the store at {str(root)!r} was created with a callable init; pass the same function as init= "
                    "(from Python: the embcache commands cannot rebuild a function)"
                )
            init = StridedNormal(
                spec["stride"],
                spec["offset"],
                Schema.from_json(meta["schema"]).dim,
                int(meta["seed"]),
                float(meta["init_std"]),
            )
        return cls(
            root,
            meta,
            version,
            readonly=readonly,
            hot_bytes=hot_bytes,
            warm_bytes=warm_bytes,
            check_finite=check_finite,
            init_fn=init,
            ephemeral=False,
            create=False,
        )

    def __init__(
        self,
        root: Path | None,
        meta: dict,
        version: int | None,
        *,
        readonly: bool,
        hot_bytes: int | None,
        warm_bytes: int,
        check_finite: bool,
        init_fn: InitFn | None,
        ephemeral: bool,
        create: bool,
        grown: growth.Grown | None = None,
    ) -> None:
        """``grown`` (`grow`, growth.py): the new size and what the store keeps from before, the
        writer lock among them."""
        core = self._core = StoreCore(root, meta, readonly=readonly, check_finite=check_finite, init_fn=init_fn,
                                      ephemeral=ephemeral)
        self._io_wait = 0.0
        self._io_wait_by_thread: dict[int, float] = {}  # threading.get_ident() -> seconds
        self._dirty_estimate = 0  # rows written since the last background clean (an upper bound)
        if grown is not None:
            grown.kept.apply(self)
        versions = self._versions = Versions(core, grown.kept if grown is not None else None)
        capacity = None if hot_bytes is None else max(1, hot_bytes // (core.row_bytes + SLOT_OVERHEAD))
        try:
            versions.open(version, create=create, grown_rows=grown.num_rows if grown is not None else None)
            if capacity is not None and capacity >= core.num_rows:
                capacity = core.num_rows
            try:
                hot = HotTier(core.num_rows, core.row_bytes, core.chunk_rows, capacity, private=not readonly)
            except (MemoryError, OverflowError, ValueError, OSError) as exc:
                need = (capacity if capacity is not None else core.num_rows) * core.row_bytes
                raise InvalidArgumentError(
                    f"num_rows={core.num_rows} x {core.row_bytes}-byte records "
                    f"({'memory mode' if capacity is None else f'hot_bytes={hot_bytes}'}) needs {need} bytes of "
                    f"address space, which this machine cannot map ({type(exc).__name__}); give hot_bytes= "
                    f"(disk mode) or fewer rows"
                ) from None
        except BaseException as exc:
            versions.abandon(keep_lock=grown is not None)  # a growth's writer lock stays (growth.py reopens)
            if isinstance(exc, MemoryError):  # bookkeeping per chunk of an enormous table
                raise InvalidArgumentError(
                    f"num_rows={core.num_rows} with chunk_rows={core.chunk_rows} needs more memory for its "
                    f"bookkeeping than this machine has; give fewer rows or larger chunks"
                ) from None
            raise
        warm = WarmTier(warm_bytes if root is not None else 0, core.chunk_rows, core.row_bytes, core.num_chunks)
        tiers = self._tiers = Tiers(core, versions, hot, warm, hot_bytes)
        versions.attach(tiers.writeback)
        me = weakref.proxy(self)  # the parts hold the store weakly: it holds them
        self._device_access = DeviceAccess(core, tiers, cast(Guarded, me))  # device_access.py
        self._records = Records(core, tiers, self._device_access, cast(Trainer, me))  # records.py
        # memory mode's per-step paths read these instead of walking the schema on every call
        self._weight_np = tiers.np_views["weight"]
        self._weight_t = torch.from_numpy(self._weight_np)
        self._weight_bf16 = core.schema.dtype == torch.bfloat16
        self._weight_only = len(core.schema.fields) == 1
        core.closed = False
        _LIVE.add(self)
        if root is not None and not readonly:
            versions.compaction.maybe_compact()  # many short runs must not pile up segments no flush compacts
        if not readonly:
            tiers.fill.start_filling()

    # ------------------------------------------------------------------ properties
    path = property(lambda self: None if self._core.ephemeral else self._core.root,
                    doc="Store directory (None if ephemeral).")
    num_rows = property(lambda self: self._core.num_rows, doc="Rows in the table: ids are in [0, num_rows).")
    dim = property(lambda self: self._core.schema.dim, doc="Width of a row's weight vector.")
    dtype = property(lambda self: self._core.schema.dtype, doc="dtype of the weight vectors.")
    chunk_rows = property(lambda self: self._core.chunk_rows, doc="Rows per chunk file (the unit of disk reads).")
    readonly = property(lambda self: self._core.readonly, doc="True for a handle opened with readonly=True.")
    closed = property(lambda self: self._core.closed, doc="True once close() ran.")
    hot_bytes = property(lambda self: self._tiers.hot_budget, doc="Hot budget in bytes; None = whole table resident.")
    warm_bytes = property(lambda self: self._tiers.warm.budget,
                          doc="Warm (compressed chunk) budget in bytes; 0 = none.")
    version = property(lambda self: self._versions.version, doc="Version of the last completed flush (0 = as created).")
    field_names = property(lambda self: self._core.schema.names, doc="Names of a record's fields, 'weight' first.")
    # read by the layers over a store (device tiers, trainable rows), which also take other stores
    _check_finite = property(lambda self: self._core.check_finite, doc="Whether writes are checked for NaN/Inf.")
    _seed = property(lambda self: self._core.seed, doc="The seed of init='normal'.")

    @property
    def io_wait_seconds(self) -> float:
        """Seconds callers spent inside get/update/flush/prefetch so far, in every thread; O(1),
        unlike stats()."""
        return self._io_wait

    def thread_io_wait_seconds(self, thread: int | None = None) -> float:
        """Seconds one thread spent inside get/update/flush/prefetch so far: the calling thread's,
        or that of ``thread`` (a ``threading.get_ident()``). What a training step waited for: a
        flush in a background thread (`DeferredSync`) overlaps the step instead."""
        return self._io_wait_by_thread.get(threading.get_ident() if thread is None else thread, 0.0)

    def _waited(self, t0: float, rows: bool = True) -> None:
        """Count a call that began at ``t0`` as the calling thread's wait; ``rows``: a call that
        reads or writes rows (not a flush), whose thread is then the one training."""
        now = time.perf_counter()
        dt = now - t0
        self._io_wait += dt
        by = self._io_wait_by_thread
        me = threading.get_ident()
        by[me] = by.get(me, 0.0) + dt
        if rows:
            self._core.row_thread = me
            self._core.rows_used_at = now

    def field_spec(self, name: str) -> tuple[torch.dtype, int]:
        """(dtype, columns) of field ``name``."""
        f = self._core.schema.fields.get(name) if isinstance(name, str) else None
        if f is None:
            raise InvalidArgumentError(f"field {name!r} does not exist; this store has {list(self._core.schema.names)}")
        return f.dtype, f.cols

    # ------------------------------------------------------------------ public row API
    def get(self, ids: Any) -> torch.Tensor:
        """Rows of ``ids`` as a new (len(ids), dim) CPU tensor in the storage dtype."""
        t0 = time.perf_counter()
        self._check_usable()
        hot = self._tiers.hot
        if hot.all_loaded and type(ids) is torch.Tensor and ids.dtype is torch.int64 and ids.is_cpu and ids.dim() == 1:
            # Memory mode's steady state: one gather that checks its own bounds (negative ids too),
            # so the ids are validated without a pass of their own, on torch's intra-op threads.
            out = self._gather_checked(ids)
            self._core.stats.gets += 1
            self._waited(t0)
            return out
        idx = as_ids(ids, self._core.num_rows)
        if hot.all_loaded:  # other id forms (lists, numpy arrays), already validated
            with self._core.lock:
                self._core.check_open()
                out = self._tiers.take(idx, "weight")
        elif not hot.resident and len(idx) > SLICE_ROWS:
            out = self._sliced_get(idx, ("weight",))["weight"]
        else:
            with self._core.lock:
                out = self._read_rows(idx, ("weight",))["weight"]
        self._core.stats.gets += 1
        self._waited(t0)
        return out

    def update(self, ids: Any, values: Any) -> None:
        """Write rows; of duplicate ids in one call the last one wins. Not durable until flush()."""
        if not self._weight_only or not self._tiers.hot.resident:
            return self.update_fields(ids, {"weight": values})
        # Memory mode, weights only: the per-step path, kept to one validation pass per argument.
        t0 = time.perf_counter()
        self._check_usable(write=True)
        idx = as_ids(ids, self._core.num_rows)  # the store's own copy, checked: see as_ids
        v = as_values(
            values, len(idx), self._core.dim, self._core.dtype, arg="values", check_finite=self._core.check_finite
        )
        with self._core.lock:
            self._core.check_open()
            if self._tiers.hot.all_loaded and self._tiers.cow is None:  # steady state: one scatter + dirty marks
                self._weight_np[idx] = to_np(v)
                self._tiers.hot.mark_dirty(idx)
            else:
                self._tiers.scatter(cast(np.ndarray, self._tiers.resolve(idx, load=True)), {"weight": v})
        self._core.stats.updates += 1
        self._waited(t0)

    def get_fields(self, ids: Any, names: Sequence[str] = ("weight",)) -> dict[str, torch.Tensor]:
        """Several per-row fields of ``ids`` at once (e.g. weights and optimizer moments)."""
        t0 = time.perf_counter()
        self._check_usable()
        names = guards.check_names(self._core.schema, names)
        idx = as_ids(ids, self._core.num_rows)
        if not self._tiers.hot.resident and len(idx) > SLICE_ROWS:
            out = self._sliced_get(idx, names)
        else:
            with self._core.lock:
                out = self._read_rows(idx, names)
        self._core.stats.gets += 1
        self._waited(t0)
        return out

    def update_fields(self, ids: Any, values: Mapping[str, Any]) -> None:
        """Write several fields of ``ids``; fields not named keep their values."""
        t0 = time.perf_counter()
        self._check_usable(write=True)
        if not isinstance(values, Mapping) or not values:
            raise InvalidTypeError("values must be a non-empty mapping of field name -> tensor")
        names = guards.check_names(self._core.schema, tuple(values))
        idx = as_ids(ids, self._core.num_rows)
        vals = {}
        for n in names:
            dtype, cols = self.field_spec(n)
            arg = "values" if n == "weight" and len(names) == 1 else f"values[{n!r}]"
            vals[n] = as_values(values[n], len(idx), cols, dtype, arg=arg, check_finite=self._core.check_finite)
        full = set(names) == set(self._core.schema.names)
        if not self._tiers.hot.resident and len(idx) > SLICE_ROWS:
            # Disk mode stages a big call as one pending segment, streamed in blocks (bounded
            # temporaries), and applies it to resident rows only once that file is whole: a call
            # that fails on a full disk leaves none of its rows applied.
            with self._core.lock:
                self._core.check_open()
                self._tiers.writeback.write_around(idx, None, vals, load=not full)
            self._core.stats.updates += 1
            self._waited(t0)
            return
        with self._core.lock:
            self._core.check_open()
            # Validated and resolved before anything is written: a write-back that fails while
            # making room raises here, with no row of this call applied.
            slots = self._tiers.resolve(idx, load=not full, for_write=True, values=vals)
            if slots is not None:
                self._tiers.scatter(cast(np.ndarray, slots), vals)
            self._note_dirty(len(idx))
        self._core.stats.updates += 1
        self._waited(t0)

    def _note_dirty(self, n: int) -> None:
        """Keep evictions cheap for the training thread: once about half the hot slots may be
        dirty, write the cold ones back in the background (disk mode; caller holds the lock)."""
        if self._tiers.hot.resident:
            return
        self._dirty_estimate += n
        if self._dirty_estimate > self._tiers.hot.limit // 2:
            self._dirty_estimate = 0
            self._versions.clean_due = True
            self._versions.bg.submit("clean")

    # ------------------------------------------------------------------ whole records (trainers)
    def record_view(self, records: torch.Tensor, name: str) -> torch.Tensor:
        """Typed ``(n, cols)`` view of field ``name`` inside uint8 records from `read_records`."""
        guards.check_names(self._core.schema, (name,))
        return self._core.schema.view(records, name)

    @property
    def unflushed_share(self) -> float:
        """Bytes of rows written to disk since the last flush (dirty rows evicted from the hot
        tier), as a share of the table's bytes. They sit beside the last flushed version, which
        stays whole until the next flush commits them, so disk use grows with them between
        flushes (`DeferredSync(unflushed_share=...)` flushes before they pass a bound). O(1)."""
        return self._versions.pending_bytes / max(1, self._core.num_rows * self._core.row_bytes)

    @property
    def row_bytes(self) -> int:
        """Bytes of one record: the weight and every per-row field, packed and aligned."""
        return self._core.row_bytes

    def read_records(self, ids: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Whole records of ``ids`` (weight and every field) as a ``(n, row_bytes)`` uint8 tensor.

        For trainers that update a row and its optimizer state together: one gather of whole
        records from the contiguous pool, where `get_fields` gathers each field separately. The
        fields are read through `record_view`. ``out``: a contiguous CPU uint8 tensor of that
        shape to fill (e.g. pinned memory on its way to a GPU); default: a new one.
        """
        return self._records.read(ids, out)

    def write_records(self, ids: Any, records: torch.Tensor) -> None:
        """Write whole records (from `read_records`, changed in place) back; each id at most once.

        The weights are checked for NaN/Inf as `update` checks them (``check_finite``).
        """
        self._records.write(ids, records)

    # The resident table used in place (device_access.py): the trusted record copies of the device
    # tier's own rows and a device's reads and writes. The layers over the store call these names.
    def _read_records_trusted(self, idx: torch.Tensor, out: torch.Tensor) -> bool:
        return self._device_access.read_trusted(idx, out)

    def _write_records_trusted(self, idx: torch.Tensor, records: torch.Tensor) -> bool:
        return self._device_access.write_trusted(idx, records)

    def _resident_table(self) -> torch.Tensor | None:
        return self._device_access.table()

    def _device_write(self, idx: np.ndarray, enqueue: Callable[[], Any]) -> bool:
        return self._device_access.write(idx, enqueue)

    def _device_writing(self, idx: np.ndarray) -> contextlib.AbstractContextManager[Callable[[Any], None]]:
        return self._device_access.writing(idx)

    def _device_read(self, idx: np.ndarray) -> bool:
        return self._device_access.read(idx)

    def _await_device_writes(self) -> None:
        """Wait for the device writes queued into the table so far (`_device_write`)."""
        self._tiers.await_device_writes()

    def export(
        self, out: str | os.PathLike, field: str = "weight", version: int | None = None, *, overwrite: bool = False
    ) -> Path:
        """Write field ``field`` of every row, in id order, to the ``.npy`` file ``out``; returns its path.

        Streams a block of rows at a time (memory: the store's budgets plus a few MiB), so a
        table larger than RAM exports; ``np.load(out, mmap_mode="r")`` then reads it without
        loading it. ``version=None``: the rows as they are now, unflushed updates included; a
        retained version number: that flush's rows. bfloat16 fields are written as float32.
        The file appears whole or not at all.

        Raises:
            InvalidArgumentError: ``out`` exists (pass ``overwrite=True``) or its folder does not;
                an unknown ``field``.
            VersionNotFoundError: ``version`` is not retained.
        """
        from . import export

        self._check_usable()
        path = export.check_out(out, overwrite)
        guards.check_names(self._core.schema, (field,))
        if version is not None:  # that version's rows, through a read-only handle of it
            return export.export_version(self._core, version_arg(version, "version"), path, field, overwrite)
        dtype, cols = self.field_spec(field)
        return export.write_npy(
            path, (self._core.num_rows, cols), export.numpy_dtype(dtype), export.store_blocks(self, field)
        )

    def prefetch(self, ids: Any) -> None:
        """Hint: bring these rows into the hot tier in the background; returns at once."""
        self._check_usable()
        idx = as_ids(ids, self._core.num_rows)
        if self._versions.disk is None:
            return
        self._tiers.prefetch.later(idx)

    def _read_rows(self, idx: np.ndarray, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Fields of ``idx``, filling misses; caller holds the lock."""
        self._core.check_open()
        got = self._tiers.resolve(idx, load=True)
        if isinstance(got, Gathered):
            return self._tiers.fields_of(got.records, names)
        if isinstance(got, FromSlab):
            return self._tiers.gather_warm(idx, got.slots, got.missing, got.rows, names)
        if isinstance(got, Direct):
            return self._tiers.gather_direct(idx, got.slots, got.mids, got.records, names)
        return self._tiers.gather(cast(np.ndarray, got), names)

    def _sliced_get(self, idx: np.ndarray, names: Sequence[str]) -> dict[str, torch.Tensor]:
        out = {n: torch.empty((len(idx), self.field_spec(n)[1]), dtype=self.field_spec(n)[0]) for n in names}
        for a in range(0, len(idx), SLICE_ROWS):
            with self._core.lock:
                part = self._read_rows(idx[a : a + SLICE_ROWS], names)
            for n in names:
                out[n][a : a + SLICE_ROWS] = part[n]
        return out

    def _gather_checked(self, ids: torch.Tensor) -> torch.Tensor:
        """One gather that bounds-checks each id as it reads it (so an id changed by another
        thread meanwhile can fail the call but never reach a row it was not checked for)."""
        try:
            with self._core.lock:
                self._core.check_open()
                out = torch.index_select(self._weight_t, 0, ids)
        except (IndexError, RuntimeError):
            as_ids(ids, self._core.num_rows)  # raises the store's own error, naming the bad id
            raise InvalidArgumentError(  # the ids changed while the gather read them
                f"ids must be in [0, {self._core.num_rows}); an id out of range was read (the ids tensor "
                f"changed while get() ran)"
            ) from None
        return out.view(torch.bfloat16) if self._weight_bf16 else out

    def _valid_ids(self, ids: Any) -> np.ndarray:
        """``as_ids`` for this store: the store's own checked copy (no cache: see as_ids)."""
        return as_ids(ids, self._core.num_rows)

    # ------------------------------------------------------------------ flush and versions (Versions)
    def flush(self) -> int:
        """Make every update so far durable as a new version and return it.

        Thread-safe: may run in a background thread while another thread calls get/update;
        rows updated during the flush go into the next version.
        """
        t0 = time.perf_counter()
        self._check_usable(write=True)
        version = self._versions.flush()
        if self._versions.disk is not None:
            self._waited(t0, rows=False)
        return version

    def versions(self) -> list[int]:
        """Versions still on disk (openable with ``open(path, version=v)``)."""
        return self._versions.versions()

    def pin(self, version: int) -> None:
        """Never reclaim ``version`` (until unpinned); persisted across opens."""
        self._check_usable(write=True)
        self._versions.pin(version)

    def unpin(self, version: int) -> None:
        """Release a version kept by `pin`; retention may then reclaim it (not a reader's)."""
        self._check_usable(write=True)
        self._versions.unpin(version)

    def pinned(self) -> list[int]:
        """The pinned versions, oldest first."""
        return self._versions.pinned()

    def manifest_checksum(self, version: int) -> str:
        """Hex checksum of a version's manifest (checkpoints record it to detect a foreign store)."""
        return self._versions.manifest_checksum(version)

    def compact(self) -> None:
        """Fold every committed delta segment into base chunks now (normally automatic, in the
        background, a bounded round at a time). Each round is published at once (the version's
        manifest names the new layout of the same rows), so reopening and disk use follow.
        Segments newer than a pinned version that shares the chunk files stay: they hold the
        rows changed since it (docs/store-format.md, "Versions, pins and space")."""
        self._check_usable(write=True)
        self._versions.compact()

    # ------------------------------------------------------------------ budgets and hints (Tiers)
    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` of hot and warm memory (dirty rows written back first)."""
        self._check_usable()
        return self._tiers.writeback.evict(nbytes)

    def set_budget(self, hot_bytes: int | None = None, warm_bytes: int | None = None) -> None:
        """Change the budgets at run time (a lower budget evicts at once). None keeps a budget.

        Waits for a flush or background write-back in progress (rows they write cannot move)."""
        self._check_usable()
        self._tiers.writeback.set_budget(hot_bytes, warm_bytes)

    def upcoming(self, ids: Any) -> None:
        """Hint: a coming get will read these rows (`LookaheadSampler` calls this for each batch
        entering its window). They are loaded ahead of that get, and until it reads them,
        eviction prefers rows no coming batch reads. Returns at once. While rows come from the
        disk a prefetch thread loads them in the background; while they come from the page
        cache the next get that misses loads them with its own rows in one batch. With a warm
        tier, the kernel is asked for their chunks instead and the get reads them from the page
        cache (rows of chunks held warm are served from there, not the hot tier). In memory
        mode, or for a store without a path, this is `prefetch`."""
        self._check_usable()
        self._tiers.readahead.upcoming(self._valid_ids(ids))

    def read_seconds_per_row(self) -> float:
        """Recent wall time per row that `get` or the prefetch thread read below the hot tier
        (from the warm tier, the page cache or the disk); NaN before any such read.
        `LookaheadSampler` sizes its window from it: batches announced ahead cover the time a
        batch's rows take to arrive."""
        return self._tiers.readahead.read_seconds_per_row()
    # ------------------------------------------------------------------ growing
    def grow(self, num_rows: int) -> None:
        """Raise the table to ``num_rows`` rows; ids ``[old num_rows, num_rows)`` hold their initial
        values, the ones a store created at ``num_rows`` would hold. Durable with the next flush.

        Rows keep their values bit for bit, unflushed updates included; the version on disk keeps
        its size until the next flush publishes the new one (a crash before it, or opening an
        older version, gives the table as it was). ``num_rows`` equal to the current size does
        nothing. Not to be called while other threads use the store (they meet a closed store
        meanwhile); the tiers start cold afterwards, and the unflushed rows pass through memory
        once (flush first to keep that small).

        Raises:
            InvalidArgumentError: ``num_rows`` is below the current size (a store never shrinks)
                or past the id limit; nothing changes.
            InvalidTypeError: ``num_rows`` is not an int.
            ReadOnlyError: a read-only handle.
        """
        t0 = time.perf_counter()
        self._check_usable(write=True)
        n = growth.check_rows(self, num_rows)
        self._versions.bg.raise_error()
        if n == self._core.num_rows:
            return
        growth.grow(self, n)
        self._waited(t0, rows=False)

    def _wait_bg(self) -> None:
        """Wait for the background jobs queued so far (write-back, compaction, garbage collection):
        for tools and tests that report what stays once they are done."""
        self._versions.bg.wait()

    def _reopen_settings(self) -> dict:
        """The constructor's arguments that reopen this store as it is (`grow`)."""
        c = self._core
        return {
            "root": c.root, "meta": c.meta, "version": self._versions.version, "readonly": c.readonly,
            "hot_bytes": self._tiers.hot_budget, "warm_bytes": self._tiers.warm.budget,
            "check_finite": c.check_finite, "init_fn": c.init_fn, "ephemeral": c.ephemeral, "create": False,
        }

    # ------------------------------------------------------------------ stats, lifecycle
    def stats(self) -> StoreStats:
        """A snapshot of tier sizes, hit/miss counts, dirty rows and I/O totals."""
        self._check_owner()  # (a closed store still reports: no _check_usable)
        return snapshot(self._core, self._tiers, self._versions, self._io_wait)

    def close(self) -> None:
        """Release memory, threads, descriptors and the writer lock. Unflushed updates are discarded.

        Safe while other threads are inside calls: those finish first or raise StoreClosedError.
        """
        c = self._core
        with c.lock:
            if c.closed:
                return
            c.closed = True  # from here every call (and every call waiting for the lock) refuses
        self._versions.wake()
        same_process = c.pid == os.getpid()
        self._stop_background()
        with self._versions.flush_lock:  # a flush or compaction of another thread finishes first
            with c.lock:
                self._close_files()
        self._versions.release()
        # An ephemeral store's folder belongs to the process that made it: a forked child that
        # closes its copy must not delete the parent's files.
        if c.ephemeral and c.root is not None and same_process:
            shutil.rmtree(c.root, ignore_errors=True)

    def _stop_background(self) -> None:
        """Let the device's writes finish and stop the store's threads (`close`, `grow`)."""
        if self._core.pid != os.getpid():
            return
        self._await_device_writes()  # a device still writing the table finishes before it is freed
        self._tiers.prefetch.stop()
        self._versions.bg.stop()
        self._tiers.fill.stop()

    def _close_files(self) -> None:
        """Free the tiers and close every file but the writer lock (caller holds both locks)."""
        self._versions.close_files()
        self._tiers.close()
        self._weight_np = self._weight_t = None  # type: ignore[assignment]  # views of the pool just freed

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            core = self._core
            if not core.closed:
                if core.pid == os.getpid():
                    self.close()
                else:  # a forked child's copy: drop our descriptors only, never the parent's files
                    core.closed = True
        except Exception:
            pass

    def __repr__(self) -> str:
        hot_budget = self._tiers.hot_budget
        mode = "memory" if hot_budget is None else f"disk, hot_bytes={hot_budget}"
        return (
            f"EmbeddingStore(path={str(self.path) if self.path else None!r}, num_rows={self._core.num_rows}, "
            f"dim={self.dim}, dtype={self.dtype}, {mode}, version={self._versions.version})"
        )

    # ------------------------------------------------------------------ guards
    def _check_usable(self, write: bool = False) -> None:
        if self._tiers.device_pending is not None:  # every public call sees the device's writes whole
            self._await_device_writes()
        self._check_state(write)

    def _check_state(self, write: bool = False) -> None:
        guards.check_state(self._core, write)

    def _check_owner(self) -> None:
        guards.check_owner(self._core)

    def _after_fork_in_child(self) -> None:
        # Threads do not survive fork and a lock may have been held: start clean in the child.
        self._core.after_fork()
        self._versions.after_fork()
        self._tiers.after_fork()


def _reinit_after_fork() -> None:
    for store in list(_LIVE):
        store._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)

__all__ = ["EmbeddingStore", "DTYPES"]
