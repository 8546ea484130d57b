"""Compaction: folding delta segments into base chunk files, a bounded round at a time.

`Compaction` is the part of `Versions` that decides when segments are folded (`needs`,
`maybe_compact`), runs background passes a round at a time (`step`), and folds a round: plan
it under the lock, fold its chunks (in place where no other version reads the file, inplace.py;
else as new files of a fresh generation, by the compaction process where there is one,
foldproc.py), publish the new layout of the same rows and give back what it replaced
(garbage.py). It sees `Versions` only as a `Writer` (the live layout, the writer lock and the
flushes waiting for it), held weakly: `Versions` holds this. See docs/store-format.md,
"Compaction", for the protocol.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import fileio, foldproc, idsets, inplace, sharing
from .chunkrows import ChunkRows
from .core import StoreCore
from .disk import Disk, Manifest, Segment
from .errors import CorruptStoreError
from .fold import fold_chunk
from .foldproc import FoldProcess
from .garbage import Garbage
from .rowindex import RowIndex
from .sharing import Sharing

if TYPE_CHECKING:
    from .background import Background

# Compaction folds delta segments into base chunks once they hold this share of the table's
# bytes, or once there are this many. Updates spread over the table put rows of every chunk in
# every segment, so a pass rewrites the whole table: this share sets how often against the disk
# segments hold meanwhile (lower shares rewrote the table more often for no faster epochs; the
# measurements are in docs/benchmarks.md, `embcache bench disk --phases space`).
COMPACT_RATIO = 0.35
COMPACT_SEGMENTS = 32
# One compaction round rewrites ROUND_SHARE of the table's chunks, at most ROUND_BYTES: the
# longest a flush or close() waits for the writer lock, and the disk it needs beside the table.
ROUND_BYTES = 32 << 20
ROUND_SHARE = 1 / 16
# True: a round folds a dense raw chunk file that no other version reads in place (inplace.py),
# writing the changed rows, not the chunk. The file keeps its name; its header records the newest
# segment folded into it, so an older copy put back in its place is refused (Disk.check_folded).
# On by default; ``EMBCACHE_FOLD_IN_PLACE=0`` in the environment turns it off (every round then
# writes new files).
FOLD_IN_PLACE = os.environ.get("EMBCACHE_FOLD_IN_PLACE", "1") != "0"
# A round folding in place lets a waiting flush in once it has folded for this long since it
# began or last did: each time costs an fsync of the files folded since and a pass of the lock
# back and forth, which a flush waiting at every chunk (flushes back to back) would pay per chunk.
YIELD_AFTER_S = 0.05


class Writer(Protocol):
    """What `Compaction` and `Garbage` ask of `Versions`: the live layout (read under
    ``core.lock``; changed only by `adopt_layout`), the writer lock and the flushes waiting
    for it, the versions and the background jobs."""

    disk: Disk | None
    committed: list[Segment]
    pending: list[Segment]
    cmap: np.ndarray
    folded: np.ndarray
    version: int
    rows: RowIndex | None
    chunkrows: ChunkRows | None
    damage: CorruptStoreError | None
    flush_lock: Any
    next_seq: int
    next_gen: int
    own_gens_from: int
    writing_seqs: set[int]
    writing_gens: set[int]
    bg: Background

    @property
    def cmap_gen(self) -> int: ...

    @property
    def grown_unflushed(self) -> bool: ...

    def pinned(self) -> list[int]: ...

    def take_gen(self) -> int: ...

    def publish_layout(self, gen: int, remaining: list[Segment]) -> Manifest: ...

    def record_latest(self, version: int) -> None: ...

    def adopt_layout(self, m: Manifest, before: int, gen: int, cmap: np.ndarray, folded: np.ndarray,
                     remaining: list[Segment], dropped: int, chunks: np.ndarray) -> None: ...

    def apply_retention(self, collect: bool = True) -> None: ...

    def trim_heap(self) -> None: ...

    def await_round(self) -> None: ...

    def round_unlocked(self, running: bool) -> None: ...

    def flushes_to_let_in(self) -> bool: ...

    def wait_for_flushes(self, all_of_them: bool) -> None: ...

    def clean_if_due(self) -> None: ...

    def saw_damage(self, exc: CorruptStoreError) -> None: ...


@dataclass(frozen=True)
class _Round:
    """A compaction round's snapshot (`Compaction._plan_round`): the segments it folds, the chunk
    map and folded marks as they were, its chunks and the new chunk map generation."""

    share: Sharing
    segs: list[Segment]
    cmap: np.ndarray
    folded: np.ndarray
    old_gen: int
    chunks: np.ndarray
    gen: int


@dataclass(frozen=True)
class _Written:
    """What a round wrote (`Compaction._fold_planned`): new chunk files, chunks folded in place,
    both, the bytes of rows folded and the compaction byte count before."""

    new_files: np.ndarray
    in_place: np.ndarray
    chunks: np.ndarray
    folded_bytes: int
    written0: int


@dataclass(frozen=True)
class _Published:
    """A round's published layout (`Compaction._publish_round`): its manifest, the version before,
    the new chunk map and folded marks, the committed segments then and how many it dropped."""

    manifest: Manifest
    version: int
    cmap: np.ndarray
    folded: np.ndarray
    segs: list[Segment]
    drop: int


class Compaction:
    """When and how delta segments are folded into base chunks (see the module docstring).

    Owns the compaction process (``fold_proc``) and its failures; reads and changes the layout
    only through the `Writer` it serves and the `Garbage` beside it."""

    def __init__(self, core: StoreCore, writer: Writer, garbage: Garbage,
                 proc_failed: bool = False, proc_restarts: int = 0) -> None:
        self._c = core
        self._v = writer
        self._g = garbage
        self.fold_proc: FoldProcess | None = None  # the compaction process (foldproc.py), started by `maybe_compact`
        self.proc_failed = proc_failed  # started and failed twice, or could not start: never again
        self.proc_restarts = proc_restarts

    @property
    def _disk(self) -> Disk:
        disk = self._v.disk
        assert disk is not None, "a store without files has no disk"
        return disk

    def segment_bytes(self, held: bool = False) -> int:
        """Bytes of the committed segments' files; ``held``: on disk, without the dead records
        punched out of them (holes.py)."""
        return sum(s.live_bytes if held else s.nbytes for s in self._v.committed)

    def foldable(self) -> list[Segment]:
        """The committed segments compaction rounds fold now: not those newer than a kept version
        that shares the chunk files (they hold the rows changed since it, sharing.py). The
        thresholds count these only, so a pass never starts for segments it may not fold."""
        share = self._g.sharing
        return [s for s in self._v.committed if share.foldable(s)]

    def needs(self, ratio: float | None = None, segments: int = COMPACT_SEGMENTS,
              floor: int = 0, held: bool = True, adding: int = 0) -> bool:
        """Segments rounds may fold (`foldable`) past ``ratio`` of the table's bytes, or more
        than ``segments`` of them, with ``adding`` bytes more (a flush's own segment). ``held``:
        the bytes on disk, dead records given back (holes.py), which drop as the rounds fold
        chunk after chunk, not once a whole sweep is round; else the files' sizes."""
        ratio = COMPACT_RATIO if ratio is None else ratio  # read now: tests and benchmarks set it
        table = self._c.num_rows * self._c.row_bytes
        foldable = self.foldable()
        nbytes = sum(s.live_bytes if held else s.nbytes for s in foldable)
        return len(foldable) > segments or nbytes + adding > max(ratio * table, floor)

    def maybe_compact(self) -> None:
        """Compact in the background once segments pass the thresholds (after a flush, and at a
        writable open: many short open/flush/close runs would otherwise never get there). The
        compaction process starts here once segments hold half the share a pass starts at: ready
        before its first round (starting it costs a fraction of a second of CPU), never started by a store only
        read or by short runs that flush a little."""
        if self._v.grown_unflushed:
            return  # the next flush publishes the grown table first (see `_fold_round`)
        if self.fold_proc is None and not self._c.closed:
            if self.needs(COMPACT_RATIO / 2, COMPACT_SEGMENTS // 2):
                self.fold_process()
        if self.needs():
            self._v.bg.submit("_compact")

    def compact(self) -> None:
        """Fold every committed delta segment into base chunks now (normally automatic, in the
        background, a bounded round at a time). Each round is published at once (the version's
        manifest names the new layout of the same rows), so reopening and disk use follow.
        Segments newer than a pinned version that shares the chunk files stay: they hold the
        rows changed since it (docs/store-format.md, "Versions, pins and space")."""
        try:
            self._compact_now()
        except CorruptStoreError as exc:
            self._v.saw_damage(exc)
            raise

    def _compact_now(self) -> None:
        self._v.bg.wait()
        with self._v.flush_lock:
            self._v.await_round()
            while self._v.committed and self.compact_round(everything=True):
                pass
            self._disk.pool.drain()
            self._disk.segment_pool.drain()  # asked for by the user: disk use drops to what versions hold

    def _compact(self) -> None:
        """Background compaction: passes of bounded rounds. A pass goes on until every segment
        committed when it began has been folded (or left out by a flush); another follows at once
        while segments are still over the threshold, so under a steady stream of flushes the
        rounds sweep round the table continuously and each segment goes one sweep after it was
        written. A hot set of rows flushed over and over (its segments left out by the flushes
        themselves) ends the pass instead of being folded again and again.

        The writer lock is held for one round at a time and let go in between, so a flush (a
        checkpoint's, on the training thread) or `close()` waits for one round at most, and a
        background write-back or garbage collection asked for meanwhile runs between two rounds
        (queued behind the pass, it would wait for all of it: evictions would write dirty rows on
        the training thread, and segments that flushes left out would stay on disk).
        """
        state = self.step(None)
        while state is not None and not self._c.closed and self._v.damage is None:
            state = self.step(state)

    def step(self, state: tuple[int, int] | None) -> tuple[int, int] | None:
        """One round of a background compaction pass; returns the pass's state for the next round
        (the newest segment when the sweep began, the superseded count then), or None when the
        pass is over. ``state=None`` begins a pass. The background runner calls it one round at a
        time through a weak reference, so a store dropped without close() is released between two
        rounds (`background._run_weakly`)."""
        if state is None:
            self._await_fold_process()
            state = (-1, self._c.stats.superseded_segments)
        target, superseded = state
        self._v.wait_for_flushes(all_of_them=True)  # a flush asked for the writer lock: it goes first
        if self._c.closed or self._v.damage is not None:
            return None
        self._v.clean_if_due()
        with self._v.flush_lock:
            if self._g.collect_due:
                self._g.collect_due = False
                self._g.collect_locked(self._disk, at_open=False)
            if not self._v.committed or self._v.committed[0].seq > target:
                # Round once: sweep again while segments are over the threshold, or over half
                # of it while flushes add rows that stay (none of their segments left out).
                hot_set = self._c.stats.superseded_segments != superseded
                if not (
                    self.needs()
                    or (not hot_set and self.needs(COMPACT_RATIO / 2, COMPACT_SEGMENTS // 2))
                ):
                    # The pass is over: the files kept for the next round's reuse go, and
                    # disk use drops to what the versions hold.
                    self._disk.pool.drain()
                    return None
                foldable = self.foldable()
                if not foldable:
                    self._disk.pool.drain()
                    return None
                target, superseded = foldable[-1].seq, self._c.stats.superseded_segments
            if not self.compact_round(unlocked=True):
                self._disk.pool.drain()
                return None
        return target, superseded

    def _await_fold_process(self) -> None:
        """Let a compaction process that is starting come up before a background pass (at most
        foldproc.START_WAIT_S): the pass is in the background, and its rounds folded here would
        hold the GIL beside the training thread."""
        deadline = time.monotonic() + foldproc.START_WAIT_S
        while (proc := self.fold_proc) is not None and not self._c.closed:
            if self.fold_process() is not None or self.fold_proc is None:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            proc.wait_ready(left)  # wakes as the child comes up or dies, or the store closes (`wake`)

    def wake(self) -> None:
        """The store closed: a pass waiting for the compaction process to start stops waiting."""
        proc = self.fold_proc
        if proc is not None:
            proc.interrupt()

    def _round_chunks(self, segs: list[Segment], everything: bool) -> np.ndarray:
        """The chunks one round rewrites: those the oldest segments still need folded (so that a
        prefix of segments can be dropped), in chunk order, at most ROUND_BYTES of them. In chunk
        order, the records a round kills lie next to those the rounds before it killed, so each
        segment gets one hole a round (holes.py: a punch has a fixed cost however small, and a
        round of scattered chunks would make many a segment)."""
        chunk_bytes = self._c.chunk_rows * self._c.row_bytes
        table = self._c.num_rows * self._c.row_bytes
        limit = max(1, min(ROUND_BYTES, int(table * ROUND_SHARE)) // chunk_bytes)
        if everything:
            limit = max(limit, ROUND_BYTES // chunk_bytes)
        folded = self._v.folded
        taken = np.zeros(len(folded), np.bool_)
        picked: list[np.ndarray] = []
        count = 0
        for s in segs:  # oldest first: its chunks go before any newer segment's
            c = s.idx_chunk[(folded[s.idx_chunk] < s.seq) & ~taken[s.idx_chunk]]
            if not len(c):
                continue
            # Only part of this segment's chunks may fit: the first ones. A newer segment's
            # chunks never displace an older one's, or the oldest segment (the one whose drop
            # frees its file) could wait for a whole pass over the newer ones.
            c = c[: limit - count]
            taken[c] = True
            picked.append(c)
            count += len(c)
            if count >= limit:
                break
        if not picked:
            return np.zeros(0, np.int64)
        return np.sort(np.concatenate(picked)).astype(np.int64)


    def _fold_in_place(
        self, chunks: np.ndarray, cmap: np.ndarray, folded0: np.ndarray, segs: list[Segment],
        share: sharing.Sharing, gen: int, yielding: bool = False,
    ) -> np.ndarray:
        """Fold those of ``chunks`` whose base file may change in place (inplace.py) and return
        them: dense raw files that no version on disk reads but the writer's and the pinned
        versions sharing its chunk files (which list every segment the round folds, so their
        rows stay the same), while no read-only handle holds any of those versions (their
        reader locks are held exclusively meanwhile: a handle opening one waits). Each file
        changes while no read of this process runs (`FilePool.folding`); the files are durable
        before the intent goes. Caller holds the writer lock.

        ``yielding`` (a background round, whose caller holds the writer lock once): between two
        chunks a waiting flush goes first. Its new version reads the same files, which are whole
        between two chunks; the round then holds that version's reader lock too before it goes
        on, or, where a read-only handle opened it meanwhile, writes the rest as new files."""
        disk = self._disk
        none = np.zeros(0, np.int64)
        cand = chunks[cmap[chunks] > 0] if FOLD_IN_PLACE else none
        if not len(cand):
            return none
        alone = disk.lock_version_alone(self._v.version)
        if alone is None:
            return none
        locks = [alone]
        try:
            listed = disk.list_versions()
            cand = self._alone_in_place(cand, cmap, share, locks, listed)
            if not len(cand):
                return none
            disk.compaction_bytes_written += inplace.write_intent(
                disk, gen, [(c, int(cmap[c]), int(folded0[c])) for c in cand.tolist()], [s.seq for s in segs])
            return self._fold_files_in_place(cand, cmap, folded0, segs, locks, listed, yielding)
        finally:
            for lk in locks:
                disk.unlock_reader(lk)

    def _alone_in_place(
        self, cand: np.ndarray, cmap: np.ndarray, share: sharing.Sharing, locks: list[int], listed: list[int]
    ) -> np.ndarray:
        """Those of chunks ``cand`` whose files may change in place: raw files no version of
        ``listed`` reads but the writer's and the sharing versions, whose reader locks are taken
        (added to ``locks``). None of them where another version's manifest went missing."""
        disk = self._disk
        others = [v for v in listed if v != self._v.version]
        for v in share.members:
            if v in others and (lk := disk.lock_version_alone(v)) is not None:
                locks.append(lk)
                others.remove(v)
        for v in others:  # a file another version reads stays as it is: copy on write
            m = self._g.manifest_of(v)
            if m is None:
                return np.zeros(0, np.int64)
            if m.chunkmap:
                theirs = self._g.chunkmap_of(m)
                k = cand[cand < len(theirs)]
                cand = idsets.difference(cand, k[theirs[k] == cmap[k]])
        return np.asarray([c for c in cand.tolist() if inplace.is_raw(disk, c, int(cmap[c]))], np.int64)

    def _fold_files_in_place(
        self, cand: np.ndarray, cmap: np.ndarray, folded0: np.ndarray, segs: list[Segment],
        locks: list[int], listed: list[int], yielding: bool,
    ) -> np.ndarray:
        """Fold chunks ``cand`` into their files in place, their intent written; return those
        done (all, or those before a flush let in published a version a read-only handle holds).
        The files are durable and the intent dropped when it returns; see `_fold_in_place`."""
        disk = self._disk
        done: list[int] = []
        names: list[str] = []
        unsynced: list[str] = []
        c = -1
        since = time.monotonic()
        try:
            for c in cand.tolist():
                if yielding and self._v.flushes_to_let_in() and time.monotonic() - since >= YIELD_AFTER_S:
                    if unsynced:  # the flush's manifest names these files: durable first
                        fileio.fsync_files(disk._chunks_fd, unsynced, disk.root / "chunks")
                        unsynced.clear()
                    if not self._let_flush_in(locks, listed):
                        break
                    since = time.monotonic()
                names.append(self._fold_file_in_place(c, int(cmap[c]), int(folded0[c]), segs))
                done.append(c)
                unsynced.append(names[-1])
            if unsynced:
                fileio.sync_written(disk._chunks_fd, unsynced, disk.root / "chunks")
        except CorruptStoreError:
            # raised before that chunk's first write: the files folded so far are whole
            if names:
                fileio.sync_written(disk._chunks_fd, names, disk.root / "chunks")
            inplace.drop_intent(disk, durable=True)
            raise
        except BaseException:
            self._redo_in_place([*done, c], cmap)
            raise
        inplace.drop_intent(disk)
        return np.asarray(done, np.int64)

    def _fold_file_in_place(self, c: int, g: int, folded0: int, segs: list[Segment]) -> str:
        """Fold ``segs`` into chunk ``c``'s file of generation ``g`` in place; its file name."""
        disk = self._disk
        rows, recs = inplace.newest_records(c, disk, segs, folded0)  # (segment reads: outside)
        with disk.pool.folding():
            n = inplace.fold_chunk(disk, c, g, rows, recs, verify=g < self._v.own_gens_from, newest=segs[-1].seq)
            disk.bytes_written += n
            disk.compaction_bytes_written += n
            self._forget_chunk_file(c, g)
        return disk.chunk_path(c, g).name

    def _redo_in_place(self, chunks: list[int], cmap: np.ndarray) -> None:
        """A write failed half-way through the last of ``chunks``: that file's blocks may fail
        their checksums until the fold is redone. Redone now where the disk lets it, else at the
        next writable open."""
        disk = self._disk
        try:
            with disk.pool.folding():
                inplace.redo(disk, only=set(chunks))
                for d in chunks:
                    self._forget_chunk_file(d, int(cmap[d]))
        except BaseException:
            pass

    def _let_flush_in(self, locks: list[int], listed: list[int]) -> bool:
        """Let go of the writer lock until the flushes waiting for it got it and are done, then
        hold the reader locks of the versions they published (added to ``locks``; ``listed``:
        the versions on disk before, updated). False where a read-only handle holds one of them,
        or the store closes: the caller stops folding in place."""
        self._v.flush_lock.release()
        try:
            self._v.wait_for_flushes(all_of_them=False)
        finally:
            self._v.flush_lock.acquire()
        if self._c.closed:
            return False
        now = self._disk.list_versions()
        for v in now:
            if v not in listed:  # published meanwhile: reads the files being folded
                lk = self._disk.lock_version_alone(v)
                if lk is None:
                    return False
                locks.append(lk)
                listed.append(v)
        return True

    def _forget_chunk_file(self, c: int, g: int) -> None:
        """Chunk file (c, g) changed in place: this handle's cached descriptors and block
        checksums of it go (the next read reads its new directory)."""
        self._disk._directories.pop((c, g), None)
        reader = self._v.chunkrows
        if reader is not None:
            reader.forget([(c, g)])

    def _fold_elsewhere(
        self,
        proc: FoldProcess | None,
        chunks: np.ndarray,
        cmap: np.ndarray,
        folded: np.ndarray,
        segs: list[Segment],
        gen: int,
    ) -> dict | None:
        """Have the compaction process ``proc`` fold ``chunks`` into files of ``gen``; its result,
        or None where there is no process. Runs without the writer lock for a background round:
        it touches nothing of the store but the file pool (which has its own lock)."""
        disk = self._disk
        if proc is None or not len(chunks):
            return None
        reuse: list[Any] = []
        while len(reuse) < len(chunks) and (name := disk.pool.take()) is not None:
            reuse.append(name)
        ok, res = proc.fold(
            chunks.tolist(),
            cmap[chunks].tolist(),
            folded[chunks].tolist(),
            [s.seq for s in segs],
            gen,
            self._c.compress,
            self._v.own_gens_from,
            reuse,
        )
        if res["left"] is not None:
            disk.pool.restore(res["left"])
        res["ok"] = ok
        return res

    def _fold_chunks(
        self, chunks: np.ndarray, cmap: np.ndarray, folded: np.ndarray, segs: list[Segment], gen: int, res: dict | None
    ) -> np.ndarray:
        """Write ``chunks`` (sorted) with ``segs`` folded in as durable files of ``gen``, given what
        the compaction process did (``res``, `_fold_elsewhere`); return those written (all of
        them, or a prefix when the store closes meanwhile). Folded in this thread: the chunks the
        process left (those that need initial values, which only the
        store can compute), every chunk of a round it failed, or all where there is none.
        Caller holds the writer lock."""
        disk = self._disk
        own: list[int] = []
        done = np.zeros(0, np.int64)
        if res is not None:
            if res["ok"]:
                disk.bytes_read += res["bytes_read"]
                disk.bytes_written += res["bytes_written"]
                disk.compaction_bytes_written += res["bytes_written"]
                disk.segment_reads[0] += res["segment_reads"]
                with self._c.lock:
                    self._c.stats.compaction_process_chunks += len(res["done"])
                if not res["skipped"]:
                    return chunks
                own = res["skipped"]
                done = np.asarray(res["done"], np.int64)
            else:
                with self._c.lock:
                    self._c.stats.compaction_process_failures += 1
        if not own:
            own = chunks.tolist()
        handover = threading.get_ident() != self._c.row_thread  # a training thread may want the GIL
        written = []
        for c in own:
            if self._c.closed:  # close() waits for the writer lock: publish what is done, stop
                break
            got = fold_chunk(
                disk,
                c,
                int(cmap[c]),
                segs,
                verify=int(cmap[c]) < self._v.own_gens_from,
                init_rows=self._c.init_rows,
                folded=int(folded[c]),
            )
            assert got is not None, "a fold given the initial values always folds"
            recs, present = got
            disk.write_chunk(c, gen, recs, self._c.compress, durable=False, present=present, folded=segs[-1].seq)
            if handover:
                time.sleep(0)  # hand the GIL to a waiting training thread once per chunk (see `_fold_round`)
            written.append(c)
        disk.sync_chunks(written, gen)  # durable before the manifest names them
        return np.sort(np.concatenate([done, np.asarray(written, np.int64)]))

    def fold_process(self) -> FoldProcess | None:
        """The store's compaction process, started here on the first call (`maybe_compact`
        makes it) for a writable disk store the process is wanted for (`foldproc.wanted`); None
        while it starts, after it failed twice, or where it is not wanted."""
        proc = self.fold_proc
        if proc is None:
            if (
                self._v.disk is None
                or self.proc_failed
                or self._c.readonly
                or not foldproc.wanted(self._c.num_rows * self._c.row_bytes)
            ):
                return None
            try:
                proc = self.fold_proc = FoldProcess(
                    self._disk.root,
                    self._c.num_rows,
                    self._c.chunk_rows,
                    self._c.row_bytes,
                    self._disk.uid,
                    unbound=self._disk.unbound,
                )
            except Exception:  # no interpreter to start (an embedded Python), no processes allowed
                self.proc_failed = True
                return None
        if proc.usable():
            return proc
        if proc.broken:  # it died or failed: one more start, then this thread for good
            proc.close()
            self.fold_proc = None
            self.proc_failed = self.proc_restarts >= 1
            self.proc_restarts += 1
        return None

    def compact_round(self, everything: bool = False, unlocked: bool = False) -> bool:
        """One round of compaction (`_fold_round`), its time counted in ``stats().compaction_seconds``."""
        t0 = time.perf_counter()
        try:
            return self._fold_round(everything, unlocked)
        finally:
            self._c.stats.compaction_seconds += time.perf_counter() - t0

    def _fold_round(self, everything: bool = False, unlocked: bool = False) -> bool:
        """Rewrite a bounded set of chunks with the committed segments' rows folded in, drop the
        prefix of segments now folded everywhere, and publish the new layout of the same rows.
        Caller holds the writer lock. False if there was nothing to do or the store closed.

        Between chunks the round sleeps for zero seconds: that lets go of the GIL, which a
        thread computing in numpy otherwise keeps until Python's switch interval forces it out,
        so a training thread's store call would wait that long at each of its own hand-overs.
        A round that runs on the thread of the latest get/update (a flush's backpressure on the
        training thread) has nobody to hand it to and skips the sleep, whose cost is the kernel's
        timer slack per chunk.

        ``unlocked`` (background rounds, whose caller holds the writer lock exactly once): where the
        compaction process folds, the writer lock is let go of while it does, so a flush does not
        wait for a round's fold (tens of milliseconds). Nothing a flush changes meanwhile moves
        the round's result: it appends segments newer than every one folded (they stay in the
        layout) and may leave out segments all of whose rows it flushed again (no longer in the
        layout, and their rows newer elsewhere); the chunk map moves only by rounds, which never
        overlap (`Versions.await_round`). So the round publishes over the layout as it finds it then.

        Only the segments every pinned version sharing the chunk files lists too are folded
        (``self._g.sharing``, sharing.py), and each of those versions is published again with the
        new chunk map after the writer's (`Garbage.repoint`).

        Each chunk map records, per chunk, the newest segment folded into its base file; a segment
        goes once every chunk it touches has folded it. Only a prefix of segments is ever dropped,
        so every segment kept is newer than every one dropped: re-applying a kept segment to a
        chunk that already holds it (a store written before chunk maps recorded this) gives the
        same rows.
        """
        plan = self._plan_round(everything)
        if plan is None:
            return False
        proc = self.fold_process()
        if unlocked:  # the writer lock may be let go of meanwhile: the process folds, or a flush goes first
            self._v.round_unlocked(True)
        try:
            done = self._fold_planned(plan, proc, unlocked)
            if done is None:
                return False
            new = self._publish_round(plan, done)
            if new is None:
                return False  # fail-stop: a damaged file was met meanwhile, nothing more is written
        finally:
            with self._c.lock:
                self._v.writing_gens.discard(plan.gen)
            if unlocked:
                self._v.round_unlocked(False)
        ready = self._adopt_round(plan, done, new)
        return self._collect_round(plan, done, new, ready)

    def _plan_round(self, everything: bool) -> _Round | None:
        """What a round folds, taken under the lock (caller holds the writer lock), with a new
        chunk map generation; None if there is nothing to fold, the store closed or it grew."""
        with self._c.lock:
            share = self._g.sharing
            segs = [s for s in self._v.committed if share.foldable(s)]
            # A grown table's layout is published by its next flush, never by a round: a round
            # rewrites the manifest of the version it folds, which has the size before the growth.
            if self._c.closed or not segs or self._v.grown_unflushed:
                return None
            cmap = self._v.cmap.copy()
            folded = self._v.folded  # replaced, never changed in place: only rounds move it
            old_gen = self._v.cmap_gen
            chunks = self._round_chunks(segs, everything)
            gen = self._v.take_gen()
            self._v.writing_gens.add(gen)
        return _Round(share, segs, cmap, folded, old_gen, chunks, gen)

    def _fold_planned(self, r: _Round, proc: FoldProcess | None, unlocked: bool) -> _Written | None:
        """Fold the round's chunks. Chunk files only this version reads are folded in place first,
        under the writer lock (no flush publishes a version that reads them meanwhile); the others
        are written as new files of ``r.gen``, by the compaction process where there is one (a
        background round lets go of the writer lock meanwhile). None: the store closed first."""
        disk = self._disk
        release = unlocked and proc is not None
        folded_bytes = self._c.row_bytes * sum(
            inplace.distinct_rows(c, r.segs, int(r.folded[c])) for c in r.chunks.tolist())
        written0 = disk.compaction_bytes_written
        in_place = self._fold_in_place(r.chunks, r.cmap, r.folded, r.segs, r.share, r.gen, yielding=unlocked)
        chunks = idsets.difference(r.chunks, in_place)
        planned = len(chunks)
        if release:
            self._v.flush_lock.release()
        try:
            res = self._fold_elsewhere(proc, chunks, r.cmap, r.folded, r.segs, r.gen)
        finally:
            if release:
                self._v.flush_lock.acquire()
        new_files = self._fold_chunks(chunks, r.cmap, r.folded, r.segs, r.gen, res)
        if self._c.closed and not len(new_files) and planned and not len(in_place):
            return None
        return _Written(new_files, in_place, idsets.union(new_files, in_place), folded_bytes, written0)

    def _publish_round(self, r: _Round, w: _Written) -> _Published | None:
        """Publish the layout with the round's chunks folded: new chunk map, and without the
        leading segments now folded everywhere. Over the layout as it is now: a flush may have
        added (or left out) segments meanwhile. None where a damaged file was met meanwhile."""
        newest = r.segs[-1].seq
        with self._c.lock:
            segs = list(self._v.committed)
        new_cmap = r.cmap.copy()  # rounds never overlap: the chunk map is the snapshot's
        new_cmap[w.new_files] = r.gen  # (a file folded in place keeps its name)
        folded = self._v.folded.copy()
        folded[w.chunks] = newest
        drop = 0
        for s in segs:
            if not (folded[s.idx_chunk] >= s.seq).all():
                break
            drop += 1
        if self._v.damage is not None:
            return None
        self._disk.write_chunkmap(r.gen, new_cmap, folded)
        version = self._v.version
        m = self._v.publish_layout(r.gen, segs[drop:])
        return _Published(m, version, new_cmap, folded, segs, drop)

    def _adopt_round(self, r: _Round, w: _Written, p: _Published) -> int:
        """The published round becomes the live layout (and the shared versions' too); returns
        the file pool's epoch from which reads see it (`holes.py`)."""
        disk = self._disk
        m = p.manifest
        self._v.record_latest(m.version)
        with self._c.lock:  # the caller holds the writer lock: the committed segments are those read above
            assert [s.seq for s in self._v.committed] == [s.seq for s in p.segs], "layout moved during compaction"
            self._v.adopt_layout(m, p.version, r.gen, p.cmap, p.folded, p.segs[p.drop:], p.drop, w.chunks)
            self._c.stats.compactions += 1
            self._c.stats.chunks_folded_in_place += len(w.in_place)
            self._c.stats.compaction_folded_bytes += w.folded_bytes
            # Reads planned from here on read the records this round folded from the new base
            # files; those planned before, without the lock, register before this epoch.
            ready = disk.pool.seal()
        # The kept versions that share the chunk files read the new ones too (sharing.py).
        self._g.repoint(r.share.members, r.old_gen, r.gen, r.segs, p.folded)
        with self._c.lock:
            self._c.stats.compaction_bytes_written += disk.compaction_bytes_written - w.written0
        return ready

    def _collect_round(self, r: _Round, w: _Written, p: _Published, ready: int) -> bool:
        """Give back what the round replaced: dead records, the replaced chunk files and dropped
        segments once no kept version uses them (round by round, so disk use stays near the table
        plus one round; the dropped segments' descriptors close when the last reader lets go).
        False if the store closed or met damage meanwhile (the next open collects it)."""
        if self._c.closed or self._v.damage is not None:
            return False
        disk = self._disk
        listed = disk.list_versions()  # (for both: nothing adds or drops a version meanwhile)
        self._g.refresh_sharing(listed)
        self._g.kill_dead(ready, listed)
        disk.pool.limit = len(w.new_files)  # the next round of the pass rewrites about as many files
        replaced = [(c, g) for c, g in zip(w.new_files.tolist(), r.cmap[w.new_files].tolist()) if g]
        version = p.version
        if not (p.manifest.version == version
                and self._g.collect_replaced(disk, version, replaced, p.segs[: p.drop], r.old_gen, listed)):
            self._v.apply_retention(collect=False)
            self._g.collect_locked(disk, at_open=False, pool=True)
        self._v.trim_heap()
        return True
