"""The prefetch thread: rows read into the hot tier before a get asks for them.

`Prefetcher` belongs to `Tiers`. A prefetch plans its reads under the store lock, reads without
it and installs the rows under it again only if nothing below the hot tier changed meanwhile
(`Layout.below_token`: write-backs, flushes and compactions move it); otherwise it is dropped
(it is a hint). A get that misses rows the thread is reading waits for them (`await_rows`)
instead of reading them twice. It sees the tiers as `Reads` (held weakly: they hold this).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from . import idsets, uring
from .core import StoreCore, stop_executor
from .errors import StoreError
from .hot import HotTier
from .warm import WarmTier

if TYPE_CHECKING:
    from .readahead import ReadAhead
    from .tiers import Layout
    from .writeback import WriteBack

# A get waits at most this long for a prefetch that is reading its rows, then reads them itself.
PREFETCH_WAIT_S = 1.0


class Reads(Protocol):
    """What the prefetch thread and the read-ahead ask of `Tiers`: the tiers, the miss path's
    plan and reads, the room to install rows in (`WriteBack.allocate`) and the read cost per
    row (`ReadAhead.note_read`)."""

    hot: HotTier
    warm: WarmTier
    writeback: WriteBack
    readahead: ReadAhead

    def plan_below(self, ids: np.ndarray) -> tuple: ...

    def read_below(self, plan: tuple, mapped: bool = True) -> tuple[np.ndarray, list]: ...

    def read_chunk_below(self, chunk: int, gen: int, delta: tuple | None) -> np.ndarray: ...

    def will_need(self, plan: tuple) -> None: ...

    def moved_since(self, plan: tuple) -> np.ndarray: ...

    def chunks_read(self, plan: tuple) -> int: ...



@dataclass(frozen=True)
class _Fetch:
    """A prefetch planned under the lock (`Prefetcher._plan_fetch`) and read without it: the state
    below the hot tier when planned (token, compactions, in-place folds), the file pool epoch the
    read holds, and what to read: whole chunks' layouts (memory mode) or rows and their plan."""

    token: int
    compactions: int
    folds: int
    pool: Any
    epoch: int
    layouts: list | None
    miss: np.ndarray | None
    plan: tuple | None


def _holding(ref: weakref.ReferenceType[Any], fn: Callable[..., Any], *args: Any) -> None:
    """A job of the prefetch thread: the tiers ``ref`` names stay while it runs, and a store
    dropped while it was queued is collected, not kept (the job then does nothing)."""
    tiers = ref()
    if tiers is not None:
        fn(*args)


def _prefetch_weakly(ref: weakref.ReferenceType[Prefetcher], idx: np.ndarray) -> None:
    """A queued prefetch holds its tiers weakly: a store dropped meanwhile is collected, not kept."""
    p = ref()
    if p is not None and not p._c.closed:
        p.prefetch(idx)


