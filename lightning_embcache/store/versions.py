"""Durability of EmbeddingStore: flush, versions and pins, background compaction and GC.

A private base class of `EmbeddingStore`; see docs/store-format.md for the protocol.

Concurrency design (docs/store.md, "Threads"): two locks, always taken in this order.

* ``self._flush_lock``, the *writer lock* (re-entrant): held for the whole of every job that
  changes what is on disk or which files the live layout reads: `flush`, the background
  write-back `_clean`, each compaction round (snapshot, reading the segments, writing chunks,
  publishing, collecting its garbage), garbage collection, retention and `pin`/`unpin`. So these
  never interleave: a round cannot fold a layout a flush or another round moved meanwhile, and
  garbage collection never runs while any of them is writing. Background compaction lets go of
  it between rounds (a waiting flush goes first), so no caller waits for more than one round,
  and while the compaction process folds a round's chunks (see `_fold_round`): a flush then runs
  beside the fold, and a round of another thread waits for it (`_await_round`).
* ``self._lock`` (in-memory state): taken briefly inside, and by get/update/evict.

Eviction write-back inside get/update holds only ``self._lock``: it only appends a *pending*
segment with a fresh sequence number, which a flush snapshots under ``self._lock`` and garbage
collection protects (numbers from its snapshot on). Files are never closed while another thread
may read them: a segment dropped from the layout closes its descriptor when its last reader lets
go of it (`Segment.__del__`); `close()` closes the rest after every thread stopped.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from . import fileio, foldproc, inplace, sharing
from .disk import Disk, Manifest, Segment
from .errors import CorruptStoreError, StoreError, VersionNotFoundError
from .fold import fold_chunk
from .foldproc import FoldProcess
from .holes import DeadRecords
from .memory import trim_heap
from .validate import version_arg

# Compaction folds delta segments into base chunks once they hold this share of the table's
# bytes, or once there are this many. Updates spread over the table put rows of every chunk in
# every segment, so a pass rewrites the whole table: this share sets how often against the disk
# segments hold meanwhile (lower shares rewrote the table more often for no faster epochs; the
# measurements are in docs/benchmarks.md, `embcache bench disk --phases space`).
COMPACT_RATIO = 0.35
COMPACT_SEGMENTS = 32
# Past this share a flush runs compaction rounds itself before writing (backpressure: flushes
# faster than background compaction would otherwise pile segments up without bound).
HARD_RATIO = 0.4
HARD_FLOOR = 256 << 10  # below this many bytes of segments no flush waits for compaction
# One compaction round rewrites ROUND_SHARE of the table's chunks, at most ROUND_BYTES: the
# longest a flush or close() waits for the writer lock, and the disk it needs beside the table.
ROUND_BYTES = 32 << 20
ROUND_SHARE = 1 / 16
# Dead records are given back once segments hold this share of the table on disk (a flush past
# HARD_RATIO gives them back first): below it a punch buys nothing, and each costs file-system
# metadata work (journal commits that a flush's fsync may wait for).
PUNCH_FROM = 0.3
# True: a round folds a dense raw chunk file that no other version reads in place (inplace.py),
# writing the changed rows, not the chunk. The file keeps its name; its header records the newest
# segment folded into it, so an older copy put back in its place is refused (Disk.check_folded).
# Off by default until the power-cut oracle's long run (tests/store/test_power_cut_oracle.py,
# "200-flushes", slow) passes with it on; ``EMBCACHE_FOLD_IN_PLACE=1`` turns it on.
FOLD_IN_PLACE = os.environ.get("EMBCACHE_FOLD_IN_PLACE") == "1"
# A round folding in place lets a waiting flush in once it has folded for this long since it
# began or last did: each time costs an fsync of the files folded since and a pass of the lock
# back and forth, which a flush waiting at every chunk (flushes back to back) would pay per chunk.
YIELD_AFTER_S = 0.05
KEEP_VERSIONS = 1  # unpinned versions kept: the latest only (pins and read-only handles keep theirs)


def _run_bg_weakly(ref: weakref.ReferenceType[Versioning], name: str) -> None:
    """A background job of the store ``ref`` names. The compaction pass goes a round at a time,
    holding the store only during a round: a store dropped without close() is collected between
    two rounds (its finalizer closes it), instead of living on as long as its background work."""
    store = ref()
    if store is None or store._closed or store._damage is not None:
        return
    if name != "_compact":
        store._run_bg(getattr(store, name))
        return
    try:
        state = store._compact_step(None)
        while state is not None:
            del store
            store = ref()
            if store is None or store._closed or store._damage is not None:
                return
            state = store._compact_step(state)
    except BaseException as exc:  # surfaced on the next flush()
        if store is not None:
            store._bg_error = exc
            if isinstance(exc, CorruptStoreError):
                store._saw_damage(exc)


class Versioning:
    """Flush, versions, pins, compaction, garbage collection (private base of EmbeddingStore)."""

    _disk: Any
    _row_thread: int  # the thread of the latest get/update (EmbeddingStore._waited)
    _damage: CorruptStoreError | None = None  # the first damaged file met: background work stops (fail-stop)
    _awaiting_round = 0  # of the flushes waiting, those waiting for the background round to end (`_await_round`)
    _grown_unflushed = False  # grown since the last flush: no compaction round until it publishes the size
    _table_rows: int  # rows of the whole table when the store is a shard of one (`ShardedStore`); 0: not
    _table_published: int  # the published version's `_table_rows` (a flush of a change of it alone)

    # ------------------------------------------------------------------ flush and versions
    def flush(self) -> int:
        """Make every update so far durable as a new version and return it.

        Thread-safe: may run in a background thread while another thread calls get/update;
        rows updated during the flush go into the next version.
        """
        t0 = time.perf_counter()
        self._check_usable(write=True)
        self._raise_bg_error()
        if self._disk is None:  # ephemeral memory store: nothing to make durable
            with self._lock:
                self._check_open()
                if self._hot.dirty.any():
                    self._hot.dirty[:] = 0
                    self._version += 1
                return self._version
        with self._lock:
            self._flush_waiting += 1  # a background compaction lets go of the writer lock between rounds
        try:
            self._flush_lock.acquire()
        finally:
            self._flush_done_waiting()
        try:
            # The segments this flush writes or commits count too (disk use peaks right after it),
            # up to half the limit: a flush of most of the table would otherwise have every
            # segment folded first, which costs a table's worth of writes and saves nothing.
            with self._lock:
                adding = int(np.count_nonzero(self._hot.dirty)) * self._row_bytes + self._pending_bytes
            adding = min(adding, int(HARD_RATIO * self._num_rows * self._row_bytes / 2))

            def over() -> bool:
                return self._needs_compaction(HARD_RATIO, 2 * COMPACT_SEGMENTS, HARD_FLOOR, held=True, adding=adding)

            if self._dead is not None and over():
                self._dead.run()  # dead records not given back yet go first (holes.py)
            if over():
                self._await_round()
            while over() and self._compact_round():
                # Flushes come faster than background compaction folds their rows: this flush
                # folds rounds itself first, so disk use stays bounded whatever the flush rate
                # (backpressure). Before its own writes: a round that fails publishes nothing.
                pass
            # Files kept for a pass's next round go before this flush adds its segment: disk use
            # peaks at a flush (segments at their most), and the pass they were kept for may not
            # go on (a round after this flush writes new files instead).
            self._disk.pool.drain()
            version = self._flush_locked()
        finally:
            self._flush_lock.release()
        self._trim_heap()
        self._maybe_compact()
        self._waited(t0, rows=False)
        return version

    def _flush_locked(self) -> int:
        """The body of `flush` (caller holds the writer lock)."""
        t0 = time.perf_counter()
        try:
            return self._flush_writing()
        finally:
            self._stats.flush_seconds += time.perf_counter() - t0

    def _flush_writing(self) -> int:
        with self._lock:
            self._check_open()
            hot = self._hot
            slots = np.flatnonzero(hot.dirty)
            layout = (self._cmap_gen, [s.seq for s in self._committed], self._num_rows)
            if (not len(slots) and not self._pending and layout == self._published
                    and self._table_rows == self._table_published):
                return self._version
            ids, slots, records, seq = self._begin_write_back(slots)
            pending = list(self._pending)
            # Segments every record of which has a newer one in this manifest (the same rows
            # updated and flushed again) leave the layout now, before compaction ever has to
            # fold them: a hot set of rows flushed over and over keeps one segment, not a pile
            # that a pass of rounds rewrites the whole table to drop.
            rows = self._rows
            gone = rows.superseded(self._committed + pending, ids) if rows is not None else set()
            # A segment a kept version lists stays (its file stays anyway): that version then
            # keeps sharing the chunk files compaction writes (sharing.py).
            gone = set() if self._version in self._pins else gone - self._sharing.segments
            kept = [g for g in self._committed + pending if g.seq not in gone]
            version = self._max_version + 1
            segs = [g.seq for g in kept]
        try:
            # one no manifest will list need not be durable
            self._disk.sync_segments([p for p in pending if p.seq not in gone])
            new = [self._disk.write_segment(seq, ids, records)] if len(ids) else []
            m = Manifest(version, self._cmap_gen, segs + [s.seq for s in new], parent=self._version,
                         num_rows=self._num_rows, table_rows=self._table_rows)
            self._parent = self._version
            self._disk.write_manifest(m)  # the commit point (of a growth too: `EmbeddingStore.grow`)
            self._published = (m.chunkmap, list(m.segments), m.num_rows)
            self._table_published = m.table_rows
            self._grown_unflushed = False
        except BaseException:
            self._end_write_back(slots, seq, ok=False)
            raise
        try:
            self._disk.write_latest(version)
        except StoreError:
            pass  # the version is published; the record only lags (open's check stays sound)
        with self._lock:
            self._end_write_back(slots, seq, ok=True)
            self._committed = kept + new
            self._pending = [p for p in self._pending if p not in pending]
            self._pending_bytes = sum(p.nbytes for p in self._pending)
            for seg in new:
                self._index_add(seg)
            if gone:
                # renumbered without them: the old index (and the descriptors of the segments
                # that left) goes when the last plan that holds it lets go
                self._index_rebuild()
                self._stats.superseded_segments += len(gone)
            self._version = self._max_version = version
            self._patch_warm(ids)  # the flushed rows are hot: their chunks' warm copies take them
            self._stats.flushes += 1
            self._stats.flushed_rows += len(ids)
        self._apply_retention()
        self._refresh_sharing()
        return version

    def versions(self) -> list[int]:
        """Versions still on disk (openable with ``open(path, version=v)``)."""
        if self._disk is None:
            return [self._version]
        return self._disk.list_versions()

    def pin(self, version: int) -> None:
        """Never reclaim ``version`` (until unpinned); persisted across opens."""
        self._check_usable(write=True)
        version = version_arg(version, "version")
        disk = self._require_disk("pin")
        with self._flush_lock:
            disk.read_manifest(version)  # raises VersionNotFoundError
            self._pins.add(version)
            try:
                disk.write_pins(self._pins)
            except BaseException:
                self._pins.discard(version)
                raise
            self._refresh_sharing()

    def unpin(self, version: int) -> None:
        """Release a version kept by `pin`; retention may then reclaim it (not a reader's)."""
        self._check_usable(write=True)
        version = version_arg(version, "version")
        disk = self._require_disk("unpin")
        with self._flush_lock:
            was = version in self._pins
            self._pins.discard(version)
            try:
                disk.write_pins(self._pins)
            except BaseException:
                if was:
                    self._pins.add(version)
                raise
            self._apply_retention()
            self._refresh_sharing()

    def pinned(self) -> list[int]:
        """The pinned versions, oldest first."""
        return sorted(self._pins)

    def manifest_checksum(self, version: int) -> str:
        """Hex checksum of a version's manifest (checkpoints record it to detect a foreign store)."""
        return self._require_disk("manifest_checksum").manifest_checksum(version_arg(version, "version"))

    def _require_disk(self, what: str) -> Disk:
        if self._disk is None:
            raise StoreError(f"{what}() needs a store on disk; this one was created with path=None")
        return self._disk

    def _apply_retention(self, collect: bool = True) -> None:
        """Drop versions that are not among the newest KEEP_VERSIONS, not pinned and not being read
        by a read-only handle (in any process), then collect their garbage in the background
        (``collect=False``: the caller collects). Caller holds the flush lock."""
        assert self._disk is not None
        if self._readonly:
            return
        versions = self._disk.list_versions()
        keep = set(versions[-KEEP_VERSIONS:]) | self._pins | {self._version}
        dropped = False
        for v in versions:
            if v not in keep and self._disk.drop_version_unless_read(v):
                dropped = True
        if dropped and collect:
            self._collect_due = True
            self._submit_bg(self._collect_garbage)

    def _load_version(self, version: int | None) -> None:
        disk = self._disk
        assert disk is not None
        versions = disk.list_versions()
        if not versions:
            raise CorruptStoreError(self._root, "holds no manifest (an interrupted create?)")
        latest = disk.read_latest(versions[-1])
        for _ in range(3):
            if versions[-1] >= latest:
                break
            # A writer publishes a manifest before it records it in LATEST: one published after
            # the listing above is in the folder now. Only a manifest still missing is damage.
            versions = disk.list_versions() or versions
            latest = disk.read_latest(versions[-1])
        if versions[-1] < latest and (version is None or not self._readonly):
            # Opening the newest manifest left would silently roll back (and a writer would then
            # collect the newer rows' segments as garbage).
            raise CorruptStoreError(
                disk.manifest_path(latest),
                f"missing: version {latest} was published here but the newest manifest left is version "
                f"{versions[-1]}; the store was damaged or rolled back (to recover what an older version "
                f"holds, open it read-only: EmbeddingStore.open(path, version=..., readonly=True))",
            )
        v = versions[-1] if version is None else version
        if self._readonly:
            # Register as a reader first, so the writer keeps this version's files while we read.
            for _ in range(10):
                self._reader_fd = disk.lock_reader(v)
                if disk.manifest_path(v).exists() or version is not None:
                    break
                disk.unlock_reader(self._reader_fd)
                versions = disk.list_versions()
                v = versions[-1]
        m = disk.read_manifest(v)
        # the table's rows at this version: a store grown since it was created says so in the
        # manifests from its growth on (older ones keep the size they had)
        self._num_rows = m.num_rows or int(self._meta["num_rows"])
        if self._num_rows < int(self._meta["num_rows"]):  # a table only grows
            raise CorruptStoreError(disk.manifest_path(v), f"names num_rows={self._num_rows}, fewer than META's "
                                                           f"{self._meta['num_rows']}")
        disk.resize(self._num_rows)
        # and per chunk the newest segment folded into its base file (see _compact_round)
        self._cmap, self._folded = disk.read_chunkmap_folded(m.chunkmap)
        # what its files must hold (Disk.check_folded); a read-only handle's version never changes
        disk.bind_chunkmap(self._cmap, self._folded, max(m.segments, default=0) if self._readonly else None)
        # An in-place fold a crash interrupted is finished before anything reads (inplace.py)
        if self._readonly:
            inplace.refuse_if_interrupted(disk, self._cmap)
        else:
            inplace.redo(disk)
        self._cmap_gen = m.chunkmap
        self._committed = [disk.open_segment(s) for s in m.segments]
        self._published = (m.chunkmap, list(m.segments), self._num_rows)
        self._table_rows = self._table_published = m.table_rows  # a shard's table (distributed/)
        self._index_rebuild()
        self._version = v
        self._max_version = versions[-1]
        self._pins = disk.read_pins()
        seq, gen = disk.max_seq_and_gen()
        self._own_gens_from = gen + 1  # chunk files of these generations are this handle's own
        # Segment numbers only grow: the chunk map names segments folded (and deleted) long ago,
        # and a new segment numbered like one of them would count as folded before it is.
        self._next_seq = max(seq, int(self._folded.max(initial=0)), max(m.segments, default=0)) + 1
        self._next_gen = gen + 1
        if not self._readonly:
            # Leftovers of a crash (unreferenced segments, temp files) are removed by the writer.
            self._collect_garbage(at_open=True)
            # and records base chunks already hold give their blocks back (a crash, or a close
            # before the last punch, may have left them whole)
            self._dead = DeadRecords(disk)
            self._kill_dead(disk.pool.seal())
            self._refresh_sharing()

    # ------------------------------------------------------------------ compaction and GC
    def _segment_bytes(self, held: bool = False) -> int:
        """Bytes of the committed segments' files; ``held``: on disk, without the dead records
        punched out of them (holes.py)."""
        return sum(s.live_bytes if held else s.nbytes for s in self._committed)

    def _foldable(self) -> list[Segment]:
        """The committed segments compaction rounds fold now: not those newer than a kept version
        that shares the chunk files (they hold the rows changed since it, sharing.py). The
        thresholds count these only, so a pass never starts for segments it may not fold."""
        share = self._sharing
        return [s for s in self._committed if share.foldable(s)]

    def _needs_compaction(self, ratio: float | None = None, segments: int = COMPACT_SEGMENTS,
                          floor: int = 0, held: bool = True, adding: int = 0) -> bool:
        """Segments rounds may fold (`_foldable`) past ``ratio`` of the table's bytes, or more
        than ``segments`` of them, with ``adding`` bytes more (a flush's own segment). ``held``:
        the bytes on disk, dead records given back (holes.py), which drop as the rounds fold
        chunk after chunk, not once a whole sweep is round; else the files' sizes."""
        ratio = COMPACT_RATIO if ratio is None else ratio  # read now: tests and benchmarks set it
        table = self._num_rows * self._row_bytes
        foldable = self._foldable()
        nbytes = sum(s.live_bytes if held else s.nbytes for s in foldable)
        return len(foldable) > segments or nbytes + adding > max(ratio * table, floor)

    def _maybe_compact(self) -> None:
        """Compact in the background once segments pass the thresholds (after a flush, and at a
        writable open: many short open/flush/close runs would otherwise never get there). The
        compaction process starts here once segments hold half the share a pass starts at: ready
        before its first round (starting it costs a fraction of a second of CPU), never started by a store only
        read or by short runs that flush a little."""
        if self._grown_unflushed:
            return  # the next flush publishes the grown table first (see `_fold_round`)
        if self._fold_proc is None and not self._closed:
            if self._needs_compaction(COMPACT_RATIO / 2, COMPACT_SEGMENTS // 2):
                self._fold_process()
        if self._needs_compaction():
            self._submit_bg(self._compact)

    def _submit_bg(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the background I/O thread; a job of the same kind already queued absorbs it."""
        with self._lock:
            if self._closed:
                return
            if self._bg is None:
                self._bg = ThreadPoolExecutor(1, thread_name_prefix="embcache-bg")
            if self._damage is not None:
                return  # fail-stop: a store that met a damaged file writes nothing more in its folder
            key = fn.__name__
            fut = self._bg_futures.get(key)
            if fut is not None and not fut.done():
                return
            self._bg_futures[key] = self._bg.submit(_run_bg_weakly, weakref.ref(self), key)

    def _run_bg(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # surfaced on the next flush()
            self._bg_error = exc
            if isinstance(exc, CorruptStoreError):
                self._saw_damage(exc)

    def _saw_damage(self, exc: CorruptStoreError) -> None:
        """Fail-stop: from the first damaged file met, no background work writes in this folder
        (compaction, write-back, garbage collection); `stats().damaged` says so. The handle still
        serves what it can read, and flushes (which only append) still run if asked."""
        if self._damage is None:
            self._damage = exc
            if self._fold_proc is not None and self._pid == os.getpid():
                self._fold_proc.close()
                self._fold_proc = None

    def _raise_bg_error(self) -> None:
        exc, self._bg_error = self._bg_error, None
        if exc is not None:
            raise StoreError(
                f"background store work (write-back, compaction or garbage collection) failed: {exc}"
            ) from exc

    def compact(self) -> None:
        """Fold every committed delta segment into base chunks now (normally automatic, in the
        background, a bounded round at a time). Each round is published at once (the version's
        manifest names the new layout of the same rows), so reopening and disk use follow.
        Segments newer than a pinned version that shares the chunk files stay: they hold the
        rows changed since it (docs/store-format.md, "Versions, pins and space")."""
        try:
            self._compact_now()
        except CorruptStoreError as exc:
            self._saw_damage(exc)
            raise

    def _compact_now(self) -> None:
        self._check_usable(write=True)
        self._require_disk("compact")
        self._wait_bg()
        with self._flush_lock:
            self._await_round()
            while self._committed and self._compact_round(everything=True):
                pass
            self._disk.pool.drain()

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
        state = self._compact_step(None)
        while state is not None and not self._closed and self._damage is None:
            state = self._compact_step(state)

    def _compact_step(self, state: tuple[int, int] | None) -> tuple[int, int] | None:
        """One round of a background compaction pass; returns the pass's state for the next round
        (the newest segment when the sweep began, the superseded count then), or None when the
        pass is over. ``state=None`` begins a pass. The background runner calls it one round at a
        time through a weak reference, so a store dropped without close() is released between two
        rounds (`_run_bg_weakly`)."""
        if state is None:
            self._await_fold_process()
            state = (-1, self._stats.superseded_segments)
        target, superseded = state
        with self._lock:  # a flush asked for the writer lock: it goes first
            while self._flush_waiting and not self._closed:
                self._no_flush_waiting.wait(0.1)  # notified when none waits; the timeout sees close()
        if self._closed or self._damage is not None:
            return None
        if self._clean_due:
            self._clean()
        with self._flush_lock:
            if self._collect_due:
                self._collect_due = False
                self._collect_garbage_locked(self._disk, at_open=False)
            if not self._committed or self._committed[0].seq > target:
                # Round once: sweep again while segments are over the threshold, or over half
                # of it while flushes add rows that stay (none of their segments left out).
                hot_set = self._stats.superseded_segments != superseded
                if not (
                    self._needs_compaction()
                    or (not hot_set and self._needs_compaction(COMPACT_RATIO / 2, COMPACT_SEGMENTS // 2))
                ):
                    # The pass is over: the files kept for the next round's reuse go, and
                    # disk use drops to what the versions hold.
                    self._disk.pool.drain()
                    return None
                foldable = self._foldable()
                if not foldable:
                    self._disk.pool.drain()
                    return None
                target, superseded = foldable[-1].seq, self._stats.superseded_segments
            if not self._compact_round(unlocked=True):
                self._disk.pool.drain()
                return None
        return target, superseded

    def _await_fold_process(self) -> None:
        """Let a compaction process that is starting come up before a background pass (at most
        foldproc.START_WAIT_S): the pass is in the background, and its rounds folded here would
        hold the GIL beside the training thread."""
        deadline = time.monotonic() + foldproc.START_WAIT_S
        while self._fold_proc is not None and not self._closed and time.monotonic() < deadline:
            if self._fold_process() is not None or self._fold_proc is None:
                return
            time.sleep(0.01)

    def _round_chunks(self, segs: list[Segment], everything: bool) -> np.ndarray:
        """The chunks one round rewrites: those the oldest segments still need folded (so that a
        prefix of segments can be dropped), in chunk order, at most ROUND_BYTES of them. In chunk
        order, the records a round kills lie next to those the rounds before it killed, so each
        segment gets one hole a round (holes.py: a punch has a fixed cost however small, and a
        round of scattered chunks would make many a segment)."""
        chunk_bytes = self._chunk_rows * self._row_bytes
        table = self._num_rows * self._row_bytes
        limit = max(1, min(ROUND_BYTES, int(table * ROUND_SHARE)) // chunk_bytes)
        if everything:
            limit = max(limit, ROUND_BYTES // chunk_bytes)
        folded = self._folded
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
        alone = disk.lock_version_alone(self._version)
        if alone is None:
            return none
        locks = [alone]
        try:
            listed = disk.list_versions()
            others = [v for v in listed if v != self._version]
            for v in share.members:
                if v in others and (lk := disk.lock_version_alone(v)) is not None:
                    locks.append(lk)
                    others.remove(v)
            for v in others:  # a file another version reads stays as it is: copy on write
                m = self._manifest_of(v)
                if m is None:
                    return none
                if m.chunkmap:
                    theirs = self._chunkmap_of(m)
                    k = cand[cand < len(theirs)]
                    cand = np.setdiff1d(cand, k[theirs[k] == cmap[k]])
            cand = np.asarray([c for c in cand.tolist() if inplace.is_raw(disk, c, int(cmap[c]))], np.int64)
            if not len(cand):
                return none
            disk.compaction_bytes_written += inplace.write_intent(
                disk, gen, [(c, int(cmap[c]), int(folded0[c])) for c in cand.tolist()], [s.seq for s in segs])
            done: list[int] = []
            names: list[str] = []
            unsynced: list[str] = []
            c = -1
            since = time.monotonic()
            try:
                for c in cand.tolist():
                    if yielding and self._flushes_to_let_in() and time.monotonic() - since >= YIELD_AFTER_S:
                        if unsynced:  # the flush's manifest names these files: durable first
                            fileio.fsync_files(disk._chunks_fd, unsynced, disk.root / "chunks")
                            unsynced.clear()
                        if not self._let_flush_in(locks, listed):
                            break
                        since = time.monotonic()
                    g = int(cmap[c])
                    rows, recs = inplace.newest_records(c, disk, segs, int(folded0[c]))  # (segment reads: outside)
                    with disk.pool.folding():
                        n = inplace.fold_chunk(disk, c, g, rows, recs, verify=g < self._own_gens_from,
                                               newest=segs[-1].seq)
                        disk.bytes_written += n
                        disk.compaction_bytes_written += n
                        self._forget_chunk_file(c, g)
                    done.append(c)
                    names.append(disk.chunk_path(c, g).name)
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
                # A write failed half-way: that file's blocks may fail their checksums until the
                # fold is redone. Redone now where the disk lets it, else at the next writable open.
                try:
                    with disk.pool.folding():
                        inplace.redo(disk, only=set(done) | {c})
                        for d in [*done, c]:
                            self._forget_chunk_file(d, int(cmap[d]))
                except BaseException:
                    pass
                raise
            inplace.drop_intent(disk)
            return np.asarray(done, np.int64)
        finally:
            for lk in locks:
                disk.unlock_reader(lk)

    def _let_flush_in(self, locks: list[int], listed: list[int]) -> bool:
        """Let go of the writer lock until the flushes waiting for it got it and are done, then
        hold the reader locks of the versions they published (added to ``locks``; ``listed``:
        the versions on disk before, updated). False where a read-only handle holds one of them,
        or the store closes: the caller stops folding in place."""
        self._flush_lock.release()
        try:
            with self._lock:
                while self._flushes_to_let_in() and not self._closed:
                    self._no_flush_waiting.wait(0.01)
        finally:
            self._flush_lock.acquire()
        if self._closed:
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

    def _chunkmap_of(self, m: Manifest) -> np.ndarray:
        """Another version's chunk map (files never change: read once per generation)."""
        seen = self.__dict__.setdefault("_chunkmaps_seen", {})
        cm = seen.get(m.chunkmap)
        if cm is None:
            if len(seen) >= 16:
                seen.clear()
            cm = seen[m.chunkmap] = self._disk.read_chunkmap(m.chunkmap, m.num_rows or int(self._meta["num_rows"]))
        return cm

    def _forget_chunk_file(self, c: int, g: int) -> None:
        """Chunk file (c, g) changed in place: this handle's cached descriptors and block
        checksums of it go (the next read reads its new directory)."""
        self._disk._directories.pop((c, g), None)
        reader = self._chunkrows
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
        reuse = []
        while len(reuse) < len(chunks) and (name := disk.pool.take()) is not None:
            reuse.append(name)
        ok, res = proc.fold(
            chunks.tolist(),
            cmap[chunks].tolist(),
            folded[chunks].tolist(),
            [s.seq for s in segs],
            gen,
            self._compress,
            self._own_gens_from,
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
                with self._lock:
                    self._stats.compaction_process_chunks += len(res["done"])
                if not res["skipped"]:
                    return chunks
                own = res["skipped"]
                done = np.asarray(res["done"], np.int64)
            else:
                with self._lock:
                    self._stats.compaction_process_failures += 1
        if not own:
            own = chunks.tolist()
        handover = threading.get_ident() != self._row_thread  # a training thread may want the GIL
        written = []
        for c in own:
            if self._closed:  # close() waits for the writer lock: publish what is done, stop
                break
            recs, present = fold_chunk(
                disk,
                c,
                int(cmap[c]),
                segs,
                verify=int(cmap[c]) < self._own_gens_from,
                init_rows=self._init_rows,
                folded=int(folded[c]),
            )
            disk.write_chunk(c, gen, recs, self._compress, durable=False, present=present, folded=segs[-1].seq)
            if handover:
                time.sleep(0)  # hand the GIL to a waiting training thread once per chunk (see `_fold_round`)
            written.append(c)
        disk.sync_chunks(written, gen)  # durable before the manifest names them
        return np.sort(np.concatenate([done, np.asarray(written, np.int64)]))

    def _fold_process(self) -> FoldProcess | None:
        """The store's compaction process, started here on the first call (`_maybe_compact`
        makes it) for a writable disk store the process is wanted for (`foldproc.wanted`); None
        while it starts, after it failed twice, or where it is not wanted."""
        proc = self._fold_proc
        if proc is None:
            if (
                self._disk is None
                or self._fold_proc_failed
                or self._readonly
                or not foldproc.wanted(self._num_rows * self._row_bytes)
            ):
                return None
            try:
                proc = self._fold_proc = FoldProcess(
                    self._root,
                    self._num_rows,
                    self._chunk_rows,
                    self._row_bytes,
                    self._disk.uid,
                    unbound=self._disk.unbound,
                )
            except Exception:  # no interpreter to start (an embedded Python), no processes allowed
                self._fold_proc_failed = True
                return None
        if proc.usable():
            return proc
        if proc.broken:  # it died or failed: one more start, then this thread for good
            proc.close()
            self._fold_proc = None
            self._fold_proc_failed = self._fold_proc_restarts >= 1
            self._fold_proc_restarts += 1
        return None

    def _await_round(self) -> None:
        """Wait until no background round is folding without the writer lock (caller holds the
        writer lock exactly once, and lets go of it meanwhile: the round publishes under it)."""
        me = threading.get_ident()
        if self._round_thread in (None, me):
            return
        # Counted as a flush waiting, so that the background pass starts no new round until this
        # caller got in: each round would otherwise start while this thread waits to be scheduled.
        with self._lock:
            self._flush_waiting += 1
            self._awaiting_round += 1  # (a round folding in place does not let it in: `_flushes_to_let_in`)
        try:
            while self._round_thread not in (None, me):
                self._flush_lock.release()
                try:
                    self._round_done.wait(0.05)
                finally:
                    self._flush_lock.acquire()
        finally:
            with self._lock:
                self._awaiting_round -= 1
            self._flush_done_waiting()

    def _flushes_to_let_in(self) -> bool:
        """Whether a flush waits for the writer lock that does not wait for the round itself."""
        return self._flush_waiting > self._awaiting_round

    def _flush_done_waiting(self) -> None:
        with self._lock:
            self._flush_waiting -= 1
            if not self._flush_waiting:
                self._no_flush_waiting.notify_all()

    def _compact_round(self, everything: bool = False, unlocked: bool = False) -> bool:
        """One round of compaction (`_fold_round`), its time counted in ``stats().compaction_seconds``."""
        t0 = time.perf_counter()
        try:
            return self._fold_round(everything, unlocked)
        finally:
            self._stats.compaction_seconds += time.perf_counter() - t0

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
        overlap (`_await_round`). So the round publishes over the layout as it finds it then.

        Only the segments every pinned version sharing the chunk files lists too are folded
        (``self._sharing``, sharing.py), and each of those versions is published again with the
        new chunk map after the writer's (`_repoint`).

        Each chunk map records, per chunk, the newest segment folded into its base file; a segment
        goes once every chunk it touches has folded it. Only a prefix of segments is ever dropped,
        so every segment kept is newer than every one dropped: re-applying a kept segment to a
        chunk that already holds it (a store written before chunk maps recorded this) gives the
        same rows.
        """
        disk = self._disk
        assert disk is not None
        with self._lock:
            share = self._sharing
            segs = [s for s in self._committed if share.foldable(s)]
            # A grown table's layout is published by its next flush, never by a round: a round
            # rewrites the manifest of the version it folds, which has the size before the growth.
            if self._closed or not segs or self._grown_unflushed:
                return False
            cmap = self._cmap.copy()
            folded0 = self._folded  # replaced, never changed in place: only rounds move it
            old_gen = self._cmap_gen
            chunks = self._round_chunks(segs, everything)
            gen = self._next_gen
            self._next_gen += 1
            self._writing_gens.add(gen)
        proc = self._fold_process()
        release = unlocked and proc is not None
        if unlocked:  # the writer lock may be let go of meanwhile: the process folds, or a flush goes first
            self._round_thread = threading.get_ident()
            self._round_done.clear()
        try:
            newest = segs[-1].seq
            folded_bytes = self._row_bytes * sum(
                inplace.distinct_rows(c, segs, int(folded0[c])) for c in chunks.tolist())
            # Chunk files only this version reads are folded in place first, under the writer
            # lock (no flush publishes a version that reads them meanwhile); the others are
            # written as new files of ``gen``, by the compaction process where there is one.
            written0 = disk.compaction_bytes_written
            in_place = self._fold_in_place(chunks, cmap, folded0, segs, share, gen, yielding=unlocked)
            chunks = np.setdiff1d(chunks, in_place)
            planned = len(chunks)
            if release:
                self._flush_lock.release()
            try:
                res = self._fold_elsewhere(proc, chunks, cmap, folded0, segs, gen)
            finally:
                if release:
                    self._flush_lock.acquire()
            chunks = self._fold_chunks(chunks, cmap, folded0, segs, gen, res)
            if self._closed and not len(chunks) and planned and not len(in_place):
                return False
            new_files = chunks
            chunks = np.union1d(chunks, in_place)
            folding = segs
            with self._lock:  # a flush may have added (or left out) segments meanwhile
                segs = list(self._committed)
            new_cmap = cmap.copy()  # rounds never overlap: the chunk map is the snapshot's
            new_cmap[new_files] = gen  # (a file folded in place keeps its name)
            folded = self._folded.copy()
            folded[chunks] = newest
            drop = 0
            for s in segs:
                if not (folded[s.idx_chunk] >= s.seq).all():
                    break
                drop += 1
            remaining = segs[drop:]
            if self._damage is not None:
                return False  # fail-stop: a damaged file was met meanwhile, nothing more is written
            disk.write_chunkmap(gen, new_cmap, folded)
            version = self._version
            m = self._publish_layout(gen, remaining)
        finally:
            with self._lock:
                self._writing_gens.discard(gen)
            if unlocked:
                self._round_thread = None
                self._round_done.set()
        if m.version >= self._max_version:
            try:
                disk.write_latest(m.version)  # LATEST links to the newest manifest's file
            except StoreError:
                pass  # the record only lags (open's check stays sound)
        with self._lock:  # the caller holds the writer lock: the committed segments are those read above
            assert [s.seq for s in self._committed] == [s.seq for s in segs], "layout moved during compaction"
            self._cmap, self._cmap_gen, self._committed, self._folded = new_cmap, gen, remaining, folded
            self._published = (gen, [s.seq for s in remaining], self._num_rows)
            if m.version != version:
                self._parent = version
                self._version = self._max_version = m.version
            if drop:
                # Segments left the layout: renumber the index. A round that dropped none leaves
                # it as it is (it indexes segments only; rebuilding it over every delta record,
                # under the store lock, would make a training thread's get wait every round),
                # dropping the entries of the chunks it folded only once they are many.
                self._index_rebuild()
            elif self._rows is not None:
                self._rows.note_folded(chunks, self._chunk_rows, folded)
            self._below_token += 1  # same rows, but the folded segments are no longer read
            self._stats.compactions += 1
            self._stats.chunks_folded_in_place += len(in_place)
            self._stats.compaction_folded_bytes += folded_bytes
            # Reads planned from here on read the records this round folded from the new base
            # files; those planned before, without the lock, register before this epoch.
            ready = disk.pool.seal()
        # The kept versions that share the chunk files read the new ones too (sharing.py).
        self._repoint(share.members, old_gen, gen, folding, folded)
        with self._lock:
            self._stats.compaction_bytes_written += disk.compaction_bytes_written - written0
        if self._closed or self._damage is not None:
            return False  # the next open collects what this round replaced
        listed = disk.list_versions()  # (for both: nothing adds or drops a version meanwhile)
        self._refresh_sharing(listed)
        self._kill_dead(ready, listed)
        # The replaced chunk files and dropped segments are garbage once no kept version uses
        # them: collected now, round by round, so disk use stays near the table plus one round.
        # The dropped segments' descriptors close when the last reader (a prefetch's plan) lets go.
        disk.pool.limit = len(new_files)  # the next round of the pass rewrites about as many files
        replaced = [(c, g) for c, g in zip(new_files.tolist(), cmap[new_files].tolist()) if g]
        if not (m.version == version and self._collect_replaced(disk, version, replaced, segs[:drop], old_gen, listed)):
            self._apply_retention(collect=False)
            self._collect_garbage_locked(disk, at_open=False, pool=True)
        self._trim_heap()
        return True

    def _publish_layout(self, gen: int, remaining: list[Segment]) -> Manifest:
        """Publish the writer's version as chunk map ``gen`` and segments ``remaining`` (the same
        rows). The version keeps its number: its manifest is rewritten in place (same identity)
        while no reader can open it. Only when a read-only handle holds it does the new layout
        become a new version (the reader keeps its files)."""
        disk = self._disk
        version = self._version
        segs = [s.seq for s in remaining]
        alone = disk.lock_version_alone(version)
        try:
            if alone is not None:
                m = Manifest(version, gen, segs, self._parent, disk.manifest_checksum(version), self._num_rows,
                             self._table_published)
            else:
                m = Manifest(self._max_version + 1, gen, segs, version, num_rows=self._num_rows,
                             table_rows=self._table_published)
            # the commit point: old layout or new, the same rows
            disk.compaction_bytes_written += disk.write_manifest(m)
        finally:
            disk.unlock_reader(alone)
        return m

    def _kill_dead(self, ready: int, listed: list[int] | None = None) -> None:
        """Queue the delta records the chunk map now says base chunks hold, to be punched once no
        read begun before epoch ``ready`` runs, and punch those due (holes.py). ``listed``: the
        versions on disk, if the caller has just listed them. Caller holds the writer lock (or
        opens the store)."""
        dead = self._dead
        if dead is None or not dead.works:
            return
        with self._lock:
            segs, folded, gen, version = list(self._committed), self._folded, self._cmap_gen, self._version
        dead.mark(segs, folded, ready, self._protected_segments(version, gen, listed))
        if self._segment_bytes(held=True) > PUNCH_FROM * self._num_rows * self._row_bytes:
            dead.run()

    def _protected_segments(self, version: int, gen: int, listed: list[int] | None = None) -> set[int]:
        """Segments listed by a version on disk other than ``version`` whose chunk map is not
        ``gen`` (pinned, or held by a read-only handle): their records stay whole, since that
        version's chunk map may not count them as folded."""
        disk = self._disk
        out: set[int] = set()
        cache = self._manifests_seen
        if listed is None:
            listed = disk.list_versions()
        for v in [v for v in cache if v not in listed]:
            del cache[v]  # reclaimed: never listed again (numbers only grow)
        for v in listed:
            if v == version:
                continue
            m = self._manifest_of(v)
            if m is not None and m.chunkmap != gen:
                out.update(m.segments)
        return out

    def _manifest_of(self, version: int) -> Manifest | None:
        """Another version's manifest, read once (None: dropped since it was listed)."""
        m = self._manifests_seen.get(version)
        if m is None:
            try:
                m = self._manifests_seen[version] = self._disk.read_manifest(version)
            except (StoreError, OSError):
                return None
        return m

    def _refresh_sharing(self, listed: list[int] | None = None) -> None:
        """Find the pinned versions that share the writer's chunk files and how far rounds may
        fold without copying the chunks they read (sharing.py). A version a read-only handle
        holds keeps its files: it is left out. Caller holds the writer lock (or opens the store)."""
        disk = self._disk
        if disk is None or self._readonly:
            return
        if listed is None:
            listed = disk.list_versions()
        with self._lock:
            segs, gen, version, pins = list(self._committed), self._cmap_gen, self._version, set(self._pins)
        seqs = {s.seq for s in segs}
        members = []
        for v in listed:
            m = self._manifest_of(v) if v in pins and v != version else None
            # a version of another size (before a growth) never shares: its chunk map has its size
            same_size = m is not None and (m.num_rows or int(self._meta["num_rows"])) == self._num_rows
            if same_size and sharing.shares(m, gen, seqs) and self._unread(v):
                members.append(m)
        self._sharing = sharing.plan(segs, members, self._num_rows * self._row_bytes)

    def _unread(self, version: int) -> bool:
        """No read-only handle holds ``version`` now (one that opens it later finds it published
        again, or waits for that: `_repoint` holds its lock exclusively)."""
        alone = self._disk.lock_version_alone(version)
        self._disk.unlock_reader(alone)
        return alone is not None

    def _repoint(
        self, members: tuple[int, ...], old_gen: int, gen: int, folding: list[Segment], folded: np.ndarray
    ) -> None:
        """Publish each kept version of ``members`` again with chunk map ``gen``, whose new base
        files hold the segments ``folding`` that it lists too (same rows, number and identity),
        without the leading segments every chunk of which is folded now. One a read-only handle
        opened, that was unpinned or moved meanwhile keeps its layout (and its files)."""
        disk = self._disk
        folded_seqs = {s.seq for s in folding}
        newest = max(folded_seqs)
        by_seq = {s.seq: s for s in folding}
        for v in members:
            if v not in self._pins:
                continue  # unpinned while the round folded: retention may have dropped it
            alone = disk.lock_version_alone(v)
            if alone is None:
                continue
            try:
                try:
                    m = disk.read_manifest(v)
                except VersionNotFoundError:
                    continue
                if m.chunkmap != old_gen or {q for q in m.segments if q <= newest} != folded_seqs:
                    continue
                lead = 0
                for q in m.segments:
                    seg = by_seq.get(q)
                    if seg is None or not (folded[seg.idx_chunk] >= q).all():
                        break
                    lead += 1
                new = Manifest(v, gen, m.segments[lead:], m.parent, m.ident or disk.manifest_checksum(v), m.num_rows,
                               m.table_rows)
                # the commit point of this version's new layout
                disk.compaction_bytes_written += disk.write_manifest(new)
                self._manifests_seen[v] = new
            finally:
                disk.unlock_reader(alone)

    def _collect_replaced(
        self,
        disk: Disk,
        version: int,
        replaced: list[tuple[int, int]],
        dropped: list[Segment],
        old_gen: int,
        listed: list[int],
    ) -> bool:
        """Delete (or pool for reuse) just the files a round replaced: its chunks' previous files,
        the segments it dropped and the previous chunk map, without listing the folders or reading
        any manifest (listing them is a large share of a round's time in a disk-mode epoch). Only where
        ``version`` is the only one on disk and nothing is pinned: then no other version can use
        them. False otherwise: the caller collects the usual way."""
        with self._lock:
            if self._pins or self._closed or old_gen in self._writing_gens or old_gen == self._cmap_gen:
                return False
        if listed != [version]:
            return False
        pooled = [(c, g) for c, g in replaced if disk.retire_chunk(c, g, pool=True)]
        for seg in dropped:
            disk.delete_file(seg.path)
        if old_gen:
            disk.delete_file(disk.chunkmap_path(old_gen))
        if pooled:
            reader = self._chunkrows
            if reader is not None:
                reader.forget(pooled)  # a stale plan's read finds them gone, as if deleted
            disk.pool.seal()
        return True

    def _collect_garbage(self, at_open: bool = False) -> None:
        disk = self._disk
        if disk is None or self._readonly:
            return
        with self._flush_lock:  # nothing is being published or compacted while it looks
            if not (at_open or self._collect_due):
                return  # a compaction pass collected it between its rounds (`_compact`)
            self._collect_due = False
            self._collect_garbage_locked(disk, at_open)

    def _collect_garbage_locked(self, disk: Disk, at_open: bool, pool: bool = False) -> None:
        """``pool``: replaced chunk files go into ``disk.pool`` (the next round overwrites them)
        instead of being deleted, where it has room."""
        with self._lock:
            if self._closed and not at_open or self._damage is not None:
                return  # fail-stop: a store that met a damaged file deletes nothing in its folder
            live_segs = {s.seq for s in self._committed + self._pending} | self._writing_seqs
            gens = {self._cmap_gen} | self._writing_gens
            # The chunk files the live layout reads: after two compactions with no flush between,
            # it still uses chunks of the first one's generation, which no manifest lists yet.
            used = np.flatnonzero(self._cmap)
            live_files = set(zip(used.tolist(), self._cmap[used].tolist()))
            # Anything numbered from here on is written after this snapshot: never garbage.
            new_seq, new_gen = self._next_seq, self._next_gen
        pooled = disk.collect_garbage(
            disk.list_versions(),
            live_segs,
            gens,
            new_seq,
            new_gen,
            remove_temp=at_open,
            keep_files=live_files,
            pool=pool,
        )
        if pooled:
            reader = self._chunkrows
            if reader is not None:
                reader.forget(pooled)  # a stale plan's read finds them gone, as if deleted
            disk.pool.seal()

    def _trim_heap(self) -> None:
        """Return freed heap pages to the OS after big background work, in disk mode only.

        There the RSS budget is the point, and background threads' malloc arenas would otherwise
        keep their slack. In memory mode the table is the budget; a trim there only makes the
        training thread fault its next allocations back in (page faults in the get path after every
        flush, until the heap refilled).
        """
        if not self._hot.resident:
            trim_heap()

    def _wait_bg(self) -> None:
        for fut in list(self._bg_futures.values()):
            fut.result()
