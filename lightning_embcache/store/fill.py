"""Memory mode's making of never-written chunks: all at once (`materialize`) or in a background
thread (`start_filling`), so no training step pays a chunk's first touch.

`Filler` belongs to `Tiers`: it makes rows from their initial values (`StoreCore.init_records`)
and installs them in the hot tier's pool under the store lock, keeping rows made or changed
meanwhile (`HotTier.fill_chunk`). Chunks with rows below the pool (a base file, delta records)
load on demand through the tiers (`Filled.load_chunk_resident`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from . import idsets
from .core import StoreCore, stop_executor
from .hot import HotTier
from .initrows import normal_rows

if TYPE_CHECKING:
    from .tiers import Layout

#: memory mode makes never-written chunks in a background thread (`Filler.start_filling`);
#: tests that count first touches turn it off
BACKGROUND_FILL = True
FILL_BYTES = 4 << 20  # rows made per step of the background fill (the store lock is held to install them)
#: while rows are read or written (a training loop: a get, update or lookup within the last
#: FILL_IDLE_S), the background fill takes at most this share of its thread's time: at full speed
#: its numpy calls and installs contend with the steps for the GIL, the store lock and the cores
#: (docs/benchmarks.md, "First touch"); idle, it runs flat out
FILL_SHARE = 0.5
FILL_IDLE_S = 0.05


class Filled(Protocol):
    """What the fill asks of `Tiers`: the pool, its field views, and a chunk loaded the usual way."""

    hot: HotTier
    np_views: dict[str, np.ndarray]

    def load_chunk_resident(self, chunk: int) -> None: ...


def _fill_weakly(ref: weakref.ReferenceType[Filler], stopping: threading.Event) -> None:
    """The background fill, holding the tiers only during a step (a dropped store is collected);
    ``stopping`` ends its pauses."""
    start: int | None = 0
    while start is not None and not stopping.is_set():
        filler = ref()
        if filler is None:
            return
        try:
            t0 = time.perf_counter()
            start = filler._fill_step(start)
            t1 = time.perf_counter()
            training = t1 - filler._c.rows_used_at < FILL_IDLE_S
        except Exception:  # the fill is an optimisation: a first touch still makes any row
            return
        finally:
            del filler
        if training and start is not None:
            stopping.wait((t1 - t0) * (1 - FILL_SHARE) / FILL_SHARE)


class Filler:
    """Makes a memory-mode table's never-written chunks (see the module docstring). Holds the
    tiers weakly: they hold this."""

    def __init__(self, core: StoreCore, layout: Layout, tiers: Filled) -> None:
        self._c = core
        self._v = layout
        self._t = cast(Filled, weakref.proxy(tiers))
        self.executor: ThreadPoolExecutor | None = None  # the background fill (`start_filling`)
        self._stopping = threading.Event()

    def stop(self, wait: bool = True) -> None:
        self._stopping.set()
        stop_executor(self.executor, wait)

    def materialize(self) -> None:
        """Bring every chunk of a memory-mode table into its pool now (never-written rows from
        their initial values, made in large vectorised blocks), so no step pays a first touch."""
        with self._c.lock:
            self._c.check_open()
            hot = self._t.hot
            todo = np.flatnonzero(~hot.loaded)
            fresh = todo if self._v.disk is None else todo[self._v.cmap[todo] == 0]
            if (self._v.rows is not None and len(self._v.rows)) or hot.row_ok is not None \
                    or not self._c.init_in_place():
                fresh = fresh[:0]  # rows exist below or in the pool: each chunk the usual way
            for c in idsets.difference(todo, fresh).tolist():
                self._t.load_chunk_resident(c)
            if len(fresh):
                # Never-written chunks of a new table: their initial values straight into the
                # pool, chunks split over the CPUs (numpy lets the GIL go while it computes).
                workers = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
                spans = [fresh[i::workers] for i in range(workers)]
                with ThreadPoolExecutor(workers, thread_name_prefix="embcache-materialize") as pool:
                    list(pool.map(self._init_chunks_in_place, spans))
                hot.loaded[fresh] = True
            hot.all_loaded = True

    def start_filling(self) -> None:
        """Memory mode over never-written chunks: make them in a background thread, a few MiB
        of rows at a time, so a table whose first batch made only its own rows reaches the
        one-gather steady state soon (and faults its pages in off the training thread), instead
        of after a whole epoch of first touches. Chunks with rows on disk load on demand."""
        hot = self._t.hot
        if not BACKGROUND_FILL or not hot.resident or hot.all_loaded or self._c.init_kind == "callable":
            return
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="embcache-fill")
        self.executor.submit(_fill_weakly, weakref.ref(self), self._stopping)

    def _fill_step(self, start: int) -> int | None:
        """Make the next few never-written, not yet loaded chunks from ``start``; returns where
        to go on, or None when done. Records are made outside the lock; installed under it,
        keeping rows made or changed meanwhile (`HotTier.fill_chunk`)."""
        hot, cr = self._t.hot, self._c.chunk_rows
        group = max(1, FILL_BYTES // (cr * self._c.row_bytes))
        with self._c.lock:
            if self._c.closed or hot.all_loaded:
                return None
            n = len(hot.loaded)
            picked: list[int] = []
            c = start
            while c < n and len(picked) < group:
                end = min(n, c + 4 * group)
                for k in np.flatnonzero(~hot.loaded[c:end]).tolist():
                    if len(picked) < group and self._fresh_chunk(c + k):
                        picked.append(c + k)
                c = end if len(picked) < group else picked[-1] + 1
            if not picked:
                hot.all_loaded = bool(hot.loaded.all())
                return None
        made = [(k, self._c.init_records(k, min(cr, self._c.num_rows - k * cr))) for k in picked]
        with self._c.lock:
            if self._c.closed:
                return None
            for k, recs in made:
                if not hot.loaded[k] and self._fresh_chunk(k):
                    hot.fill_chunk(k, recs)
            if c >= n:
                hot.all_loaded = bool(hot.loaded.all())
        return c

    def _fresh_chunk(self, chunk: int) -> bool:
        """No row of ``chunk`` was ever written below the pool (no base file, no delta record)."""
        if self._v.disk is not None and self._v.cmap[chunk] != 0:
            return False
        return self._v.rows is None or not len(self._v.rows) or self._v.layout_of(chunk) == (0, None)

    def _init_chunks_in_place(self, chunks: np.ndarray) -> None:
        """Initial values of ``chunks`` written straight into the pool (one of `materialize`'s threads)."""
        weight = self._t.np_views["weight"]
        fills = [(self._t.np_views[f.name], f.fill) for f in self._c.schema.fields.values()
                 if f.name != "weight" and f.fill]
        for c in chunks.tolist():
            lo, hi = self._t.hot.chunk_range(c)
            if self._c.init_kind == "normal":
                normal_rows(np.arange(lo, hi), self._c.dim, self._c.seed, self._c.init_std, out=weight[lo:hi])
            for view, value in fills:
                view[lo:hi] = value