class Prefetcher:
    """The prefetch thread of a store's tiers (see the module docstring)."""

    def __init__(self, core: StoreCore, layout: Layout, tiers: Reads) -> None:
        self._c = core
        self._v = layout
        self._tiers = weakref.ref(tiers)  # (they hold this)
        self._t = cast(Reads, weakref.proxy(tiers))
        self.executor: ThreadPoolExecutor | None = None
        self.fetching: np.ndarray | None = None  # sorted ids the prefetch thread is reading now
        self._fetch_cond: threading.Condition | None = None  # `_fetch_done`, on the lock ``_fetch_lock``
        self._fetch_lock: Any = None

    def later(self, idx: np.ndarray) -> None:
        """Queue a prefetch of validated ``idx`` on the prefetch thread; returns at once."""
        with self._c.lock:
            self._c.check_open()
            self.submit(_prefetch_weakly, weakref.ref(self), idx)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the prefetch thread, started here at first need (caller holds the lock)."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="embcache-prefetch")
        self.executor.submit(_holding, self._tiers, fn, *args)

    def stop(self, wait: bool = True) -> None:
        stop_executor(self.executor, wait)

    def prefetch(self, idx: np.ndarray, upcoming: bool = False) -> None:
        """Bring ``idx`` into the hot tier (the prefetch thread).

        The disk reads run without the store lock, so a get/update of the training thread never
        waits for a prefetch's I/O: the plan (which rows, and where they live) is taken under the
        lock, the reads run outside it, and the rows are installed under it again only if nothing
        below the hot tier changed meanwhile (``below_token``: write-backs, flushes and
        compactions move it); otherwise the prefetch is dropped (it is a hint).
        """
        try:
            self.prefetch_once(idx, upcoming)
        except (StoreError, OSError):
            pass  # a hint: the foreground read will report the problem
        finally:
            if self.fetching is not None:
                with self._c.lock:
                    self.fetching = None
                    self._fetch_done().notify_all()

    def _fetch_done(self) -> threading.Condition:
        """Signalled when the rows of ``fetching`` are installed or dropped (caller holds the lock)."""
        cond, lock = self._fetch_cond, self._c.lock
        if cond is None or self._fetch_lock is not lock:  # a forked child has a lock of its own
            cond = self._fetch_cond = threading.Condition(lock)
            self._fetch_lock = lock
        return cond

    def await_rows(self, ids: np.ndarray) -> np.ndarray | None:
        """A get misses rows the prefetch thread is reading right now: wait for them rather than
        read them a second time (caller holds the lock; waiting releases it). Returns which of
        ``ids`` were in flight, or None if none was."""
        fetching = self.fetching
        if fetching is None or self.executor is None or not len(ids):
            return None
        pos = np.minimum(fetching.searchsorted(ids), len(fetching) - 1)
        late = fetching[pos] == ids
        if not late.any():
            return None
        t0 = time.perf_counter()
        cond = self._fetch_done()
        while self.fetching is fetching and not self._c.closed:
            if not cond.wait(timeout=PREFETCH_WAIT_S) or time.perf_counter() - t0 > PREFETCH_WAIT_S:
                break  # never wait on a prefetch without bound: read the rows here instead
        self._c.stats.stall_seconds += time.perf_counter() - t0
        self._c.check_open()
        return late

    def prefetch_once(self, idx: np.ndarray, upcoming: bool = False) -> bool:
        """One attempt of `prefetch`; False if rows below the hot tier changed during the read."""
        with self._c.lock:
            if self._c.closed:
                return True
            fetch = self._plan_fetch(idx, upcoming)
            if fetch is None:
                return True
        got = self._read_fetch(fetch)  # without the lock
        with self._c.lock:
            return self._c.closed or self._install_fetch(fetch, got)

    def _plan_fetch(self, idx: np.ndarray, upcoming: bool) -> _Fetch | None:
        """What a prefetch of ``idx`` reads, and the state below the hot tier it read it in
        (caller holds the lock); None if there is nothing to read."""
        hot = self._t.hot
        cr = self._c.chunk_rows
        token = self._v.below_token
        compactions = self._c.stats.compactions
        folds = self._v.disk.pool.inplace_seq if self._v.disk is not None else 0
        layouts = miss = plan = None
        if hot.resident:  # memory mode over a store on disk: whole chunks
            chunks = idsets.unique(idx // cr)
            chunks = chunks[~hot.loaded[chunks]]
            if not len(chunks):
                return None
            layouts = [(c, self._v.layout_of(c)) for c in chunks.tolist()]
        else:
            if upcoming:  # rows a get already read (the hint's batch went by): skip them
                idx = idx[cast(np.ndarray, hot.want)[idx] > 0]
            miss = idsets.unique(idx[hot.lookup(idx) < 0])
            if len(miss) > hot.limit // 2:
                miss = miss[: hot.limit // 2]
            if not len(miss):
                return None
            self._t.warm.pin()  # warm copies the plan reads stay put until this read ends
            try:
                plan = self._t.plan_below(miss)
            except BaseException:
                self._t.warm.unpin()
                raise
            self.fetching = miss  # a get missing these waits for this read (`await_rows`)
        # Planned under the lock, read without it: no delta record the plan names is punched
        # until this read ends (holes.py), though a compaction round may kill it meanwhile.
        pool = self._v.disk.pool if self._v.disk is not None else None
        epoch = pool.begin_read() if pool is not None else 0
        return _Fetch(token, compactions, folds, pool, epoch, layouts, miss, plan)

    def _read_fetch(self, f: _Fetch) -> Any:
        """Run a prefetch's reads without the lock: [(chunk, records)] in memory mode, else
        (records of ``f.miss``, [(chunk, records)] read whole)."""
        try:
            if f.layouts is not None:
                return [(c, self._t.read_chunk_below(c, *layout)) for c, layout in f.layouts]
            assert f.plan is not None and f.miss is not None
            if not uring.available():  # io_uring has every read of the batch in flight at once
                self._t.will_need(f.plan)
            t0 = time.perf_counter()
            got = self._t.read_below(f.plan, mapped=False)
            self._t.readahead.note_read(time.perf_counter() - t0, len(f.miss))
            return got
        finally:
            if f.pool is not None:
                f.pool.end_read(f.epoch)
            if f.miss is not None:
                with self._c.lock:
                    self._t.warm.unpin()

    def _install_fetch(self, f: _Fetch, got: Any) -> bool:
        """Install what a prefetch read, if still wanted and still current (caller holds the
        lock); False if rows below the hot tier changed meanwhile and nothing was installed."""
        hot = self._t.hot
        moved = None
        if self._v.below_token - f.token != self._c.stats.compactions - f.compactions:
            # Rows below changed (a write-back or flush) while we read: a row whose newest
            # record is no longer where the plan found it may have been read stale, so it is
            # not installed; the others are (a compaction alone changes no row).
            if hot.resident:
                return False
            assert f.plan is not None and self._v.disk is not None
            moved = self._t.moved_since(f.plan)
            if self._v.disk.pool.moved_since(f.folds):
                # a compaction folded rows into base files in place meanwhile (inplace.py):
                # their generation tells nothing, so no row read from a base file is installed
                moved |= f.plan[2] < 0
        if hot.resident:
            for c, recs in got:
                self._c.stats.cold_reads += 1
                if self._t.warm.budget:
                    self._t.warm.put(c, recs)
                if not hot.loaded[c]:
                    lo, hi = hot.chunk_range(c)
                    hot.fill_chunk(c, recs)
                    self._c.stats.prefetched_rows += hi - lo
            hot.all_loaded = bool(hot.loaded.all())
            return True
        assert f.plan is not None and f.miss is not None
        records, whole = got
        self._c.stats.cold_reads += self._t.chunks_read(f.plan)
        if self._t.warm.budget and moved is None:  # whole chunks read stale stay out of warm
            for c, recs in whole:
                self._t.warm.put(c, recs)
        want = hot.lookup(f.miss) < 0  # the training thread may have loaded some meanwhile
        if moved is not None:
            want &= ~moved
        if not want.any():
            return True
        mids, records = f.miss[want], records[want]
        room = self._t.writeback.allocate(len(mids))
        if len(room) < len(mids):  # no room now (rows in flight or in use): drop the hint
            hot.give_back(room)
            return True
        hot.install(mids, room, records)
        self._c.stats.prefetched_rows += len(mids)
        return True
