"""`EmbeddingStoreHandle`: a module's view of one store, rows in and rows out on the module's device."""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_embcache.device_tier import SLOT_OVERHEAD, DeviceTier
from lightning_embcache.host_mapped_tier import HostMappedTier
from lightning_embcache.optim.base import RowOptimizer
from lightning_embcache.optim.clip import renorm_rows
from lightning_embcache.pinned import PinnedRing
from lightning_embcache.store.validate import as_ids
from lightning_embcache.trainable import TrainableRows

if TYPE_CHECKING:
    from lightning_embcache.store import EmbeddingStore, StoreStats

log = logging.getLogger(__name__)
_sync_warning = WarningCache()


def _store_class() -> Any:
    # Imported late so that this module (and its unit tests with a fake store) loads on its own.
    from lightning_embcache.store import EmbeddingStore

    return EmbeddingStore


def _store_errors() -> Any:
    from lightning_embcache.store import errors

    return errors


def store_exists(path: Path) -> bool:
    """True when `path` already holds something (the store decides whether it is a store)."""
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


# StoreStats fields that count since the store opened, beyond StoreStats.counter_fields()
_MORE_COUNTERS = ("io_wait_seconds", "bytes_read", "bytes_written", "write_back_seconds", "warm_hits", "warm_misses",
                  "warm_bytes_read", "warm_bytes_written")

#: what a handle does when its path already holds a store it did not create and no checkpoint names
IF_EXISTS = ("error", "resume", "overwrite")

# path -> the handle of this process holding that store open for writing (one writer per path)
_writers: dict[Path, Callable[[], EmbeddingStoreHandle | None]] = {}


def _store_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Runs a handle method eagerly: a graph break under ``torch.compile`` (the store is host code
    with numpy and locks, nothing to trace), and outside inference mode, so the store never keeps
    an inference tensor that a later training step would have to update in place. Inference
    tensors passed in (ids of an evaluation batch) are cloned; that costs one copy of the ids."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return fn(self, *args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            args = tuple(_normal_tensor(a) for a in args)
            kwargs = {k: _normal_tensor(v) for k, v in kwargs.items()}
            return fn(self, *args, **kwargs)

    return torch.compiler.disable(call)


def _normal_tensor(a: Any) -> Any:
    return a.clone() if isinstance(a, torch.Tensor) and a.is_inference() else a


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return -1


