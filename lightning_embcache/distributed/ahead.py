"""`RunAhead`: the id exchanges of announced lookups, run ahead of training in background threads.

A lookup of a sharded table first agrees with every rank on who serves which ids (a Gloo
exchange of split sizes and ids, see :mod:`.exchange`), then moves the rows. When the ids of
coming lookups are known (``ShardedStore.prefetch(ids)``: the Lightning handle's ``prefetch``, a
`LookaheadSampler`, or `ShardedDeviceRows.prefetch`), that agreement need not wait for the
lookup. Each announcement becomes an entry that goes through two stages, each in a thread of
its own, so consecutive entries overlap like a pipeline:

1. **exchange**: the id exchange, on a Gloo group used by this thread alone (its collectives
   keep the order of the announcements on every rank, whatever the training thread exchanges
   meanwhile on the store's own group);
2. **serve** (owners keeping rows on their GPUs): bring the rows this rank serves for the entry
   up to its device tier. An entry's serve starts once the lookup of the entry before it took
   its rows, and protects every row whose gradient is still to come, so it never evicts a row a
   step still reads or updates; meanwhile the next entries' exchanges run. With
   ``serve_ahead=False`` there is no serve thread: the lookup brings the rows up itself, in the
   training thread, and only the exchange runs ahead (one thread fewer sharing the interpreter lock;
   the distributed benchmark's ``uploads=lookup``, slower than the serve thread where measured).

A lookup takes the first pending entry of exactly its ids (entries before it were never looked
up and are dropped); a lookup of other ids (a second lookup per step, validation) exchanges its
own ids as usual and leaves the entries pending. Announcing is a collective: every rank
announces as many batches, in the same order, and looks them up in the same pattern (a
``DistributedSampler`` under Lightning does).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_embcache.store.errors import InvalidArgumentError

#: announced entries kept at most; older ones are dropped (every rank alike: the counts agree)
MAX_PENDING = 64


class Entry:
    """One announced lookup: its ids, its exchange and serve stages, and the gate of the next."""

    __slots__ = ("ids", "explicit", "routed", "ready", "taken", "protect", "cancelled")

    def __init__(self, ids: Tensor, explicit: bool) -> None:
        self.ids = ids
        self.explicit = explicit            # announced by `ShardedDeviceRows.prefetch`: must be looked up next
        self.routed: Future | None = None   # -> Route (stage 1)
        self.ready: Future | None = None    # -> Route once this rank's served rows are up (stage 2)
        self.taken = threading.Event()      # the lookup of this entry has its rows: the next may serve
        self.protect: np.ndarray | None = None  # rows the next entry's serve must not evict
        self.cancelled = False

    def matches(self, ids: Tensor) -> bool:
        return self.ids.shape == ids.shape and torch.equal(self.ids, ids)


class RunAhead:
    """Pending announced lookups of one sharded store (see the module docstring).

    Args:
        exchange: ``exchange(ids, error) -> route`` (runs in the exchange thread; a collective).
    """

    def __init__(self, exchange: Callable[[Tensor, str | None], Any]) -> None:
        self.exchange = exchange
        #: serve announced entries in a thread of their own (False: their lookups bring the rows up)
        self.serve_ahead = True
        #: ``serve(route, protect)``: bring this rank's served rows up (set by `ShardedDeviceRows`)
        self.serve: Callable[[Any, np.ndarray | None], None] | None = None
        #: ``protect() -> slots``: rows whose gradients are still to come (set with `serve`)
        self.protect: Callable[[], np.ndarray | None] = lambda: None
        #: ``prepare(route)``: more of the lookup's host work, done in the exchange thread (set with `serve`)
        self.prepare: Callable[[Any], None] | None = None
        self._pending: collections.deque[Entry] = collections.deque()
        self._taking: list[Entry] = []  # taken or dropped by the lookup in progress: opened at `release`
        self._pools: list[ThreadPoolExecutor] = []
        self.announced = 0  # entries announced, for the benchmarks and tests
        self.hits = 0       # lookups that found their exchange done ahead

    # ---- announcing (every rank alike) -------------------------------------------------------
    def announce(self, ids: Tensor, explicit: bool = False, error: str | None = None) -> None:
        """Queue the exchange of a coming lookup of ``ids`` (int64; a collective). ``error``: the
        ids are invalid on this rank (the exchange fails on every rank, naming it)."""
        if not self._pools:
            self._pools = [ThreadPoolExecutor(1, thread_name_prefix="embcache-ahead-exchange"),
                           ThreadPoolExecutor(1, thread_name_prefix="embcache-ahead-serve")]
        while len(self._pending) >= MAX_PENDING:
            self._drop(self._pending.popleft())
        prev = self._pending[-1] if self._pending else None
        e = Entry(ids, explicit)
        e.routed = self._pools[0].submit(self._exchange_job, ids, error)
        if self.serve_ahead:
            if prev is None:  # nothing ahead of it: the rows of this step stay
                e.protect = self.protect()
            e.ready = self._pools[1].submit(self._serve_job, e, prev)
        self._pending.append(e)
        self.announced += 1

    def _exchange_job(self, ids: Tensor, error: str | None) -> Any:
        route = self.exchange(ids, error)
        if self.prepare is not None:
            self.prepare(route)
        return route

    def _serve_job(self, e: Entry, prev: Entry | None) -> Any:
        protect = e.protect
        if prev is not None:
            prev.taken.wait()
            protect = prev.protect
        route = e.routed.result()  # type: ignore[union-attr]
        if e.cancelled or self.serve is None:
            return route
        self.serve(route, protect)
        return route

    # ---- lookups (training thread) -----------------------------------------------------------
    def take(self, ids: Tensor) -> Any:
        """The route of a pending entry of exactly ``ids`` with its rows served (announced while
        ``serve_ahead``; else the lookup brings them up), or None.

        Call `release` when the lookup holds its rows (also after an error). Raises the entry's
        exchange error (invalid ids on some rank), or `InvalidArgumentError` when an explicitly
        prefetched lookup is of other ids.
        """
        ids = ids.to(torch.int64)
        at = next((i for i, e in enumerate(self._pending) if e.matches(ids)), None)
        if at is None:
            if self._pending and self._pending[0].explicit:
                while self._pending:
                    self._drop(self._pending.popleft(), wait=True)
                raise InvalidArgumentError(
                    "lookup(ids) after prefetch(next_ids) must look up exactly next_ids (every rank exchanged "
                    "them already); got other ids")
            if self._pending:  # its serve may be running: the tier is this lookup's once it is done
                _settled(self._pending[0].ready)
            return None
        for _ in range(at):  # announced, never looked up
            self._drop(self._pending.popleft(), wait=True)
        e = self._pending.popleft()
        self._taking.append(e)
        route = (e.routed if e.ready is None else e.ready).result()  # type: ignore[union-attr]
        self.hits += 1
        return route

    def release(self) -> None:
        """The lookup in progress holds its rows: the next entry may serve (protecting them)."""
        if self._taking:
            protect = self.protect()
            for e in self._taking:
                e.protect = protect
                e.taken.set()
            self._taking.clear()

    def _drop(self, e: Entry, wait: bool = False) -> None:
        e.cancelled = True
        e.protect = self.protect()
        e.taken.set()
        if wait:
            _settled(e.ready)

    # ---- around other work -------------------------------------------------------------------
    def quiesce(self) -> None:
        """Wait for a serve that may be running (before the tier's rows go down or change)."""
        if self._pending:
            first = self._pending[0]
            _settled(first.ready)

    def close(self) -> None:
        """Drop every entry; their exchanges still run (every rank's run the same ones)."""
        while self._pending:
            self._drop(self._pending.popleft())
        self.release()
        for pool in self._pools:
            pool.shutdown(wait=True)
        self._pools = []


def _settled(fut: Future | None) -> None:
    """Wait for ``fut`` and ignore its error (raised by the lookup that takes it, if any)."""
    if fut is not None:
        try:
            fut.result()
        except Exception:
            pass
