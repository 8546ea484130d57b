"""Durability of EmbeddingStore: flush, versions and pins, background compaction and GC.

`Versions` is the component of `EmbeddingStore` that owns what is on disk: the writer lock (and
the LOCK file), the `Disk`, and the live layout (committed and pending segments, chunk map, the
row index over the segments, segment and generation numbers). The hot and warm tiers (`Tiers`,
tiers.py) read through it (`layout_of`, `find_below`, `rows`, `cmap`) and add the segments their
write-back writes (`take_seq`, `add_pending`); it drives their write-back through a few named
methods (`WriteBack`). See docs/store-format.md for the protocol.

Concurrency design (docs/store.md, "Threads"): two locks, always taken in this order.

* ``self.flush_lock``, the *writer lock* (re-entrant): held for the whole of every job that
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

import fcntl
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from . import fileio, foldproc, inplace, sharing
from .chunkrows import ChunkRows
from .core import StoreCore, stop_executor
from .disk import Disk, Manifest, Segment
from .errors import CorruptStoreError, StoreError, StoreLockedError, VersionNotFoundError
from .fold import fold_chunk
from .foldproc import FoldProcess
from .holes import DeadRecords, dead_rows
from .memory import trim_heap
from .rowindex import RowIndex, trust
from .sharing import Sharing
from .validate import version_arg

if TYPE_CHECKING:
    from .growth import Kept

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
# On by default; ``EMBCACHE_FOLD_IN_PLACE=0`` in the environment turns it off (every round then
# writes new files).
FOLD_IN_PLACE = os.environ.get("EMBCACHE_FOLD_IN_PLACE", "1") != "0"
# A round folding in place lets a waiting flush in once it has folded for this long since it
# began or last did: each time costs an fsync of the files folded since and a pass of the lock
# back and forth, which a flush waiting at every chunk (flushes back to back) would pay per chunk.
YIELD_AFTER_S = 0.05
# Waits for flushes to get in are notified (`_flush_done_waiting`, `wake`); this bounds one only
# as a safety net, should a store be dropped without its close running.
WAKE_S = 1.0
KEEP_VERSIONS = 1  # unpinned versions kept: the latest only (pins and read-only handles keep theirs)


def _run_bg_weakly(ref: weakref.ReferenceType[Versions], name: str) -> None:
    """A background job of the store whose `Versions` ``ref`` names. The compaction pass goes a
    round at a time, holding the store's parts only during a round: a store dropped without close()
    is closed by its finalizer between two rounds, instead of living on as long as its background work."""
    versions = ref()
    if versions is None or versions._c.closed or versions.damage is not None:
        return
    if name != "_compact":
        versions._run_bg(versions._job(name))
        return
    try:
        state = versions._compact_step(None)
        while state is not None:
            del versions
            versions = ref()
            if versions is None or versions._c.closed or versions.damage is not None:
                return
            state = versions._compact_step(state)
    except BaseException as exc:  # surfaced on the next flush()
        if versions is not None:
            versions._bg_error = exc
            if isinstance(exc, CorruptStoreError):
                versions.saw_damage(exc)


class WriteBack(Protocol):
    """What `Versions` asks of the hot tier (`Tiers`): write dirty rows out and patch warm copies."""

    def dirty_count(self) -> int: ...

    def forget_dirty(self) -> bool: ...

    def resident(self) -> bool: ...

    def begin_write_back(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, Callable, int]: ...

    def end_write_back(self, slots: np.ndarray, seq: int, *, ok: bool) -> None: ...

    def dirty_slots(self) -> np.ndarray: ...

    def patch_warm(self, ids: np.ndarray) -> None: ...

    def clean(self) -> None: ...


@dataclass(frozen=True)
class _Round:
    """A compaction round's snapshot (`Versions._plan_round`): the segments it folds, the chunk
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
    """What a round wrote (`Versions._fold_planned`): new chunk files, chunks folded in place,
    both, the bytes of rows folded and the compaction byte count before."""

    new_files: np.ndarray
    in_place: np.ndarray
    chunks: np.ndarray
    folded_bytes: int
    written0: int


@dataclass(frozen=True)
class _Published:
    """A round's published layout (`Versions._publish_round`): its manifest, the version before,
    the new chunk map and folded marks, the committed segments then and how many it dropped."""

    manifest: Manifest
    version: int
    cmap: np.ndarray
    folded: np.ndarray
    segs: list[Segment]
    drop: int