class EmbeddingStoreHandle:
    """A per-sample table owned by a LightningModule.

    Made by :meth:`EmbeddingStoreMixin.add_embedding_store`. The store behind it is opened when
    training sets up (created if absent) and whenever a method needs it, so the handle also works
    before and after ``fit``. It is a plain object, not an ``nn.Module``: Lightning never moves it,
    never puts it in ``state_dict`` and never all-reduces it.

    Example::

        z = self.latents.get(ids)           # (len(ids), dim) on the module's device, store dtype
        self.latents.update(ids, z_new)     # direct write, any device, cast to the store dtype

    Notes:
        - ``get`` returns a fresh tensor. On a CUDA module it is staged through a pinned host buffer
          and copied with ``non_blocking=True``; two buffers alternate, each guarded by a CUDA event,
          so a copy in flight is never overwritten.
        - ``update`` detaches ``values``; these rows are not trained by autograd (``lookup`` is).
    """

    def __init__(
        self,
        name: str,
        num_rows: int,
        dim: int,
        *,
        path: Path | None,
        create_options: dict[str, Any],
        open_options: dict[str, Any],
        optim_config: dict[str, Any],
        module: torch.nn.Module | None = None,
        if_exists: str = "error",
        device_bytes: int | None = None,
    ) -> None:
        self.name = name
        self.device_bytes = device_bytes
        self._device_tier: DeviceTier | None = None
        self._unmapped: EmbeddingStore | None = None  # a store whose table could not be mapped
        self.num_rows = num_rows  # the open store's rows: `grow` and a checkpoint's version move it
        self._declared_rows = num_rows  # add_embedding_store's: a store it opens holds at least these
        self.dim = dim
        self.path = path
        self.dtype: torch.dtype = create_options.get("dtype", torch.float32)
        self.optim_config = optim_config
        self._row_optimizer: RowOptimizer | None = None  # set by add_embedding_store(optimizer=...)
        self._max_grad_norm: float | None = None
        self._row_options: dict[str, Any] = {}  # max_norm, norm_type, stochastic_rounding
        self._trainable: TrainableRows | None = None
        self._manual_steps = 0
        self._create_options = create_options
        self._open_options = open_options
        self._store: EmbeddingStore | None = None
        # figures of the stores this handle opened and closed: stats() after fit is not zeros
        self._last_stats: StoreStats | None = None
        self._earlier_counters: dict[str, float] = {}
        # Version to open next (set by a checkpoint being loaded); None = the latest flush.
        self._target_version: int | None = None
        self._target_checksum: str | None = None
        self._target_from_checkpoint = False
        self.if_exists = if_exists
        # True once this handle may write the store at `path`: it created it, a checkpoint named
        # one of its versions, or `if_exists` allowed taking over rows it found there.
        self._claimed = False
        # True while the open store is an in-memory stand-in for a path that holds nothing yet
        # (a read before anything was written); a write replaces it with the store on disk.
        self._stand_in = False
        self._in_fit = False  # set by the mixin between setup and teardown of a fit
        # host ids of get/lookup/update while the mixin checks that its loader's indices are ids
        self._noted: list[torch.Tensor] | None = None
        # Serialises open/flush/close; get/update never take it, so a background flush does not
        # stall the training thread.
        self._lifecycle = threading.RLock()
        self._staging = PinnedRing(2)
        self._module_ref: Callable[[], torch.nn.Module | None] = lambda: None
        if module is not None:
            self._bind(module)

    # ------------------------------------------------------------------ public surface
    @property
    def store(self) -> EmbeddingStore:
        """The open `EmbeddingStore` (opened writable if needed), for anything the handle does not wrap."""
        return self._ensure_open(writable=True)

    @_store_call
    def get(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for `ids` as a fresh tensor on the module's device, in the store dtype."""
        self._settle()
        store = self._ensure_open(writable=False)
        tier = self._tier(store)
        if tier is not None:
            return tier.gather(self._valid_ids(store, ids), protect=self._held_slots())
        rows = store.get(self._host_ids(ids))
        device = self._device()
        if device.type == "cpu":
            return rows
        return self._staging.to_device(rows, device)

    @_store_call
    def update(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` (any device, detached, cast to the store dtype) to rows `ids`."""
        store = self._ensure_open(writable=True)
        tier = self._tier(store)
        if tier is not None:
            idx = self._valid_ids(store, ids)
            values = values.detach()
            if tuple(values.shape) != (len(idx), self.dim):
                raise _store_errors().InvalidArgumentError(
                    f"values must have shape ({len(idx)}, {self.dim}) to match ids; got {tuple(values.shape)}")
            tier.scatter(idx, values.to(tier.device, self.dtype), protect=self._held_slots())
            return
        ids = self._host_ids(ids)
        values = values.detach()
        if values.device.type != "cpu" or values.dtype != self.dtype:
            values = values.to("cpu", self.dtype)
        store.update(ids, values)

    @_store_call
    def prefetch(self, ids: torch.Tensor) -> None:
        """Non-blocking hint: bring rows `ids` into the hot tier (or the device tier) before they
        are needed. With a device tier the rows' copies are queued at once, so call it with the
        next batch's ids after this step's lookups."""
        store = self._ensure_open(writable=False)
        tier = self._tier(store)
        if tier is not None:
            tier.prefetch(self._valid_ids(store, ids, note=False), self._held_slots())
            return
        store.prefetch(self._host_ids(ids, note=False))

    @_store_call
    def upcoming(self, ids: torch.Tensor) -> None:
        """Non-blocking hint that a coming batch reads rows `ids` (`LookaheadSampler(sampler,
        model.codes)` calls it for each batch entering its window). With a device tier the rows are
        brought to the GPU now and kept there until that batch is looked up; otherwise it is the
        store's ``upcoming``."""
        store = self._ensure_open(writable=False)
        tier = self._tier(store)
        if tier is not None:
            tier.upcoming(self._valid_ids(store, ids, note=False), self._held_slots())
            return
        hint = getattr(store, "upcoming", None) or store.prefetch  # a row-sharded store prefetches
        hint(self._host_ids(ids, note=False))

    @_store_call
    def flush(self) -> int:
        """Make all updates durable; returns the store version. Safe to call from another thread."""
        with self._lifecycle:
            self._settle()
            store = self._ensure_open(writable=True)
            tier = self._device_tier
            if tier is not None and tier.store is store:
                tier.write_down()  # the device's newer rows first: the flush holds every update
            version = store.flush()
            self._target_version, self._target_checksum = None, None
            self._target_from_checkpoint = False
            return version

    @_store_call
    def grow(self, num_rows: int) -> None:
        """Raise the table to ``num_rows`` rows (`EmbeddingStore.grow`): the new ids hold their
        initial values, the old rows keep theirs; durable with the next flush (a checkpoint taken
        before resumes the old size, one taken after the new). ``num_rows`` equal to the current
        size does nothing; fewer rows are refused. A device tier is written down and made again at
        the new size. Call it from the training thread (a hook or a callback), not while another
        thread reads the store. Under several processes (a row-sharded table) every rank calls it
        with the same ``num_rows`` (`ShardedStore.grow`)."""
        with self._lifecycle:
            self._settle()
            store = self._ensure_open(writable=True)
            tier = self._device_tier
            if tier is not None:
                # The device's newer rows go down first; the tier (sized by the table, and over
                # its host memory where it is mapped) is made again at the new size on next use.
                if tier.store is store and not store.closed:
                    tier.write_down()
                tier.close()
                self._device_tier = None
            self._unmapped = None
            try:
                store.grow(num_rows)
            finally:
                self.num_rows = store.num_rows

    @property
    def io_wait_seconds(self) -> float:
        """The store's cumulative ``io_wait_seconds`` without the cost of a full ``stats()``."""
        store, tier = self._store, self._device_tier
        seconds = store.io_wait_seconds if store is not None and not store.closed else 0.0
        if tier is not None:  # the tier's store calls (some on its threads) count as its own wait
            seconds += tier.io_seconds - tier.store_seconds
            # the two store counters tick a moment apart: never report a step's wait as negative
            seconds = self._io_reported = max(seconds, getattr(self, "_io_reported", 0.0))
        return seconds

    @property
    def unflushed_share(self) -> float:
        """The open store's ``unflushed_share`` (rows written to disk since the last flush, as a
        share of the table); 0.0 while no store is open. O(1): `DeferredSync` reads it every batch."""
        store = self._store
        if store is None or store.closed:
            return 0.0
        return store.unflushed_share

    def thread_io_wait_seconds(self) -> float:
        """Seconds the calling thread spent in this store's calls so far: what the training
        thread waited for (a `DeferredSync` flush in its background thread overlaps the step and
        is not part of it). O(1). With a device tier, as `io_wait_seconds`."""
        store = self._store
        if self._device_tier is not None or store is None or store.closed:
            return self.io_wait_seconds
        own = getattr(store, "thread_io_wait_seconds", None)  # a sharded store may not count per thread
        return own() if own is not None else store.io_wait_seconds

    @_store_call
    def stats(self) -> StoreStats:
        """The store's `StoreStats` (bytes per tier, hits, dirty rows, flushes, ...).

        Counters (hits, reads, flushes, seconds, ...) add up over every store this handle opened,
        so after ``fit`` they still hold the fit's figures. While the store is closed (after
        ``fit`` or ``close()``) this is what it reported when it closed: the handle does not
        reopen it to count nothing; a call that reads or writes rows reopens it.
        """
        if not self._is_open() and self._last_stats is not None:
            return dataclasses.replace(self._last_stats)
        return self._with_earlier_counters(self._ensure_open(writable=False).stats())

    def device_stats(self) -> dict[str, Any] | None:
        """The GPU tier's figures while it is open (`DeviceTier.stats`: rows held, bytes moved
        host->device and device->host, rows loaded and evicted, whether the rows stay in host RAM
        and train in place), or None without one. Cheap: counters only."""
        tier = self._device_tier
        return tier.stats() if tier is not None else None

    def _with_earlier_counters(self, stats: StoreStats) -> StoreStats:
        earlier = self._earlier_counters
        if not earlier:
            return stats
        return dataclasses.replace(stats, **{k: getattr(stats, k) + v for k, v in earlier.items()
                                             if hasattr(stats, k)})

    def _keep_last_stats(self, store: EmbeddingStore) -> None:
        """The figures of a store about to close, so that ``stats()`` after ``fit`` is not zeros."""
        try:
            last = self._with_earlier_counters(store.stats())
        except Exception:  # a store that failed (damage, a full disk) may not report: keep the earlier figures
            return
        self._last_stats = last
        self._earlier_counters = {k: getattr(last, k) for k in (*type(last).counter_fields(), *_MORE_COUNTERS)
                                  if hasattr(last, k)}

    @_store_call
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for `ids` on the module's device with ``requires_grad=True``: autograd trains them.

        After backward their gradient rows are summed (across micro-batches too) and, at the
        optimizer step, the store's sparse row-wise optimizer (``optimizer=`` of
        ``add_embedding_store``) updates exactly those rows and their moments, in the store.
        Under ``torch.no_grad()`` or inference mode (validation, test, predict) it is ``get``.
        """
        if not torch.is_grad_enabled():
            rows = self.get(ids)
            max_norm = self._row_options.get("max_norm")
            if max_norm is not None:  # what a training lookup would return (the store is not written)
                rows, _ = renorm_rows(rows, max_norm, self._row_options.get("norm_type", 2.0))
            return rows
        rows = self._trainable_rows("lookup")
        # GPU ids untouched since Lightning moved them (version 0) equal their host copy: a tier
        # holding the whole table gathers with them directly
        return rows.lookup(self._host_ids(ids), self._device(),
                           device_ids=ids if isinstance(ids, torch.Tensor) and ids.is_cuda and _version(ids) == 0
                           else None)

    @_store_call
    def row_meta(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per row: the step it was last trained at (``last_step``) and how often (``updates``)."""
        if self._row_optimizer is not None and self._trainable is None:
            # nothing trained through this handle yet (evaluation, another process): a plain read,
            # which needs no writer lock and no if_exists decision
            got = self._ensure_open(writable=False).get_fields(self._host_ids(ids), ("last_step", "updates"))
            return {k: v[:, 0].to(self._device()) for k, v in got.items()}
        meta = self._trainable_rows("row_meta").row_meta(self._host_ids(ids))
        device = self._device() if self._device_tier is None else self._device_tier.device
        return {k: v.to(device) for k, v in meta.items()}

    @property
    def optimizer(self) -> RowOptimizer | None:
        """The sparse row-wise optimizer of a trainable store (None for direct writes only).

        To schedule its learning rate with Lightning, return ``optimizer.as_torch_optimizer()``
        from ``configure_optimizers`` with the scheduler, or call ``optimizer.follow(group)``.
        """
        return self._row_optimizer

    @_store_call
    def step(self, step: int | None = None) -> None:
        """Apply the collected gradient rows now (manual optimization; automatic does it for you)."""
        rows = self._trainable_rows("step")
        rows.collect()
        self._manual_steps += 1
        rows.apply(step if step is not None else self._manual_steps)

    def _trainable_rows(self, what: str) -> TrainableRows:
        if self._row_optimizer is None:
            raise _store_errors().StoreError(
                f"{what}() on embedding store {self.name!r} needs trainable rows: declare it with "
                f"add_embedding_store(..., optimizer='adam', lr=...) (or use get()/update() for direct writes)"
            )
        store = self._ensure_open(writable=True)
        if getattr(store, "sharded", False):  # rows of a row-sharded store train at their owners (distributed/)
            # rows on the owners' GPUs that the store released (a growth) are made again
            released = (getattr(self._trainable, "tier", None) is not None
                        and getattr(store, "device_rows", None) is not self._trainable)
            if self._trainable is None or self._trainable.store is not store or released:
                sharded: Any = store  # a ShardedStore
                self._trainable = sharded.trainable_rows(self._row_optimizer, max_grad_norm=self._max_grad_norm,
                                                         **self._row_options)
            return self._trainable
        tier = self._tier(store)
        if self._trainable is None or self._trainable.store is not store or self._trainable.device_tier is not tier:
            self._trainable = TrainableRows(store, self._row_optimizer, max_grad_norm=self._max_grad_norm,
                                            device_tier=tier, **self._row_options)
        return self._trainable

    # ------------------------------------------------------------------ the device tier
    def _tier(self, store: EmbeddingStore) -> DeviceTier | None:
        """The device tier of ``store`` on a CUDA module (None: the rows stay on the host and
        travel through pinned buffers). Over a memory-mode table, ``device_bytes=0``, and
        ``device_bytes=None`` for a table beyond its auto budget, keep the rows in host RAM where
        the GPU trains them in place (`HostMappedTier`), if CUDA can map the table; a disk-mode
        table beyond the budget gets a cache of that budget on the GPU."""
        device = self._device()
        if device.type != "cuda" or getattr(store, "sharded", False):
            # a row-sharded store's owners keep their rows on their GPUs themselves (distributed/
            # device_rows.py); its get/update/prefetch are its collectives
            return None
        tier = self._device_tier
        if tier is not None and tier.store is store and tier.device.index == (device.index or 0):
            # a forked child: the tier's host maps are not mapped there. Not _check_usable: the
            # tier's rows are read on the device, after its own write-downs in stream order; waiting
            # for them on the host (an event sync) would stall every step behind the evictions.
            store._check_state()
            return tier
        if tier is not None:
            tier.close()
            self._device_tier = None
        budget = self.device_bytes if self.device_bytes is not None else self._auto_device_bytes(store, device)
        whole = store.num_rows * (store.row_bytes + SLOT_OVERHEAD)
        if self.device_bytes == 0 or (self.device_bytes is None and budget < whole):
            if self._unmapped is not store:  # the rows train where they lie in host RAM, if it maps
                self._device_tier = HostMappedTier.create(store, device)
                self._unmapped = None if self._device_tier is not None else store
            if self._device_tier is not None or self.device_bytes == 0:
                return self._device_tier
        self._device_tier = DeviceTier(store, device, budget)
        return self._device_tier

    @staticmethod
    def _auto_device_bytes(store: EmbeddingStore, device: torch.device) -> int:
        """``device_bytes=None`` on a CUDA module: the whole table if it takes at most a quarter of
        the GPU's memory, else a quarter of the GPU's memory."""
        table = store.num_rows * (store.row_bytes + SLOT_OVERHEAD)
        return min(table, torch.cuda.get_device_properties(device).total_memory // 4)

    def _held_slots(self) -> Any:
        t = self._trainable
        return t.held_slots() if t is not None and t.device_tier is self._device_tier else None

    def _valid_ids(self, store: EmbeddingStore, ids: torch.Tensor, note: bool = True) -> Any:
        return as_ids(self._host_ids(ids, note), store.num_rows)

    def _settle(self) -> None:
        """Run a scheduled row update before anything reads or flushes the rows."""
        if self._trainable is not None and self._trainable.store is self._store:
            self._trainable.settle()

    def __repr__(self) -> str:
        state = "closed" if self._store is None or self._store.closed else "open"
        return (
            f"EmbeddingStoreHandle(name={self.name!r}, num_rows={self.num_rows}, dim={self.dim}, "
            f"path={str(self.path) if self.path else None!r}, {state})"
        )

    # ------------------------------------------------------------------ lifecycle (used by the mixin)
    def _bind(self, module: torch.nn.Module) -> None:
        self._module_ref = weakref.ref(module)

    def _host_ids(self, ids: torch.Tensor, note: bool = True) -> torch.Tensor:
        """``ids`` on the host: the batch's own host copy when Lightning moved it to the GPU
        (no device sync), else a copy (a sync, warned once: pass host ids to avoid it). A list,
        range or numpy array becomes a tensor (the store checks its dtype and values)."""
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise _store_errors().InvalidTypeError(
                    f"ids must be a tensor, list, range or numpy array of integer row ids; got {type(ids).__name__} "
                    f"({exc})"
                ) from None
        if ids.device.type == "cpu":
            if self._noted is not None and note:
                self._noted.append(ids)
            return ids
        module = self._module_ref()
        copier = getattr(module, "_embcache_host_copy", None) if module is not None else None
        host = copier(ids) if copier is not None else None
        if host is not None:
            if self._noted is not None and note:
                self._noted.append(host)
            return host
        _sync_warning.warn(
            f"Embedding store {self.name!r} got ids on {ids.device} that are not a tensor of the batch as "
            "Lightning moved it; copying them to the host synchronizes the device. Pass the batch's ids "
            "(or a CPU tensor) to get/lookup/update."
        )
        ids = ids.cpu()
        if self._noted is not None and note:
            self._noted.append(ids)
        return ids

    def _device(self) -> torch.device:
        module = self._module_ref()
        device = getattr(module, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    def _is_open(self) -> bool:
        return self._store is not None and not self._store.closed

    def _usable(self, store: EmbeddingStore | None, writable: bool) -> bool:
        return store is not None and not store.closed and (not writable or not (store.readonly or self._stand_in))

    def _ensure_open(self, *, writable: bool) -> EmbeddingStore:
        store = self._store
        if self._usable(store, writable):
            return store  # type: ignore[return-value]
        with self._lifecycle:
            store = self._store
            if self._usable(store, writable):
                return store  # type: ignore[return-value]
            return self._open(readonly=not writable)

    def _open(
        self, *, readonly: bool, version: int | None = None, checksum: str | None = None, checkpoint: str | None = None
    ) -> EmbeddingStore:
        """(Re)open the store: at `version`, else at a version a loaded checkpoint named, else the latest.

        `checkpoint`: the file that named `version`, for the message if the store is not there.
        """
        with self._lifecycle:
            if version is not None and self.path is not None and not store_exists(self.path):
                self._refuse_missing_folder(version, checkpoint)
            if version is not None:
                self._target_version, self._target_checksum = version, checksum
                self._target_from_checkpoint = self._claimed = True
            self._close()
            self._stand_in = False
            cls = getattr(self, "_shard_factory", None) or _store_class()  # rank's shard: distributed/
            if self.path is not None and not readonly:
                unclaimed = not self._claimed and store_exists(self.path)
                if unclaimed and self.if_exists == "error":
                    self._refuse_existing()
                self._take_writer_lock()
                if unclaimed:
                    self._apply_if_exists()
            if self.path is None:
                if self._target_version is not None:
                    raise _store_errors().VersionNotFoundError(
                        f"embedding store {self.name!r} is in memory (path=None): version "
                        f"{self._target_version} cannot be reopened; give it a path to checkpoint it"
                    )
                self._store = cls.create(None, self.num_rows, self.dim, **self._create_options)
            elif self._target_version is None and not store_exists(self.path):
                if readonly:  # nothing written yet: a read sees the initial rows, a write creates the store
                    self._store = cls.create(None, self.num_rows, self.dim, **self._create_options)
                    self._stand_in = True
                else:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._store = cls.create(self.path, self.num_rows, self.dim, **self._create_options)
                    self._claimed = True
            else:
                self._store = self._open_existing(cls, readonly)
            if self.path is not None and not readonly:
                _writers[self.path] = weakref.ref(self)
            return self._store

    def _refuse_missing_folder(self, version: int, checkpoint: str | None) -> None:
        """A checkpoint names a version of a store whose folder is gone: say so before anything is made
        (creating an empty store there would only fail later, blaming reclamation)."""
        where = "does not exist" if not self.path.exists() else "is empty"  # type: ignore[union-attr]
        raise _store_errors().VersionNotFoundError(
            f"embedding store {self.name!r}: {checkpoint or 'the checkpoint being loaded'} names version {version} "
            f"of the store at {self.path}, and that folder {where} (deleted, or moved). Nothing was created. "
            f"Put the store folder back at that path, or pass add_embedding_store(path=...) where it is now "
            f"(a moved folder is opened with a warning and its manifest checksum checked); to start afresh "
            f"instead, fit without ckpt_path"
        )

    def _absent_before_claim(self) -> bool:
        """Nothing at `path` yet and no version to reopen: `fit` makes the store only once it knows
        that no checkpoint names one (a checkpoint restored after setup may name a folder that was
        deleted; making an empty store there first would hide that). A rank's shard waits too: a
        checkpoint of another world size streams its rows into it, and a shard made first would be
        in the way."""
        return (
            self.path is not None
            and self._target_version is None
            and not self._claimed
            and not store_exists(self.path)
        )

    def _needs_claim(self) -> bool:
        """A write would meet rows this handle did not create and if_exists='error' forbids it (so far)."""
        return self.path is not None and not self._claimed and self.if_exists == "error" and store_exists(self.path)

    def _take_writer_lock(self) -> None:
        """Another handle of this process holding the store for writing after its fit ended (a
        model kept after ``fit``) closes it, flushing first; one in a running fit keeps it."""
        assert self.path is not None
        other = _writers.get(self.path, lambda: None)()
        if other is None or other is self or not other._is_open() or other._store.readonly:  # type: ignore[union-attr]
            return
        if other._in_fit:
            raise _store_errors().StoreLockedError(
                f"embedding store {self.name!r} at {self.path} is open for writing by another module of this "
                f"process that is fitting; one writer per path"
            )
        log.info(
            "Embedding store %r at %s: closing the writable handle of another module (flushed first)",
            self.name,
            self.path,
        )
        other.close()

    def _refuse_existing(self) -> None:
        raise _store_errors().InvalidArgumentError(
            f"embedding store {self.name!r}: {self.path} already holds a store, and nothing says whether to "
            f"continue its rows (a fresh decoder would silently meet old rows and moments). Pass "
            f"add_embedding_store(..., if_exists='resume') to continue them, if_exists='overwrite' to start "
            f"again, fit(ckpt_path=...) to resume a checkpoint, or choose another path "
            f"(if_exists='error' is the default; allowed: {', '.join(IF_EXISTS)})"
        )

    def _apply_if_exists(self) -> None:
        """A write to rows this handle did not create and no checkpoint named, allowed by `if_exists`."""
        if self.if_exists == "overwrite":
            self._remove_store_files()
        self._claimed = True

    def _remove_store_files(self) -> None:
        """Delete the store at `path` (and its checkpoint registry), refusing anything that is not a store."""
        assert self.path is not None
        from lightning_embcache.store.pins_registry import registry_path

        if not (self.path.is_dir() and (self.path / "META").is_file()):
            raise _store_errors().InvalidArgumentError(
                f"embedding store {self.name!r}: if_exists='overwrite' deletes only a store, and {self.path} "
                f"is not one (no META file); remove it yourself or choose another path"
            )
        log.warning("Embedding store %r: if_exists='overwrite' deletes the store at %s", self.name, self.path)
        shutil.rmtree(self.path)
        registry_path(self.path).unlink(missing_ok=True)

    def _open_existing(self, cls: Any, readonly: bool) -> EmbeddingStore:
        errors = _store_errors()
        version = self._target_version
        try:
            store = cls.open(self.path, version=version, readonly=readonly, **self._open_options)
        except errors.VersionNotFoundError as exc:
            if not self._target_from_checkpoint:  # the version this handle last had: take the latest
                self._target_version = None
                return cls.open(self.path, readonly=readonly, **self._open_options)
            raise errors.VersionNotFoundError(
                f"embedding store {self.name!r} at {self.path}: version {version} named by the checkpoint "
                f"is gone ({exc}); it was reclaimed after its checkpoint file was removed, or the store "
                "was recreated. Resume from a checkpoint whose version still exists."
            ) from exc
        try:
            declared = getattr(self, "_declared_rows", self.num_rows)
            if store.dim != self.dim or store.num_rows < declared:
                raise errors.InvalidArgumentError(
                    f"embedding store {self.name!r} at {self.path} holds {store.num_rows} x {store.dim} rows; "
                    f"add_embedding_store asked for num_rows={declared}, dim={self.dim} (a store may hold more rows "
                    f"than declared, once grown: grow it with .grow(num_rows))"
                )
            self.num_rows = store.num_rows  # grown since it was declared, or a checkpoint's size
            if version is not None and self._target_checksum is not None:
                found = store.manifest_checksum(version)
                if found != self._target_checksum:
                    raise errors.CorruptStoreError(
                        self.path,
                        f"version {version} has manifest checksum {found}, the checkpoint recorded "
                        f"{self._target_checksum}: the store at this path is not the one the checkpoint saw "
                        f"(recreated or replaced since)",
                    )
        except BaseException:
            store.close()
            raise
        return store

    def _close(self) -> None:
        with self._lifecycle:
            store, self._store = self._store, None
            self._stand_in = False
            if self.path is not None and _writers.get(self.path, lambda: None)() is self:
                del _writers[self.path]
            tier, self._device_tier = self._device_tier, None
            if tier is not None:
                tier.close()  # after a flush it holds nothing the store lacks; else, as the store
            if store is not None and not store.closed:
                self._keep_last_stats(store)
                store.close()

    def close(self) -> None:
        """Flush pending writes and release the store (and its writer lock); the next call reopens it.

        Use it, or ``with model.latents: ...``, when another module of this process should open
        the same path (a resumed copy of the model). An in-memory store (``path=None``) loses its
        rows when closed.
        """
        with self._lifecycle:
            if self._is_open() and self.path is not None and not (self._store.readonly or self._stand_in):  # type: ignore[union-attr]
                self.flush()
            if self.path is None:
                self._close()
            else:
                self._release()

    def __enter__(self) -> EmbeddingStoreHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self) -> None:
        """Free resources after training. In-memory stores stay open: closing would lose their rows."""
        if self.path is None:
            return
        with self._lifecycle:
            store = self._store
            if store is not None and self._is_open() and not self._target_from_checkpoint and not self._stand_in:
                # Reopen what this module last had, even if a flush with nothing dirty made no version.
                self._target_version, self._target_checksum = store.version, None
            self._close()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with its module (deepcopy, spawn): the open store, locks and buffers stay behind.
        state = self.__dict__.copy()
        state.update(
            _store=None,
            _lifecycle=None,
            _staging=None,
            _module_ref=None,
            _trainable=None,
            _stand_in=False,
            _in_fit=False,
            _device_tier=None,
            _unmapped=None,
            _noted=None,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(
            {
                "if_exists": "error",
                "_claimed": False,
                "_stand_in": False,
                "_in_fit": False,
                "_last_stats": None,
                "_earlier_counters": {},
                "_noted": None,
                "_unmapped": None,
                **state,
            }
        )
        self._lifecycle = threading.RLock()
        self._staging = PinnedRing(2)
        self._module_ref = lambda: None
