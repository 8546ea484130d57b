"""Announcing upcoming rows by default: the training loader's batch sampler wrapped in a
`LookaheadSampler`, once the first batches show that its indices are the ids the step reads.

Why by default: with a disk-mode store, a plain shuffled ``DataLoader`` leaves every step waiting
for rows that the sampler knew about batches earlier (a third of the step at 50M rows with a 1 GiB
hot tier); announcing them cut that store I/O about 5x. Why checked first: a hint names rows by
id, and the sampler knows dataset *indices*. Where a dataset maps index ``i`` to another row, a
hint would load rows no step reads. So hints are held back for the first ``PROBE_BATCHES``
batches: for each, the ids every eligible store was asked for (``get``, ``lookup``, ``update``)
must include every index of the batch. Stores that pass are announced to from then on (the
batches already in the window included); if none passes, nothing is announced and the loader
runs as before.

Only a single process's plain ``torch.utils.data.DataLoader`` (or `ResumableLoader`, which skips a
resumed epoch's batches below the batch sampler) of a map-style dataset with its default batching
is wrapped (not another subclass such as torchdata's ``StatefulDataLoader``, not a
loader whose sampler is already a ``LookaheadSampler``), and only stores with a path and a hot
budget (disk mode) that keep their rows on the host. The loader is restored when ``fit`` ends.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lightning_embcache.data.lookahead import LookaheadSampler
from lightning_embcache.data.resumable import ResumableLoader

log = logging.getLogger(__name__)

#: batches whose ids are checked against the sampler's indices before anything is announced
PROBE_BATCHES = 2


class _Stores:
    """The confirmed stores of a module seen as one hint target by `LookaheadSampler`."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def _open(self) -> list[Any]:
        return [h._store for h in self.handles if h._store is not None and not h._store.closed]

    def upcoming(self, ids: Any) -> None:
        for store in self._open():
            store.upcoming(ids)

    @property
    def hot_bytes(self) -> int | None:
        budgets = [s.hot_bytes for s in self._open() if s.hot_bytes]
        return min(budgets) if budgets else None

    @property
    def row_bytes(self) -> int | None:
        sizes = [s.row_bytes for s in self._open()]
        return max(sizes) if sizes else None

    def read_seconds_per_row(self) -> float:
        waits = [s.read_seconds_per_row() for s in self._open()]
        waits = [w for w in waits if w == w]
        return max(waits) if waits else math.nan


class ProbingLookahead(LookaheadSampler):
    """A `LookaheadSampler` whose hints wait until `confirm` (or stop at `refuse`); while waiting it
    keeps the indices of each batch it yields for the check."""

    def __init__(self, batch_sampler: Any, stores: _Stores) -> None:
        super().__init__(batch_sampler, stores)
        self.state = "probing"  # -> "on" | "off"
        self._pending: collections.deque = collections.deque()  # hints of batches in the window, not yet yielded
        self.yielded: collections.deque = collections.deque()  # indices of batches yielded while probing

    def _hint(self, indices: Any) -> None:
        if self.state == "on":
            super()._hint(indices)
        elif self.state == "probing":
            self._pending.append(indices)

    def __iter__(self) -> Iterator[Any]:
        self._pending.clear()
        for item in super().__iter__():
            if self.state == "probing":
                if self._pending:
                    self._pending.popleft()  # batches enter the window and leave it in order
                self.yielded.append(np.asarray(item, dtype=np.int64).reshape(-1))
            yield item

    def confirm(self) -> None:
        """Announce from now on, starting with the batches already in the window."""
        self.state = "on"
        pending, self._pending = list(self._pending), collections.deque()
        self.yielded.clear()
        for indices in pending:
            super()._hint(indices)

    def refuse(self) -> None:
        self.state = "off"
        self._pending.clear()
        self.yielded.clear()


def _wrappable(loader: Any) -> bool:
    return (type(loader) in (DataLoader, ResumableLoader) and not isinstance(loader.dataset, IterableDataset)
            and isinstance(loader.batch_sampler, BatchSampler)
            and not isinstance(loader.sampler, LookaheadSampler))


