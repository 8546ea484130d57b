"""Read-ahead of announced rows: lookahead hints (`upcoming`), the kernel's read-ahead, whole
chunks loaded into the warm tier, and hints read with a miss or by the prefetch thread.

`ReadAhead` belongs to `Tiers`. A hint names the rows of coming batches; where they come from
the disk it asks the kernel to read their base-chunk blocks (`posix_fadvise`), or has chunks a
hint wants a good part of read whole into the warm slab (chunkload.py); where reads come from
the page cache, the next miss reads the announced rows with its own (`hints_to_read`); else the
prefetch thread (prefetch.py) reads them a hint at a time. It also keeps the recent read cost
per row (`read_seconds_per_row`) and the share of reads the page cache did not serve. It sees
the tiers as `prefetch.Reads` (held weakly: they hold this).
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, cast

import numpy as np

from . import idsets
from .blockcrc import first_bad_block
from .chunkload import ChunkLoader
from .chunkrows import DENSE_ROWS
from .core import StoreCore
from .disk import Disk
from .errors import CorruptStoreError
from .prefetch import Prefetcher, Reads
from .rowindex import gather_deltas

if TYPE_CHECKING:
    from .tiers import Layout

# While fewer reads than this share miss the page cache, lookahead hints are read by the training
# thread's next miss, not by the prefetch thread (see `upcoming`).
WARM_UNCACHED_SHARE = 0.1


def thin(chunks: np.ndarray, chunk_rows: int) -> np.ndarray:
    """Per row of sorted ``chunks``: its chunk has too few rows here to be asked for whole."""
    counts = np.diff(idsets.runs(chunks))
    return np.repeat(counts * DENSE_ROWS < chunk_rows, counts)


class ReadAhead:
    """Lookahead hints and the reads ahead they start (see the module docstring)."""

    def __init__(self, core: StoreCore, layout: Layout, tiers: Reads, prefetcher: Prefetcher) -> None:
        self._c = core
        self._v = layout
        self._t = cast(Reads, weakref.proxy(tiers))  # (they hold this)
        self._p = prefetcher
        self.hinted: list | None = None  # ids of `upcoming` hints the prefetch thread has not taken yet
        self._hint_task = False  # a `_prefetch_hinted` task is queued or running
        self._held_advice: np.ndarray | None = None  # announced rows `_advise` asks the kernel for next time
        self._uncached_share = float("nan")  # of recent reads below the hot tier, the share not cached
        self._read_s_per_row = float("nan")  # recent wall seconds per row read below the hot tier
        self._cache_seen: tuple[int, int] = (0, 0)  # the reader's ``cache_counts`` when last looked at
        self.loader: ChunkLoader | None = None  # announced chunks read whole into the warm slab (chunkload.py)
        self._loader_tried = False

    @property
    def _disk(self) -> Disk:
        disk = self._v.disk
        assert disk is not None, "a store without files has no disk"
        return disk

    def _take_hints(self, mids: np.ndarray) -> np.ndarray | None:
        """Ids of `upcoming` hints no prefetch has taken yet, still expected and not resident
        (caller holds the lock and is about to read ``mids``): a miss reads them in the same
        batch, so with a lookahead window one plan and one submission of reads serve several
        coming batches (cheaper per row than one read per batch, and the prefetch thread, which
        would compete with the training thread for the GIL, has nothing left to do). None if
        there is none."""
        hot = self._t.hot
        hinted = np.concatenate(cast(list, self.hinted))
        self.hinted = []
        cand = idsets.unique(hinted[cast(np.ndarray, hot.want)[hinted] > 0])
        cand = cand[hot.slot_of[cand] == 0]
        fetching = self._p.fetching
        if fetching is not None and len(cand):  # rows the prefetch thread is reading now
            pos = np.minimum(fetching.searchsorted(cand), len(fetching) - 1)
            cand = cand[fetching[pos] != cand]
        cand = cand[~idsets.isin(cand, mids, b_sorted_unique=True)]
        cand = cand[: max(0, hot.limit // 4 - len(mids))]
        return cand if len(cand) else None

    def hints_to_read(self, mids: np.ndarray) -> np.ndarray | None:
        """Announced rows a miss of ``mids`` reads with its own (`_take_hints`), but for rows of
        chunks held warm (or being read into it): those are served from there when their get
        comes, so reading them ahead would only gather rows to drop, or wait for reads a later
        batch wants."""
        ahead = self._take_hints(mids)
        if ahead is not None and (len(self._t.warm) or (self.loader is not None and len(self.loader))):
            chunks = ahead // self._c.chunk_rows
            keep = ~idsets.isin(chunks, self._t.warm.chunks(), b_sorted_unique=True)
            if self.loader is not None:
                keep &= ~self.loader.loading(chunks)
            ahead = ahead[keep] if keep.any() else None
        return ahead

    def follow_window(self, idx: np.ndarray, slots: np.ndarray, missing: np.ndarray, for_write: bool) -> None:
        """With a lookahead window (`upcoming`): a read consumes its rows' expected reads and
        counts whether the prefetch had them hot; a write of rows no coming batch reads marks
        them not recently used, so the background write-back cleans them and eviction drops
        them first (rows read once per epoch do not fill the cache)."""
        hot = self._t.hot
        if for_write:
            done = cast(np.ndarray, hot.want)[idx] == 0
            if done.any():
                hot.ref[slots[done & ~missing]] = 0
            return
        hinted = hot.consumed(idx)
        if hinted is not None:
            late = int(np.count_nonzero(hinted & missing))
            self._c.stats.prefetch_misses += late
            self._c.stats.prefetch_hits += int(np.count_nonzero(hinted)) - late

    def note_read(self, seconds: float, rows: int) -> None:
        """A read of ``rows`` rows below the hot tier took ``seconds`` (`read_seconds_per_row`)."""
        if rows:
            per_row = seconds / rows
            last = self._read_s_per_row
            self._read_s_per_row = per_row if last != last else 0.8 * last + 0.2 * per_row

    def read_seconds_per_row(self) -> float:
        """Recent wall time per row that `get` or the prefetch thread read below the hot tier
        (from the warm tier, the page cache or the disk); NaN before any such read.
        `LookaheadSampler` sizes its window from it: batches announced ahead cover the time a
        batch's rows take to arrive."""
        return self._read_s_per_row

    def upcoming(self, idx: np.ndarray) -> None:
        """`EmbeddingStore.upcoming` of validated ids (what the hint does where, documented there)."""
        if self._v.disk is None:
            return
        if self._t.hot.resident:
            self._p.later(idx)
            return
        with self._c.lock:
            self._c.check_open()
            self._t.hot.expect(idx)
            if self.hinted is None:
                self.hinted = []
            cached = not self._hint_task and self._reads_cached()
            # With a warm tier the kernel is asked even while reads come from the page cache:
            # a chunk held warm serves its rows without a hot slot, so reading announced rows
            # ahead into the hot tier (below) would only copy rows twice; and reads that look
            # cached (the share counts rows read one by one) may be whole chunks the disk serves.
            if not self._hint_task and self._t.warm.budget and self._advise(idx, cached):
                # Rows wait for the disk and each lies in a raw base chunk: the kernel reads them
                # ahead (whole chunks where the coming batches want a good part of one, as in
                # `ChunkShuffleSampler` order), and the get that first wants a chunk reads it from
                # the page cache, whole into the warm tier where it wants enough of it, which then
                # serves its other rows. No thread loads rows one by one and takes turns with
                # this one for the GIL, and no miss reads them early (it would wait for reads
                # still in flight).
                return
            self.hinted.append(idx)  # the store's own copy (as_ids copies)
            if self._hint_task:
                return  # the running task takes this hint on its next round (or a miss does)
            if cached:
                # Rows come up from the page cache: the next miss reads the announced rows with
                # its own in one batch (`hints_to_read`). A second thread would only take turns
                # with this one for the GIL (each hand-over a wake-up, on a loaded host a time
                # slice), so it reads only while rows come from the disk, where its reads overlap
                # the training step.
                if sum(len(h) for h in self.hinted) > self._t.hot.limit // 4:
                    del self.hinted[0]  # a hint only: its rows are read when their get comes
                return
            self._hint_task = True
            self._p.submit(self._prefetch_hinted)

    def _advise(self, idx: np.ndarray, cached: bool = False) -> bool:
        """Start the kernel reading the base-chunk blocks of announced rows that are not hot
        (``posix_fadvise(WILLNEED)``: asynchronous; whole chunks are asked from a helper thread).
        True if that covers every such row (none lies in a delta segment; see
        `ChunkRows.will_need`). ``cached``: recent reads came from the page cache; rows the
        kernel would be asked for block by block are then left to a miss that reads them ahead
        with its own (False; whole chunks are still asked for). Caller holds the lock."""
        reader = self._v.chunkrows_reader()
        if reader is None:
            return False
        cr = self._c.chunk_rows
        slab = self._t.warm.slab
        if slab is not None and self._held_advice is None and slab.locate(idx // cr) is not None:
            return True  # every row in a chunk held raw in memory: nothing to ask (most hints in chunk order)
        ids = idsets.unique(idx)
        ids = ids[self._t.hot.slot_of[ids] == 0]
        if len(ids) and self._chunk_loader() is not None:
            # Chunks this hint (with the rows held from the last one, below) wants a good part of
            # are read whole into the warm tier, whether or not rows of them have newer records
            # in delta segments (applied when taken in)
            held = self._held_advice
            both = ids if held is None else idsets.union(ids, held)
            if len(self._t.warm):
                both = both[~idsets.isin(both // cr, self._t.warm.chunks(), b_sorted_unique=True)]
            left = self._load_ahead(both, both // cr)
            if len(left) < len(both):
                ids = ids[idsets.isin(ids, left, b_sorted_unique=True)]
                if held is not None:
                    held = held[idsets.isin(held, left, b_sorted_unique=True)]
                    self._held_advice = held if len(held) else None
            if not len(ids) and self._held_advice is None:
                return True
        rows = self._v.rows
        if rows is not None and len(rows) and (rows.find(ids)[0] >= 0).any():
            return False
        if self._held_advice is None:
            c = ids // cr
            if reader.asked_whole(c, self._v.cmap[c]):
                return True  # every chunk of these rows was asked for whole lately (a window's later hints)
        held, self._held_advice = self._held_advice, None
        if held is not None:
            ids = idsets.union(ids, held)
        if len(self._t.warm):  # chunks held whole in memory need no disk read
            ids = ids[~idsets.isin(ids // cr, self._t.warm.chunks(), b_sorted_unique=True)]
        chunks = ids // cr

        if len(chunks):
            # Rows of a chunk this hint wants too few of to ask for it whole wait for the next
            # hint, once: in `ChunkShuffleSampler` order that brings the rest of the chunk's
            # share (the first batch of a window meets each chunk with a few rows), and asking
            # for those few first cost a synchronous header read and block requests for a chunk
            # the next hint asks for whole anyway.
            few = thin(chunks, cr)
            if held is not None and few.any():
                few &= ~idsets.isin(ids, held, b_sorted_unique=True)
            if few.any():
                self._held_advice = ids[few]
                ids, chunks = ids[~few], chunks[~few]
        covered = True
        if cached and len(chunks):
            sparse = thin(chunks, cr)
            if sparse.any():  # (a random order's rows, a row or two per chunk)
                ids, chunks, covered = ids[~sparse], chunks[~sparse], False
        gens = self._v.cmap[chunks]
        base = gens > 0
        if not base.any():
            return covered
        c = chunks[base]
        return reader.will_need(c, ids[base] - c * cr, gens[base]) and covered

    def _chunk_loader(self) -> ChunkLoader | None:
        """The loader of announced chunks, made at first need where io_uring is there and the warm
        tier can hold chunks (caller holds the lock)."""
        if self.loader is None and not self._loader_tried and self._v.disk is not None:
            self._loader_tried = True
            made = ChunkLoader(self._v.disk, self._t.warm)
            if made.usable:
                self.loader = made
        loader = self.loader
        return loader if loader is not None and loader.usable else None

    def _load_ahead(self, ids: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        """Start reading whole into the warm slab the base chunks of announced rows ``ids`` (not
        hot, not warm; sorted; chunks ``chunks``) of which the hint wants a good part; returns
        the ids left (caller holds the lock)."""
        if not len(ids):
            return ids
        bounds = idsets.runs(chunks)
        uc = chunks[bounds[:-1]]
        gens = self._v.cmap[uc]
        dense = (np.diff(bounds) * DENSE_ROWS >= self._c.chunk_rows) & (gens > 0)
        if not dense.any():
            return ids
        self.adopt_loads()  # completed loads first: their slots may be what the next ones need
        going = cast(ChunkLoader, self.loader).start(uc[dense].tolist(), gens[dense].tolist())
        if not going:
            return ids
        return ids[~idsets.isin(chunks, np.fromiter(going, np.int64, len(going)))]

    def adopt_loads(self, wait_for: np.ndarray | None = None) -> None:
        """Chunks read ahead whose reads completed (waiting for those of ``wait_for`` in flight)
        join the warm tier: checked (header, block checksums), brought up to date with their
        newer delta records, or given up where they fail or a compaction replaced the file (a
        miss then reads the chunk as usual and names any damage). Caller holds the lock."""
        loader = self.loader
        assert loader is not None
        t0 = time.perf_counter()
        done = loader.done() if wait_for is None else loader.done(wait_for)
        if wait_for is not None:
            self._c.stats.stall_seconds += time.perf_counter() - t0
        warm = self._t.warm
        for i, ld in enumerate(done):
            c = ld.chunk
            try:
                if int(self._v.cmap[c]) != ld.gen or self._disk.pool.moved_since(ld.seq):
                    warm.unreserve(c)  # compacted meanwhile (into a new file, or this one in place)
                    continue
                ok = ld.ok
                if ok:
                    try:
                        crcs = self._disk.raw_chunk_checksums(c, ld.gen, ld.head.tobytes())
                        ok = first_bad_block(ld.flat, crcs) < 0
                    except CorruptStoreError:  # a sparse or LZ4 file (or damage: the miss names it)
                        ok = False
                if not ok:
                    loader.refuse(c, ld.gen)
                    warm.unreserve(c)
                    continue
                _, delta = self._v.layout_of(c)
                if delta is not None:
                    ids, seg, pos, segs = delta
                    gather_deltas(ld.flat.reshape(-1, self._c.row_bytes), ids - c * self._c.chunk_rows, seg, pos, segs)
            except BaseException:  # (a delta segment unreadable): no slot stays reserved for nothing
                for rest in done[i:]:
                    if warm.loading(rest.chunk):
                        warm.unreserve(rest.chunk)
                raise
            warm.adopt(c)
            self._c.stats.cold_reads += 1
            self._c.stats.chunks_read_ahead += 1

    def _reads_cached(self) -> bool:
        """Whether this store's recent reads below the hot tier came from the page cache (under
        10% of them had to wait for the disk); False until some hundred reads tell (caller holds
        the lock)."""
        reader = self._v.chunkrows
        if reader is None:
            return False
        total, uncached = reader.cache_counts
        t0, u0 = self._cache_seen
        if total - t0 >= 256:
            share = (uncached - u0) / (total - t0)
            last = self._uncached_share
            self._uncached_share = share if last != last else 0.5 * last + 0.5 * share
            self._cache_seen = (total, uncached)
        return self._uncached_share < WARM_UNCACHED_SHARE

    def _prefetch_hinted(self) -> None:
        """The prefetch thread's work on hints: one hint (a coming batch) per round, oldest
        first, in one batch of reads (one plan, one submission, one install: the GIL a handful of
        times per round, not once per row).

        One hint, not every hint given so far: a get that misses rows of a round waits for the
        whole round, and at the start of an epoch the sampler announces its whole window at
        once; read in one round, the first batch's get waited for the reads of all of them (on a
        disk capped at 2,000 reads/s, 8 batches of 384 misses: 1.5 s). A round behind the training
        thread skips the rows a get already read (``want``), so catching up costs a filter per
        stale hint, not its reads."""
        while True:
            with self._c.lock:
                if self._c.closed or not self.hinted or self._reads_cached():
                    self._hint_task = False  # (reads from the page cache: see `upcoming`)
                    return
                hint = self.hinted.pop(0)
            self._p.prefetch(hint, True)
