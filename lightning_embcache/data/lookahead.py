"""LookaheadSampler: wraps a sampler and tells the store which rows the next batches read."""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from lightning_embcache.store.errors import InvalidArgumentError, InvalidTypeError

from .chunk_shuffle import ChunkShuffleSampler

# For a sampler of single indices, a "batch" of the lookahead window is this many indices.
INDEX_GROUP = 256
MAX_AUTO_LOOKAHEAD = 32


class LookaheadSampler(Sampler):
    """Yield exactly what ``sampler`` yields, and hint the store with the rows of the next batches.

    For per-sample rows the order of an epoch is fixed when the sampler starts it, so the store
    need not guess: each batch entering a window of ``lookahead`` batches ahead is announced with
    ``store.upcoming(ids)``, which loads the rows ahead of their ``get`` and keeps them in the hot
    tier until it reads them (rows no coming batch reads are evicted first, and rows updated for
    the last time in the window are written back and dropped instead of filling the cache). While
    rows come from the disk a background thread reads them during the training step; while they
    come from the page cache, the next ``get`` that misses reads the announced rows with its own in
    one batch (a second thread would only take turns with training for the GIL). With a warm
    tier (``ChunkShuffleSampler`` order), the kernel is asked for the announced chunks and each
    is read once, whole, into the warm tier, which serves its rows.

    Example::

        sampler = LookaheadSampler(BatchSampler(RandomSampler(ds), 512, False), store)
        loader = DataLoader(ds, batch_sampler=sampler, num_workers=4)

    Notes:
        * Wraps a sampler of indices or a batch sampler (lists of indices), including
          ``DistributedSampler``; ``set_epoch`` is passed on (to a batch sampler's ``sampler`` if
          the batch sampler has none), so re-seeding per epoch works. With Lightning, pass
          ``use_distributed_sampler=False`` to the Trainer when the wrapped sampler is already a
          ``DistributedSampler`` (Lightning would otherwise replace the sampler).
        * Runs where the DataLoader iterates its sampler, the main process, for any ``num_workers``
          and with ``persistent_workers``; the DataLoader's own prefetching only moves the window
          further ahead of training.
        * For a sampler of single indices, a batch of the window is 256 consecutive indices.
        * Mid-epoch resume: ``state_dict()`` records how many items were yielded this epoch;
          after ``load_state_dict(state)`` the next iteration skips that many (the wrapped sampler
          must repeat its order for the epoch: seed it and call ``set_epoch``).
        * A hint is only a hint: rows are never changed by it, and a read of a row that did not
          arrive in time reads it as usual (``stats().prefetch_hit_rate`` says how often).

    Args:
        sampler: a ``Sampler`` (or any iterable) of dataset indices or of lists of indices.
        store: an ``EmbeddingStore`` (or anything with ``upcoming(ids)`` or ``prefetch(ids)``).
        lookahead: batches announced ahead; ``None`` sizes the window from measured read latency:
            the time a batch's rows take to come up from below the hot tier (the store's
            ``read_seconds_per_row()`` times the batch's rows) over the time between two batches,
            plus one, re-read every step; at most as many batches as fit in a quarter of the hot
            tier (at most 32; 2 in memory mode), which is also the window before anything was
            read; over a `ChunkShuffleSampler` (or a batch sampler of one) at least half of its
            window's batches, so that the store reads the next window's chunks while the
            current one trains. ``window`` holds the current size.
        id_fn: maps the indices of one batch (a 1-D int64 tensor) to the store ids its step reads
            (a tensor or array); ``None``: the indices are the ids.

    Raises:
        InvalidArgumentError: ``lookahead`` is not a positive int.
        InvalidTypeError: ``sampler`` is not iterable, ``store`` takes no hints, or ``id_fn`` is
            not callable.
    """

    def __init__(self, sampler: Any, store: Any, lookahead: int | None = None,
                 id_fn: Callable[[torch.Tensor], Any] | None = None) -> None:
        if not hasattr(sampler, "__iter__"):
            raise InvalidTypeError(f"sampler must be a Sampler or an iterable of indices; got {type(sampler).__name__}")
        if not (hasattr(store, "upcoming") or hasattr(store, "prefetch")):
            raise InvalidTypeError(f"store must be an EmbeddingStore (with upcoming(ids) or prefetch(ids)); "
                                   f"got {type(store).__name__}")
        if lookahead is not None and (type(lookahead) is not int or lookahead < 1):
            raise InvalidArgumentError(f"Invalid value for lookahead={lookahead!r}. Must be None or an int >= 1")
        if id_fn is not None and not callable(id_fn):
            raise InvalidTypeError(f"id_fn must be callable or None; got {type(id_fn).__name__}")
        self.sampler = sampler
        self.store = store
        self.lookahead = lookahead
        self.id_fn = id_fn
        self._hint_fn = getattr(store, "upcoming", None) or store.prefetch
        self._yielded = 0
        self._skip = 0
        self._epoch: int | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to the wrapped sampler (``DistributedSampler`` re-seeds with it)."""
        self._epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        elif hasattr(getattr(self.sampler, "sampler", None), "set_epoch"):  # a BatchSampler's sampler
            self.sampler.sampler.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Items yielded so far this epoch (and the epoch), for a mid-epoch resume."""
        return {"yielded": self._yielded, "epoch": self._epoch}

    def load_state_dict(self, state: dict) -> None:
        """The next iteration skips the ``state["yielded"]`` items already consumed."""
        n = state.get("yielded", 0) if isinstance(state, dict) else None
        if type(n) is not int or n < 0:
            raise InvalidArgumentError(f"state['yielded'] must be an int >= 0; got {n!r}")
        self._skip = n
        if state.get("epoch") is not None:
            self.set_epoch(state["epoch"])

    # ------------------------------------------------------------------------------------------
    def _window(self, first: Any) -> int:
        """The most batches announced ahead: ``lookahead``, else what a quarter of the hot tier
        holds (at most 32; 2 in memory mode)."""
        if self.lookahead is not None:
            return self.lookahead
        rows = len(first) if _is_batch(first) else INDEX_GROUP
        hot = getattr(self.store, "hot_bytes", None)
        row_bytes = getattr(self.store, "row_bytes", None)
        if not hot or not row_bytes:
            return 2
        slots = hot // (row_bytes + 11)
        return max(1, min(MAX_AUTO_LOOKAHEAD, slots // (4 * max(rows, 1))))

    def _chunk_order_floor(self, rows: int) -> int:
        """Batches to announce at least in `ChunkShuffleSampler` order: half a window's. A
        window's first batch wants all of its chunks, which the store reads ahead whole while
        the window before trains; the latency it measures is that of the reads the training
        thread waits for, which read-ahead keeps short (a window sized from it alone announced
        the next window too late: ~30 ms of waiting an epoch against 2-8 ms)."""
        inner = getattr(self.sampler, "sampler", self.sampler)  # a BatchSampler's
        if not isinstance(inner, ChunkShuffleSampler):
            return 1
        return max(1, math.ceil(inner.window * inner.chunk_rows / max(rows, 1) / 2))

    def _hint(self, indices: Any) -> None:
        # numpy turns a list of ints into an array 8x faster than torch.as_tensor (6 against 48 us
        # for 512); the hint is still an int64 tensor
        if isinstance(indices, torch.Tensor):
            ids = indices.to(torch.int64).reshape(-1)
        else:
            ids = torch.from_numpy(np.asarray(indices, dtype=np.int64).reshape(-1))
        if self.id_fn is not None:
            ids = self.id_fn(ids)
        self._hint_fn(ids)

    def __iter__(self) -> Iterator[Any]:
        it = _bounded(self.sampler)
        skip, self._skip = self._skip, 0
        for _ in range(skip):
            if next(it, _END) is _END:
                break
        self._yielded = skip
        first = next(it, _END)
        if first is _END:
            return
        batched = _is_batch(first)
        unit = 1 if batched else INDEX_GROUP
        most = self._window(first)
        latency = getattr(self.store, "read_seconds_per_row", None) if self.lookahead is None else None
        rows = len(first) if batched else INDEX_GROUP  # type: ignore[arg-type]  # a batch is sized (_is_batch)
        pace = _Pace(most, rows, unit, latency, self._chunk_order_floor(rows)) if latency is not None else None
        self.window = most
        ahead = most * unit
        window: collections.deque = collections.deque()
        group: list = []

        def take(item: Any) -> None:
            window.append(item)
            if batched:
                self._hint(item)
            else:
                group.append(int(item))
                if len(group) >= INDEX_GROUP:
                    self._hint(group)
                    group.clear()

        take(first)
        done = False
        while len(window) <= ahead and not done:
            item = next(it, _END)
            done = item is _END
            if not done:
                take(item)
        if group and done:
            self._hint(group)
            group.clear()
        while window:
            item = window.popleft()
            self._yielded += 1
            yield item
            if pace is not None:
                # the window follows the measured time a batch's rows take to arrive (a batch
                # further ahead only holds hot slots longer): one more item, or none, per step
                self.window = pace.step()
                ahead = self.window * unit
            while not done and len(window) <= ahead:
                nxt = next(it, _END)
                done = nxt is _END
                if not done:
                    take(nxt)
                elif group:
                    self._hint(group)
                    group.clear()


_END = object()


def _bounded(sampler: Any) -> Iterator[Any]:
    """``iter(sampler)``, ending after ``len(sampler)`` items without asking it for one more.

    Reading ahead must not run a sampler further than a loader would: torch's ``RandomSampler``
    with a ``generator`` draws its next permutation when resumed after its last index, so asking
    past the end would change every later epoch's order from that of the same loader unwrapped.
    """
    it = iter(sampler)
    try:
        n = len(sampler)
    except TypeError:  # no length: the sampler says when it ends
        return it
    return itertools.islice(it, n)


class _Pace:
    """Batches to announce ahead from what was measured: the time a batch's rows take to come up
    from below the hot tier (the store's recent seconds per row read, times the batch's rows)
    over the time between two batches, plus one; at most ``most``. Before the store has read
    anything below its hot tier, ``most``. ``unit``: items yielded per batch of the window (a
    sampler of single indices yields 256 per batch)."""

    def __init__(self, most: int, rows: int, unit: int, latency: Callable[[], float], floor: int = 1) -> None:
        self.most, self.rows, self.unit, self.latency = most, rows, unit, latency
        self.floor = min(floor, most)
        self.last = _clock()
        self.step_s = float("nan")
        self.k = most

    def step(self) -> int:
        now = _clock()
        dt, self.last = now - self.last, now
        self.step_s = dt if self.step_s != self.step_s else 0.9 * self.step_s + 0.1 * dt
        per_row = self.latency()
        if per_row == per_row and self.step_s > 0:
            self.k = max(self.floor, min(self.most, math.ceil(self.rows * per_row / (self.step_s * self.unit)) + 1))
        return self.k


def _clock() -> float:
    return time.perf_counter()


def _is_batch(item: Any) -> bool:
    """A batch sampler yields lists (or 1-D arrays) of indices; a sampler yields single ints."""
    if isinstance(item, torch.Tensor):
        return item.dim() == 1
    if isinstance(item, np.ndarray):
        return item.ndim == 1
    return isinstance(item, (list, tuple))