class AutoLookahead:
    """Installed by the mixin's lifecycle callback for one ``fit``; see the module docstring."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.stores = _Stores()
        self.samplers: list[ProbingLookahead] = []
        self._wrapped: list[tuple[DataLoader, Any]] = []  # loader, its own batch sampler
        self._patched: list[Any] = []  # objects whose train_dataloader this installed
        self._checked = 0
        self._passed: dict[str, int] = {}

    # ------------------------------------------------------------------ install / remove
    def install(self, trainer: Any) -> None:
        source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
        instance = getattr(source, "instance", None)
        if isinstance(instance, DataLoader):
            self.wrap(instance)
        elif getattr(source, "name", None) == "train_dataloader" and instance is not None:
            made = getattr(type(instance), "train_dataloader", None)
            if made is None or "train_dataloader" in vars(instance):
                return
            vars(instance)["train_dataloader"] = lambda: self.wrap(made(instance))
            self._patched.append(instance)

    def wrap(self, loader: Any) -> Any:
        if not _wrappable(loader):
            return loader
        sampler = ProbingLookahead(loader.batch_sampler, self.stores)
        self._wrapped.append((loader, loader.batch_sampler))
        object.__setattr__(loader, "batch_sampler", sampler)  # DataLoader refuses a plain setattr after init
        self.samplers.append(sampler)
        self._start_probe()
        return loader

    def remove(self) -> None:
        for loader, own in self._wrapped:
            object.__setattr__(loader, "batch_sampler", own)
        for instance in self._patched:
            vars(instance).pop("train_dataloader", None)
        self._wrapped.clear()
        self._patched.clear()
        self._stop_noting()

    # ------------------------------------------------------------------ the check
    def _eligible(self) -> list[Any]:
        out = []
        for handle in self.module._embcache_stores().values():
            store = handle._store
            if (handle.path is None or store is None or store.closed or getattr(store, "sharded", False)
                    or store.hot_bytes is None or handle._device_tier is not None
                    or (handle._device().type == "cuda" and handle.device_bytes != 0)):  # rows live on the GPU
                continue
            out.append(handle)
        return out

    def _start_probe(self) -> None:
        if not any(s.state == "probing" for s in self.samplers):
            return  # nothing wrapped (or decided already): the handles note nothing
        self._checked, self._passed = 0, {}
        for handle in self._eligible():
            handle._noted = []

    def _stop_noting(self) -> None:
        for handle in self.module._embcache_stores().values():
            handle._noted = None

    @property
    def probing(self) -> bool:
        return any(s.state == "probing" for s in self.samplers)

    def after_batch(self) -> None:
        """At each training batch's end while probing: did every eligible store read the batch's indices?"""
        sampler = next((s for s in self.samplers if s.state == "probing" and s.yielded), None)
        if sampler is None:
            return
        indices = sampler.yielded.popleft()
        wanted = np.unique(indices)
        for handle in self._eligible():
            noted, handle._noted = handle._noted, []
            if noted is None or handle.name in self._passed and self._passed[handle.name] < 0:
                continue
            read = np.unique(np.concatenate([np.asarray(n, dtype=np.int64).reshape(-1) for n in noted])) \
                if noted else np.empty(0, np.int64)
            ok = len(wanted) > 0 and bool(np.isin(wanted, read, assume_unique=True).all())
            self._passed[handle.name] = self._passed.get(handle.name, 0) + 1 if ok else -1
        self._checked += 1
        if self._checked < PROBE_BATCHES:
            return
        confirmed = [h for h in self._eligible() if self._passed.get(h.name, 0) >= PROBE_BATCHES]
        self._stop_noting()
        for s in self.samplers:
            if s.state == "probing":
                if confirmed:
                    self.stores.handles = confirmed
                    s.confirm()
                else:
                    s.refuse()
        if confirmed:
            log.info("Embedding stores %s: announcing the training loader's coming batches (LookaheadSampler)",
                     ", ".join(repr(h.name) for h in confirmed))
        elif self._passed:
            log.info("The training loader's sample indices are not the ids the steps read from %s: nothing is "
                     "announced; wrap its sampler in LookaheadSampler(..., id_fn=...) to announce them",
                     ", ".join(repr(n) for n in self._passed))