class Versions:
    """Flush, versions, pins, compaction, garbage collection: the store's files and their layout.

    Holds the writer lock (``flush_lock``, always taken before ``core.lock``) and the LOCK file
    of a writable handle. Never holds the `EmbeddingStore` itself: only the shared `StoreCore`
    and, once the tiers exist, the `WriteBack` they offer (`attach`)."""

    def __init__(self, core: StoreCore, kept: Kept | None = None) -> None:
        self._c = core
        self.flush_lock = threading.RLock()  # the writer lock: see the module docstring
        self._lock_fd: int | None = None  # the LOCK file's descriptor (flock held: one writer per path)
        self._reader_fd: int | None = None  # read-only handles: shared flock on their version
        self._t: WriteBack  # the tiers (`attach`)
        self.disk: Disk | None = None
        self.committed: list[Segment] = []
        self.pending: list[Segment] = []  # written since the last flush (write-back), not yet published
        self.pending_bytes = 0  # bytes of the segments in ``pending``
        self._pins: set[int] = set()
        self.version = 0
        self._max_version = 0
        self._parent = 0
        self.cmap = np.zeros(0, np.int32)  # per chunk: generation of its base file (0: never written)
        self._cmap_gen = 0
        self.folded = np.zeros(0, np.int64)  # per chunk: newest segment folded into its base file
        self.rows: RowIndex | None = None  # newest delta record of each id (built at open)
        self.chunkrows: ChunkRows | None = None  # batched reads of base chunk files (made on first miss)
        self.next_seq = 1
        self._next_gen = 1
        self._own_gens_from = 1  # chunk files of these generations are this handle's own
        self._published: tuple = (0, [], 0)
        self.below_token = 0  # moves whenever rows below the hot tier change (see `Tiers._prefetch`)
        self._bg: ThreadPoolExecutor | None = None
        self._bg_futures: dict[str, Future] = {}
        self._bg_error: BaseException | None = None
        self.fold_proc: FoldProcess | None = None  # the compaction process (foldproc.py), started by `_maybe_compact`
        self._fold_proc_failed = False
        self._fold_proc_restarts = 0
        self._round_thread: int | None = None  # a background round folding without the writer lock
        self._round_done = threading.Event()
        self._flush_waiting = 0  # flushes waiting for the writer lock (compaction yields to them)
        self._no_flush_waiting = threading.Condition(core.lock)  # notified when that count drops, and at close
        self._awaiting_round = 0  # of the flushes waiting, those waiting for the background round to end
        self._dead: DeadRecords | None = None  # a writer's punching of dead delta records (holes.py)
        # other versions' manifests (only this writer's compaction rounds change them: `_repoint`)
        self._manifests_seen: dict[int, Manifest] = {}
        self._chunkmaps_seen: dict[int, np.ndarray] = {}  # other versions' chunk maps, by generation
        self._sharing = Sharing()  # kept versions sharing the chunk files, what rounds fold (sharing.py)
        self.clean_due = False  # a background clean was asked for (a running compaction runs it between rounds)
        self._collect_due = False  # a garbage collection was asked for (likewise)
        self.writing_seqs: set[int] = set()  # segments being written: garbage collection skips them
        self._writing_gens: set[int] = set()  # compaction generations being written
        self.damage: CorruptStoreError | None = None  # the first damaged file met: background work stops
        self._grown_unflushed = False  # grown since the last flush: no round until it publishes the size
        # rows of the whole table when this store is a shard of one (`ShardedStore` sets it; the
        # manifests record it); the published version's, to flush a change of it alone
        self.table_rows = self._table_published = 0
        if kept is not None:  # a grown store (growth.py): the same locks, counters and writer lock
            self.flush_lock, self._no_flush_waiting = kept.flush_lock, kept.no_flush_waiting
            self._flush_waiting, self._lock_fd = kept.flush_waiting, kept.lock_fd
            self._fold_proc_failed, self._fold_proc_restarts = kept.fold_proc_failed, kept.fold_proc_restarts
            self.version = kept.version

    @property
    def _disk(self) -> Disk:
        """``disk``, where the caller runs only for a store with files."""
        disk = self.disk
        assert disk is not None, "a store without files has no disk"
        return disk

    def attach(self, tiers: WriteBack) -> None:
        """The tiers above these files, made once the version is open (they need its size). Held
        weakly: the tiers hold this, and without a cycle a dropped store frees its parts (memory,
        descriptors) at once, not at the next garbage collection."""
        self._t = cast(WriteBack, weakref.proxy(tiers))

    def take_lock(self, root: Path) -> None:
        """Hold the LOCK file of ``root`` (one writer per path), or raise StoreLockedError."""
        root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise fileio.io_error(exc, "opening", root / "LOCK") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(
                f"the store at {str(root)!r} is open for writing elsewhere (one writer per path); "
                f"close it there or open this one with readonly=True"
            ) from None
        self._lock_fd = fd

    def release_lock(self) -> None:
        """Let go of the LOCK file (`close`, a failed open)."""
        if self._lock_fd is not None:
            try:
                if self._c.pid == os.getpid():
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
            except OSError:
                pass
            self._lock_fd = None

    # ------------------------------------------------------------------ flush and versions
    def flush(self) -> int:
        """Make every update so far durable as a new version and return it.

        Thread-safe: may run in a background thread while another thread calls get/update;
        rows updated during the flush go into the next version.
        """
        self.raise_bg_error()
        if self.disk is None:  # ephemeral memory store: nothing to make durable
            with self._c.lock:
                self._c.check_open()
                if self._t.forget_dirty():
                    self.version += 1
                return self.version
        with self._c.lock:
            self._flush_waiting += 1  # a background compaction lets go of the writer lock between rounds
        try:
            self.flush_lock.acquire()
        finally:
            self._flush_done_waiting()
        try:
            # The segments this flush writes or commits count too (disk use peaks right after it),
            # up to half the limit: a flush of most of the table would otherwise have every
            # segment folded first, which costs a table's worth of writes and saves nothing.
            with self._c.lock:
                adding = self._t.dirty_count() * self._c.row_bytes + self.pending_bytes
            adding = min(adding, int(HARD_RATIO * self._c.num_rows * self._c.row_bytes / 2))

            def over() -> bool:
                return self._needs_compaction(HARD_RATIO, 2 * COMPACT_SEGMENTS, HARD_FLOOR, held=True, adding=adding)

            if self._dead is not None and over():
                self._dead.run()  # dead records not given back yet go first (holes.py)
            if over():
                self.await_round()
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
            self.flush_lock.release()
        self._trim_heap()
        self.maybe_compact()
        return version

    def _flush_locked(self) -> int:
        """The body of `flush` (caller holds the writer lock)."""
        t0 = time.perf_counter()
        try:
            return self._flush_writing()
        finally:
            self._c.stats.flush_seconds += time.perf_counter() - t0

    def _flush_writing(self) -> int:
        with self._c.lock:
            self._c.check_open()
            slots = self._t.dirty_slots()
            layout = (self._cmap_gen, [s.seq for s in self.committed], self._c.num_rows)
            if (not len(slots) and not self.pending and layout == self._published
                    and self.table_rows == self._table_published):
                return self.version
            ids, slots, records, seq = self._t.begin_write_back(slots)
            pending = list(self.pending)
            # Segments every record of which has a newer one in this manifest (the same rows
            # updated and flushed again) leave the layout now, before compaction ever has to
            # fold them: a hot set of rows flushed over and over keeps one segment, not a pile
            # that a pass of rounds rewrites the whole table to drop.
            rows = self.rows
            gone = rows.superseded(self.committed + pending, ids) if rows is not None else set()
            # A segment a kept version lists stays (its file stays anyway): that version then
            # keeps sharing the chunk files compaction writes (sharing.py).
            gone = set() if self.version in self._pins else gone - self._sharing.segments
            kept = [g for g in self.committed + pending if g.seq not in gone]
            version = self._max_version + 1
            segs = [g.seq for g in kept]
        try:
            # one no manifest will list need not be durable
            self._disk.sync_segments([p for p in pending if p.seq not in gone])
            new = [self._disk.write_segment(seq, ids, records)] if len(ids) else []
            m = Manifest(version, self._cmap_gen, segs + [s.seq for s in new], parent=self.version,
                         num_rows=self._c.num_rows, table_rows=self.table_rows)
            self._parent = self.version
            self._disk.write_manifest(m)  # the commit point (of a growth too: `EmbeddingStore.grow`)
            self._published = (m.chunkmap, list(m.segments), m.num_rows)
            self._table_published = m.table_rows
            self._grown_unflushed = False
        except BaseException:
            self._t.end_write_back(slots, seq, ok=False)
            raise
        try:
            self._disk.write_latest(version)
        except StoreError:
            pass  # the version is published; the record only lags (open's check stays sound)
        with self._c.lock:
            self._t.end_write_back(slots, seq, ok=True)
            self.committed = kept + new
            self.pending = [p for p in self.pending if p not in pending]
            self.pending_bytes = sum(p.nbytes for p in self.pending)
            for seg in new:
                self.index_add(seg)
            if gone:
                # renumbered without them: the old index (and the descriptors of the segments
                # that left) goes when the last plan that holds it lets go
                self.index_rebuild()
                self._c.stats.superseded_segments += len(gone)
            self.version = self._max_version = version
            self._t.patch_warm(ids)  # the flushed rows are hot: their chunks' warm copies take them
            self._c.stats.flushes += 1
            self._c.stats.flushed_rows += len(ids)
        self._apply_retention()
        self._refresh_sharing()
        return version

    def versions(self) -> list[int]:
        """Versions still on disk (openable with ``open(path, version=v)``)."""
        if self.disk is None:
            return [self.version]
        return self._disk.list_versions()

    def pin(self, version: int) -> None:
        """Never reclaim ``version`` (until unpinned); persisted across opens."""
        version = version_arg(version, "version")
        disk = self._require_disk("pin")
        with self.flush_lock:
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
        version = version_arg(version, "version")
        disk = self._require_disk("unpin")
        with self.flush_lock:
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
        if self.disk is None:
            raise StoreError(f"{what}() needs a store on disk; this one was created with path=None")
        return self.disk

    def _apply_retention(self, collect: bool = True) -> None:
        """Drop versions that are not among the newest KEEP_VERSIONS, not pinned and not being read
        by a read-only handle (in any process), then collect their garbage in the background
        (``collect=False``: the caller collects). Caller holds the flush lock."""
        assert self.disk is not None
        if self._c.readonly:
            return
        versions = self._disk.list_versions()
        keep = set(versions[-KEEP_VERSIONS:]) | self._pins | {self.version}
        dropped = False
        for v in versions:
            if v not in keep and self._disk.drop_version_unless_read(v):
                dropped = True
        if dropped and collect:
            self._collect_due = True
            self.submit_bg("_collect_garbage")

    def _load_version(self, version: int | None) -> None:
        disk = self.disk
        assert disk is not None
        versions = disk.list_versions()
        if not versions:
            raise CorruptStoreError(self._c.root, "holds no manifest (an interrupted create?)")
        latest = disk.read_latest(versions[-1])
        for _ in range(3):
            if versions[-1] >= latest:
                break
            # A writer publishes a manifest before it records it in LATEST: one published after
            # the listing above is in the folder now. Only a manifest still missing is damage.
            versions = disk.list_versions() or versions
            latest = disk.read_latest(versions[-1])
        if versions[-1] < latest and (version is None or not self._c.readonly):
            # Opening the newest manifest left would silently roll back (and a writer would then
            # collect the newer rows' segments as garbage).
            raise CorruptStoreError(
                disk.manifest_path(latest),
                f"missing: version {latest} was published here but the newest manifest left is version "
                f"{versions[-1]}; the store was damaged or rolled back (to recover what an older version "
                f"holds, open it read-only: EmbeddingStore.open(path, version=..., readonly=True))",
            )
        v = versions[-1] if version is None else version
        if self._c.readonly:
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
        self._c.num_rows = m.num_rows or int(self._c.meta["num_rows"])
        if self._c.num_rows < int(self._c.meta["num_rows"]):  # a table only grows
            raise CorruptStoreError(disk.manifest_path(v), f"names num_rows={self._c.num_rows}, fewer than META's "
                                                           f"{self._c.meta['num_rows']}")
        disk.resize(self._c.num_rows)
        # and per chunk the newest segment folded into its base file (see _compact_round)
        self.cmap, self.folded = disk.read_chunkmap_folded(m.chunkmap)
        # what its files must hold (Disk.check_folded); a read-only handle's version never changes
        disk.bind_chunkmap(self.cmap, self.folded, max(m.segments, default=0) if self._c.readonly else None)
        # An in-place fold a crash interrupted is finished before anything reads (inplace.py)
        if self._c.readonly:
            inplace.refuse_if_interrupted(disk, self.cmap)
        else:
            inplace.redo(disk)
        self._cmap_gen = m.chunkmap
        self.committed = [disk.open_segment(s) for s in m.segments]
        self._published = (m.chunkmap, list(m.segments), self._c.num_rows)
        self.table_rows = self._table_published = m.table_rows  # a shard's table (distributed/)
        self.index_rebuild()
        self.version = v
        self._max_version = versions[-1]
        self._pins = disk.read_pins()
        seq, gen = disk.max_seq_and_gen()
        self._own_gens_from = gen + 1  # chunk files of these generations are this handle's own
        # Segment numbers only grow: the chunk map names segments folded (and deleted) long ago,
        # and a new segment numbered like one of them would count as folded before it is.
        self.next_seq = max(seq, int(self.folded.max(initial=0)), max(m.segments, default=0)) + 1
        self._next_gen = gen + 1
        if not self._c.readonly:
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
        return sum(s.live_bytes if held else s.nbytes for s in self.committed)

    def _foldable(self) -> list[Segment]:
        """The committed segments compaction rounds fold now: not those newer than a kept version
        that shares the chunk files (they hold the rows changed since it, sharing.py). The
        thresholds count these only, so a pass never starts for segments it may not fold."""
        share = self._sharing
        return [s for s in self.committed if share.foldable(s)]

    def _needs_compaction(self, ratio: float | None = None, segments: int = COMPACT_SEGMENTS,
                          floor: int = 0, held: bool = True, adding: int = 0) -> bool:
        """Segments rounds may fold (`_foldable`) past ``ratio`` of the table's bytes, or more
        than ``segments`` of them, with ``adding`` bytes more (a flush's own segment). ``held``:
        the bytes on disk, dead records given back (holes.py), which drop as the rounds fold
        chunk after chunk, not once a whole sweep is round; else the files' sizes."""
        ratio = COMPACT_RATIO if ratio is None else ratio  # read now: tests and benchmarks set it
        table = self._c.num_rows * self._c.row_bytes
        foldable = self._foldable()
        nbytes = sum(s.live_bytes if held else s.nbytes for s in foldable)
        return len(foldable) > segments or nbytes + adding > max(ratio * table, floor)

    def maybe_compact(self) -> None:
        """Compact in the background once segments pass the thresholds (after a flush, and at a
        writable open: many short open/flush/close runs would otherwise never get there). The
        compaction process starts here once segments hold half the share a pass starts at: ready
        before its first round (starting it costs a fraction of a second of CPU), never started by a store only
        read or by short runs that flush a little."""
        if self._grown_unflushed:
            return  # the next flush publishes the grown table first (see `_fold_round`)
        if self.fold_proc is None and not self._c.closed:
            if self._needs_compaction(COMPACT_RATIO / 2, COMPACT_SEGMENTS // 2):
                self._fold_process()
        if self._needs_compaction():
            self.submit_bg("_compact")

    def submit_bg(self, key: str) -> None:
        """Run the job ``key`` names (`_job`) on the background I/O thread; a job of the same kind
        already queued absorbs it."""
        with self._c.lock:
            if self._c.closed:
                return
            if self._bg is None:
                self._bg = ThreadPoolExecutor(1, thread_name_prefix="embcache-bg")
            if self.damage is not None:
                return  # fail-stop: a store that met a damaged file writes nothing more in its folder
            fut = self._bg_futures.get(key)
            if fut is not None and not fut.done():
                return
            self._bg_futures[key] = self._bg.submit(_run_bg_weakly, weakref.ref(self), key)

    def _job(self, key: str) -> Callable[[], None]:
        """The background job ``key`` names: the tiers' write-back (``"clean"``) or a method of this."""
        return self._t.clean if key == "clean" else getattr(self, key)

    def _run_bg(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # surfaced on the next flush()
            self._bg_error = exc
            if isinstance(exc, CorruptStoreError):
                self.saw_damage(exc)

    def saw_damage(self, exc: CorruptStoreError) -> None:
        """Fail-stop: from the first damaged file met, no background work writes in this folder
        (compaction, write-back, garbage collection); `stats().damaged` says so. The handle still
        serves what it can read, and flushes (which only append) still run if asked."""
        if self.damage is None:
            self.damage = exc
            if self.fold_proc is not None and self._c.pid == os.getpid():
                self.fold_proc.close()
                self.fold_proc = None

    def raise_bg_error(self) -> None:
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
            self.saw_damage(exc)
            raise

    def _compact_now(self) -> None:
        self._require_disk("compact")
        self.wait_bg()
        with self.flush_lock:
            self.await_round()
            while self.committed and self._compact_round(everything=True):
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
        while state is not None and not self._c.closed and self.damage is None:
            state = self._compact_step(state)

    def _compact_step(self, state: tuple[int, int] | None) -> tuple[int, int] | None:
        """One round of a background compaction pass; returns the pass's state for the next round
        (the newest segment when the sweep began, the superseded count then), or None when the
        pass is over. ``state=None`` begins a pass. The background runner calls it one round at a
        time through a weak reference, so a store dropped without close() is released between two
        rounds (`_run_bg_weakly`)."""
        if state is None:
            self._await_fold_process()
            state = (-1, self._c.stats.superseded_segments)
        target, superseded = state
        with self._c.lock:  # a flush asked for the writer lock: it goes first
            while self._flush_waiting and not self._c.closed:
                self._no_flush_waiting.wait(WAKE_S)  # notified as flushes get in, and by `wake` (close)
        if self._c.closed or self.damage is not None:
            return None
        if self.clean_due:
            self._t.clean()
        with self.flush_lock:
            if self._collect_due:
                self._collect_due = False
                self._collect_garbage_locked(self._disk, at_open=False)
            if not self.committed or self.committed[0].seq > target:
                # Round once: sweep again while segments are over the threshold, or over half
                # of it while flushes add rows that stay (none of their segments left out).
                hot_set = self._c.stats.superseded_segments != superseded
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
                target, superseded = foldable[-1].seq, self._c.stats.superseded_segments
            if not self._compact_round(unlocked=True):
                self._disk.pool.drain()
                return None
        return target, superseded

    def _await_fold_process(self) -> None:
        """Let a compaction process that is starting come up before a background pass (at most
        foldproc.START_WAIT_S): the pass is in the background, and its rounds folded here would
        hold the GIL beside the training thread."""
        deadline = time.monotonic() + foldproc.START_WAIT_S
        while self.fold_proc is not None and not self._c.closed and time.monotonic() < deadline:
            if self._fold_process() is not None or self.fold_proc is None:
                return
            time.sleep(0.01)

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
        folded = self.folded
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
        alone = disk.lock_version_alone(self.version)
        if alone is None:
            return none
        locks = [alone]
        try:
            listed = disk.list_versions()
            others = [v for v in listed if v != self.version]
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
        self.flush_lock.release()
        try:
            with self._c.lock:
                while self._flushes_to_let_in() and not self._c.closed:
                    self._no_flush_waiting.wait(WAKE_S)  # notified as flushes get in, and by `wake`
        finally:
            self.flush_lock.acquire()
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

    def _chunkmap_of(self, m: Manifest) -> np.ndarray:
        """Another version's chunk map (files never change: read once per generation)."""
        seen = self._chunkmaps_seen
        cm = seen.get(m.chunkmap)
        if cm is None:
            if len(seen) >= 16:
                seen.clear()
            cm = seen[m.chunkmap] = self._disk.read_chunkmap(m.chunkmap, m.num_rows or int(self._c.meta["num_rows"]))
        return cm

    def _forget_chunk_file(self, c: int, g: int) -> None:
        """Chunk file (c, g) changed in place: this handle's cached descriptors and block
        checksums of it go (the next read reads its new directory)."""
        self._disk._directories.pop((c, g), None)
        reader = self.chunkrows
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
            recs, present = fold_chunk(
                disk,
                c,
                int(cmap[c]),
                segs,
                verify=int(cmap[c]) < self._own_gens_from,
                init_rows=self._c.init_rows,
                folded=int(folded[c]),
            )
            disk.write_chunk(c, gen, recs, self._c.compress, durable=False, present=present, folded=segs[-1].seq)
            if handover:
                time.sleep(0)  # hand the GIL to a waiting training thread once per chunk (see `_fold_round`)
            written.append(c)
        disk.sync_chunks(written, gen)  # durable before the manifest names them
        return np.sort(np.concatenate([done, np.asarray(written, np.int64)]))

    def _fold_process(self) -> FoldProcess | None:
        """The store's compaction process, started here on the first call (`_maybe_compact`
        makes it) for a writable disk store the process is wanted for (`foldproc.wanted`); None
        while it starts, after it failed twice, or where it is not wanted."""
        proc = self.fold_proc
        if proc is None:
            if (
                self.disk is None
                or self._fold_proc_failed
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
                self._fold_proc_failed = True
                return None
        if proc.usable():
            return proc
        if proc.broken:  # it died or failed: one more start, then this thread for good
            proc.close()
            self.fold_proc = None
            self._fold_proc_failed = self._fold_proc_restarts >= 1
            self._fold_proc_restarts += 1
        return None

    def await_round(self) -> None:
        """Wait until no background round is folding without the writer lock (caller holds the
        writer lock exactly once, and lets go of it meanwhile: the round publishes under it)."""
        me = threading.get_ident()
        if self._round_thread in (None, me):
            return
        # Counted as a flush waiting, so that the background pass starts no new round until this
        # caller got in: each round would otherwise start while this thread waits to be scheduled.
        with self._c.lock:
            self._flush_waiting += 1
            self._awaiting_round += 1  # (a round folding in place does not let it in: `_flushes_to_let_in`)
        try:
            while self._round_thread not in (None, me):
                self.flush_lock.release()
                try:
                    self._round_done.wait()  # set when the round ends, however it ends (`_fold_round`)
                finally:
                    self.flush_lock.acquire()
        finally:
            with self._c.lock:
                self._awaiting_round -= 1
            self._flush_done_waiting()

    def _flushes_to_let_in(self) -> bool:
        """Whether a flush waits for the writer lock that does not wait for the round itself."""
        return self._flush_waiting > self._awaiting_round

    def _flush_done_waiting(self) -> None:
        """A flush waiting for the writer lock got it: wake whoever waits for fewer waiting
        (a compaction pass before its next round, a round folding in place letting flushes in)."""
        with self._c.lock:
            self._flush_waiting -= 1
            self._no_flush_waiting.notify_all()

    def wake(self) -> None:
        """The store closed (``core.closed`` was just set): background work waiting for flushes to
        get in looks again and stops."""
        with self._c.lock:
            self._no_flush_waiting.notify_all()

    def _compact_round(self, everything: bool = False, unlocked: bool = False) -> bool:
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
        plan = self._plan_round(everything)
        if plan is None:
            return False
        proc = self._fold_process()
        if unlocked:  # the writer lock may be let go of meanwhile: the process folds, or a flush goes first
            self._round_thread = threading.get_ident()
            self._round_done.clear()
        try:
            done = self._fold_planned(plan, proc, unlocked)
            if done is None:
                return False
            new = self._publish_round(plan, done)
            if new is None:
                return False  # fail-stop: a damaged file was met meanwhile, nothing more is written
        finally:
            with self._c.lock:
                self._writing_gens.discard(plan.gen)
            if unlocked:
                self._round_thread = None
                self._round_done.set()
        ready = self._adopt_round(plan, done, new)
        return self._collect_round(plan, done, new, ready)

    def _plan_round(self, everything: bool) -> _Round | None:
        """What a round folds, taken under the lock (caller holds the writer lock), with a new
        chunk map generation; None if there is nothing to fold, the store closed or it grew."""
        with self._c.lock:
            share = self._sharing
            segs = [s for s in self.committed if share.foldable(s)]
            # A grown table's layout is published by its next flush, never by a round: a round
            # rewrites the manifest of the version it folds, which has the size before the growth.
            if self._c.closed or not segs or self._grown_unflushed:
                return None
            cmap = self.cmap.copy()
            folded = self.folded  # replaced, never changed in place: only rounds move it
            old_gen = self._cmap_gen
            chunks = self._round_chunks(segs, everything)
            gen = self._next_gen
            self._next_gen += 1
            self._writing_gens.add(gen)
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
        chunks = np.setdiff1d(r.chunks, in_place)
        planned = len(chunks)
        if release:
            self.flush_lock.release()
        try:
            res = self._fold_elsewhere(proc, chunks, r.cmap, r.folded, r.segs, r.gen)
        finally:
            if release:
                self.flush_lock.acquire()
        new_files = self._fold_chunks(chunks, r.cmap, r.folded, r.segs, r.gen, res)
        if self._c.closed and not len(new_files) and planned and not len(in_place):
            return None
        return _Written(new_files, in_place, np.union1d(new_files, in_place), folded_bytes, written0)

    def _publish_round(self, r: _Round, w: _Written) -> _Published | None:
        """Publish the layout with the round's chunks folded: new chunk map, and without the
        leading segments now folded everywhere. Over the layout as it is now: a flush may have
        added (or left out) segments meanwhile. None where a damaged file was met meanwhile."""
        newest = r.segs[-1].seq
        with self._c.lock:
            segs = list(self.committed)
        new_cmap = r.cmap.copy()  # rounds never overlap: the chunk map is the snapshot's
        new_cmap[w.new_files] = r.gen  # (a file folded in place keeps its name)
        folded = self.folded.copy()
        folded[w.chunks] = newest
        drop = 0
        for s in segs:
            if not (folded[s.idx_chunk] >= s.seq).all():
                break
            drop += 1
        if self.damage is not None:
            return None
        self._disk.write_chunkmap(r.gen, new_cmap, folded)
        version = self.version
        m = self._publish_layout(r.gen, segs[drop:])
        return _Published(m, version, new_cmap, folded, segs, drop)

    def _adopt_round(self, r: _Round, w: _Written, p: _Published) -> int:
        """The published round becomes the live layout (and the shared versions' too); returns
        the file pool's epoch from which reads see it (`holes.py`)."""
        disk = self._disk
        m, remaining = p.manifest, p.segs[p.drop:]
        if m.version >= self._max_version:
            try:
                disk.write_latest(m.version)  # LATEST links to the newest manifest's file
            except StoreError:
                pass  # the record only lags (open's check stays sound)
        with self._c.lock:  # the caller holds the writer lock: the committed segments are those read above
            assert [s.seq for s in self.committed] == [s.seq for s in p.segs], "layout moved during compaction"
            self.cmap, self._cmap_gen, self.committed, self.folded = p.cmap, r.gen, remaining, p.folded
            self._published = (r.gen, [s.seq for s in remaining], self._c.num_rows)
            if m.version != p.version:
                self._parent = p.version
                self.version = self._max_version = m.version
            if p.drop:
                # Segments left the layout: renumber the index. A round that dropped none leaves
                # it as it is (it indexes segments only; rebuilding it over every delta record,
                # under the store lock, would make a training thread's get wait every round),
                # dropping the entries of the chunks it folded only once they are many.
                self.index_rebuild()
            elif self.rows is not None:
                self.rows.note_folded(w.chunks, self._c.chunk_rows, p.folded)
            self.below_token += 1  # same rows, but the folded segments are no longer read
            self._c.stats.compactions += 1
            self._c.stats.chunks_folded_in_place += len(w.in_place)
            self._c.stats.compaction_folded_bytes += w.folded_bytes
            # Reads planned from here on read the records this round folded from the new base
            # files; those planned before, without the lock, register before this epoch.
            ready = disk.pool.seal()
        # The kept versions that share the chunk files read the new ones too (sharing.py).
        self._repoint(r.share.members, r.old_gen, r.gen, r.segs, p.folded)
        with self._c.lock:
            self._c.stats.compaction_bytes_written += disk.compaction_bytes_written - w.written0
        return ready

    def _collect_round(self, r: _Round, w: _Written, p: _Published, ready: int) -> bool:
        """Give back what the round replaced: dead records, the replaced chunk files and dropped
        segments once no kept version uses them (round by round, so disk use stays near the table
        plus one round; the dropped segments' descriptors close when the last reader lets go).
        False if the store closed or met damage meanwhile (the next open collects it)."""
        if self._c.closed or self.damage is not None:
            return False
        disk = self._disk
        listed = disk.list_versions()  # (for both: nothing adds or drops a version meanwhile)
        self._refresh_sharing(listed)
        self._kill_dead(ready, listed)
        disk.pool.limit = len(w.new_files)  # the next round of the pass rewrites about as many files
        replaced = [(c, g) for c, g in zip(w.new_files.tolist(), r.cmap[w.new_files].tolist()) if g]
        version = p.version
        if not (p.manifest.version == version
                and self._collect_replaced(disk, version, replaced, p.segs[: p.drop], r.old_gen, listed)):
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
        version = self.version
        segs = [s.seq for s in remaining]
        alone = disk.lock_version_alone(version)
        try:
            if alone is not None:
                m = Manifest(version, gen, segs, self._parent, disk.manifest_checksum(version), self._c.num_rows,
                             self._table_published)
            else:
                m = Manifest(self._max_version + 1, gen, segs, version, num_rows=self._c.num_rows,
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
        with self._c.lock:
            segs, folded, gen, version = list(self.committed), self.folded, self._cmap_gen, self.version
        dead.mark(segs, folded, ready, self._protected_segments(version, gen, listed))
        if self._segment_bytes(held=True) > PUNCH_FROM * self._c.num_rows * self._c.row_bytes:
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
        disk = self.disk
        if disk is None or self._c.readonly:
            return
        if listed is None:
            listed = disk.list_versions()
        with self._c.lock:
            segs, gen, version, pins = list(self.committed), self._cmap_gen, self.version, set(self._pins)
        seqs = {s.seq for s in segs}
        members = []
        for v in listed:
            m = self._manifest_of(v) if v in pins and v != version else None
            if m is None:
                continue
            # a version of another size (before a growth) never shares: its chunk map has its size
            same_size = (m.num_rows or int(self._c.meta["num_rows"])) == self._c.num_rows
            if same_size and sharing.shares(m, gen, seqs) and self._unread(v):
                members.append(m)
        self._sharing = sharing.plan(segs, members, self._c.num_rows * self._c.row_bytes)

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
        with self._c.lock:
            if self._pins or self._c.closed or old_gen in self._writing_gens or old_gen == self._cmap_gen:
                return False
        if listed != [version]:
            return False
        pooled = [(c, g) for c, g in replaced if disk.retire_chunk(c, g, pool=True)]
        for seg in dropped:
            disk.delete_file(seg.path)
        if old_gen:
            disk.delete_file(disk.chunkmap_path(old_gen))
        if pooled:
            reader = self.chunkrows
            if reader is not None:
                reader.forget(pooled)  # a stale plan's read finds them gone, as if deleted
            disk.pool.seal()
        return True

    def _collect_garbage(self, at_open: bool = False) -> None:
        disk = self.disk
        if disk is None or self._c.readonly:
            return
        with self.flush_lock:  # nothing is being published or compacted while it looks
            if not (at_open or self._collect_due):
                return  # a compaction pass collected it between its rounds (`_compact`)
            self._collect_due = False
            self._collect_garbage_locked(disk, at_open)

    def _collect_garbage_locked(self, disk: Disk, at_open: bool, pool: bool = False) -> None:
        """``pool``: replaced chunk files go into ``disk.pool`` (the next round overwrites them)
        instead of being deleted, where it has room."""
        with self._c.lock:
            if self._c.closed and not at_open or self.damage is not None:
                return  # fail-stop: a store that met a damaged file deletes nothing in its folder
            live_segs = {s.seq for s in self.committed + self.pending} | self.writing_seqs
            gens = {self._cmap_gen} | self._writing_gens
            # The chunk files the live layout reads: after two compactions with no flush between,
            # it still uses chunks of the first one's generation, which no manifest lists yet.
            used = np.flatnonzero(self.cmap)
            live_files = set(zip(used.tolist(), self.cmap[used].tolist()))
            # Anything numbered from here on is written after this snapshot: never garbage.
            new_seq, new_gen = self.next_seq, self._next_gen
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
            reader = self.chunkrows
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
        if not self._t.resident():
            trim_heap()

    def wait_bg(self) -> None:
        for fut in list(self._bg_futures.values()):
            fut.result()

    def find_below(self, rows: RowIndex, ids: np.ndarray, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segment number, row position) of each id's newest delta record in ``rows``, -1 where it
        has none or the record is dead: its chunk's base file holds it (holes.py; the record may
        be punched out of its segment, so it is never read). Caller holds the lock."""
        seg, pos = rows.find(ids)
        dead = dead_rows(rows.seqs, seg, chunks, self.folded)
        if dead.any():
            seg[dead] = -1
        return seg, pos

    def chunkrows_reader(self) -> ChunkRows | None:
        r = self.chunkrows
        if r is None and self.disk is not None:
            r = ChunkRows(self.disk)
            # generations numbered from here on are written by this handle's compactions
            r.trusted_from_gen = self._next_gen
            self.chunkrows = r
        return r

    # ---- the delta segments: one index over all of them ----------------------------------------
    def index_add(self, seg: Any) -> None:
        """Index a segment this handle just wrote (a flush or a write-back): newest of all.

        Rows below the hot tier change here too: a prefetch that read a whole chunk before this
        segment existed must not keep that copy (warm tier), even when the write began before
        the prefetch planned its reads (`Tiers.begin_write_back` moved the token then)."""
        self.below_token += 1
        trust(seg)  # written by us a moment ago: the page cache holds what was checksummed
        if self.rows is None:
            self.rows = RowIndex(num_rows=self._c.num_rows)
        self.rows.add(seg)

    def index_rebuild(self) -> None:
        self.rows = RowIndex(sorted(self.committed + self.pending, key=lambda g: g.seq), self._c.num_rows,
                              self.folded)

    def layout_of(self, chunk: int) -> tuple[int, tuple | None]:
        """Where ``chunk``'s rows live below the hot tier now: its base file's generation (0 =
        never written) and its newest delta records (ids, segment numbers, positions, segments).
        Segments never change and a base file changes (folded in place, inplace.py) only in rows
        newer records of this snapshot's segments hold, so it can be read without the lock (caller
        holds it while taking the snapshot)."""
        gen = int(self.cmap[chunk]) if self.disk is not None else 0
        rows = self.rows
        if rows is None or not len(rows):
            return gen, None
        lo = chunk * self._c.chunk_rows
        ids, seg, pos = rows.in_range(lo, lo + self._c.chunk_rows)
        if len(ids) and len(self.folded):
            live = rows.seqs[seg] > self.folded[chunk]  # the others are dead: the base holds them
            ids, seg, pos = ids[live], seg[live], pos[live]
        return gen, (ids, seg, pos, rows.segs) if len(ids) else None

    # ------------------------------------------------------------------ opening and closing
    def open(self, version: int | None, *, create: bool, grown_rows: int | None = None) -> None:
        """Open the files: a writable handle takes the LOCK file first; ``create`` writes META and
        version 0; then ``version`` (None: the newest) is loaded, its size setting ``core.num_rows``.
        ``grown_rows`` (`EmbeddingStore.grow`): the layout is then padded to that many rows.
        On failure call `abandon`."""
        c = self._c
        root = c.root
        if root is None:  # memory only: no files, every chunk never written
            if grown_rows is not None:
                c.num_rows = grown_rows
            self.cmap = np.zeros(c.num_chunks, np.int32)
            return
        if not c.readonly and self._lock_fd is None:
            self.take_lock(root)
        if create:
            Disk.write_meta(root, c.meta)
        self.disk = Disk(
            root,
            c.num_rows,
            c.chunk_rows,
            c.row_bytes,
            fileio.uuid_bytes(c.meta["uuid"]),
            unbound=c.meta.get("names_bound") is not True,
        )
        self._disk.set_init_rows(c.init_rows)  # the rows a sparse chunk file does not hold
        if create:
            self._disk.write_manifest(Manifest(0, 0, []))
        self._load_version(version)  # the version's size: ``core.num_rows`` from its manifest
        if grown_rows is not None and grown_rows != c.num_rows:
            self._grow_layout(grown_rows)

    def abandon(self, keep_lock: bool) -> None:
        """Undo a failed `open` (or a failed construction after it): files closed, the LOCK file
        let go of unless ``keep_lock`` (a growth keeps it: growth.py reopens the store)."""
        if not keep_lock:
            self.release_lock()
        Disk.unlock_reader(self._reader_fd)
        self._reader_fd = None
        if self.disk is not None:
            for seg in self.committed:
                seg.close()
            self._disk.close()

    def _grow_layout(self, num_rows: int) -> None:
        """The layout of the version at ``num_rows`` rows (a grown store, before its tiers are
        made): chunk map padded with never-written chunks, a short last chunk's base file dropped,
        all published by the next flush (growth.py)."""
        c, disk = self._c, self.disk
        assert disk is not None
        old, cr = c.num_rows, c.chunk_rows
        chunks = (num_rows + cr - 1) // cr
        cmap = np.zeros(chunks, np.int32)
        cmap[: len(self.cmap)] = self.cmap
        folded = np.zeros(chunks, np.int64)
        folded[: len(self.folded)] = self.folded
        if old % cr:
            # its base file holds the old rows only; growth carried them, the rest is init.
            # The records it folded stay dead (the folded mark stays): the carried rows are newer.
            cmap[old // cr] = 0
        c.num_rows = num_rows
        disk.resize(num_rows)
        if self._cmap_gen:  # a chunk map file has its table's size: the grown layout gets its own
            gen = self._next_gen
            self._next_gen += 1
            disk.write_chunkmap(gen, cmap, folded)
            self._cmap_gen = gen
        self.cmap, self.folded = cmap, folded
        self.index_rebuild()
        self._grown_unflushed = True
        self._refresh_sharing()

    def stop_threads(self, wait: bool = True) -> None:
        """Stop the background I/O thread (`EmbeddingStore.close`; its job ends at its next look)."""
        stop_executor(self._bg, wait)

    def close_files(self) -> None:
        """Close the compaction process, the segments and the disk (caller holds both locks)."""
        if self.fold_proc is not None and self._c.pid == os.getpid():
            self.fold_proc.close()
        for s in self.committed + self.pending:
            s.close()
        if self.chunkrows is not None:
            self.chunkrows.close()
        if self.disk is not None:
            self._disk.close()

    def release(self) -> None:
        """Let go of the LOCK file and of the reader lock of a read-only handle (`close`)."""
        self.release_lock()
        Disk.unlock_reader(self._reader_fd)
        self._reader_fd = None

    def after_fork(self) -> None:
        """In a forked child: no thread survived the fork, and a lock may have been held."""
        if self._lock_fd is not None:
            # The child's copy of the writer lock's descriptor would hold the flock after the
            # parent died (a DataLoader worker outliving a killed trainer): close it, without
            # unlocking (the open file is the parent's too), so the lock lives as long as the parent.
            try:
                os.close(self._lock_fd)
            except OSError:
                pass
            self._lock_fd = None
        self._no_flush_waiting = threading.Condition(self._c.lock)
        self.flush_lock = threading.RLock()
        self._round_thread, self._round_done = None, threading.Event()
        self.fold_proc = None  # the parent's; its handle refuses to serve another process anyway
        self._bg = None
        self._bg_futures = {}

    def kept(self) -> dict:
        """What a grown store keeps of these (growth.py): the writer lock and its waiters, the LOCK
        file, the compaction process's failures, the version."""
        return {"flush_lock": self.flush_lock, "no_flush_waiting": self._no_flush_waiting,
                "flush_waiting": self._flush_waiting, "lock_fd": self._lock_fd,
                "fold_proc_failed": self._fold_proc_failed, "fold_proc_restarts": self._fold_proc_restarts,
                "version": self.version}

    def fill_stats(self, s: Any) -> None:
        """The layout's share of `EmbeddingStore.stats` (caller holds the lock)."""
        disk = self.disk
        s.damaged = int(self.damage is not None)
        s.bytes_read = disk.total_bytes_read if disk else 0
        s.bytes_written = disk.bytes_written if disk else 0
        s.write_back_seconds = disk.write_back_seconds if disk else 0.0
        s.version = self.version
        s.pending_segments = len(self.pending)
        s.segments = len(self.committed)

    # ------------------------------------------------------------------ segments the tiers write
    def take_seq(self) -> int:
        """A number for a segment written now, newer than every other."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def begin_segment(self) -> int:
        """A number for a segment the rows of a write-back go to: rows below the hot tier change
        from here (the token moves) and garbage collection skips it until `end_segment`. Caller
        holds the lock."""
        self.below_token += 1
        seq = self.take_seq()
        self.writing_seqs.add(seq)
        return seq

    def end_segment(self, seq: int) -> None:
        """The write of segment ``seq`` ended (published, pending or failed)."""
        self.writing_seqs.discard(seq)

    def add_pending(self, seg: Segment) -> None:
        """A segment this handle just wrote without publishing it (write-back, a write around the
        hot tier) becomes part of the rows below the hot tier: indexed. Caller holds the lock."""
        self.pending.append(seg)
        self.pending.sort(key=lambda g: g.seq)
        self.pending_bytes += seg.nbytes
        self.index_add(seg)

