"""Durability of EmbeddingStore: flush, versions and pins.

`Versions` is the component of `EmbeddingStore` that owns what is on disk: the writer lock (and
the LOCK file, lockfile.py), the `Disk`, and the live layout (committed and pending segments,
chunk map, the row index over the segments, segment and generation numbers). It composes `Compaction`
(compaction.py: folding segments into base chunks) and `Garbage` (garbage.py: the other versions
on disk, dead records, garbage collection), which see it as a `compaction.Writer`, and
`Background` (background.py: the background I/O thread those jobs run on). The hot and warm
tiers (`Tiers`, tiers.py) read through it (`layout_of`, `find_below`, `rows`, `cmap`) and add
the segments their write-back writes (`take_seq`, `add_pending`); it drives their write-back
through a few named methods (`WriteBack`). See docs/store-format.md for the protocol.

Concurrency design (docs/store.md, "Threads"): two locks, always taken in this order.

* ``self.flush_lock``, the *writer lock* (re-entrant): held for the whole of every job that
  changes what is on disk or which files the live layout reads: `flush`, the background
  write-back `_clean`, each compaction round (snapshot, reading the segments, writing chunks,
  publishing, collecting its garbage), garbage collection, retention and `pin`/`unpin`. So these
  never interleave: a round cannot fold a layout a flush or another round moved meanwhile, and
  garbage collection never runs while any of them is writing. Background compaction lets go of
  it between rounds (a waiting flush goes first), so no caller waits for more than one round,
  and while the compaction process folds a round's chunks (see `Compaction._fold_round`): a flush
  then runs beside the fold, and a round of another thread waits for it (`await_round`).
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
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from . import fileio, inplace, lockfile
from .background import Background
from .chunkrows import ChunkRows
from .compaction import COMPACT_SEGMENTS, Compaction, Writer
from .core import StoreCore
from .disk import Disk, Manifest, Segment
from .errors import CorruptStoreError, StoreError
from .garbage import Garbage
from .holes import dead_rows
from .memory import trim_heap
from .rowindex import RowIndex, trust
from .validate import version_arg

if TYPE_CHECKING:
    from .growth import Kept

# Past this share a flush runs compaction rounds itself before writing (backpressure: flushes
# faster than background compaction would otherwise pile segments up without bound).
HARD_RATIO = 0.4
HARD_FLOOR = 256 << 10  # below this many bytes of segments no flush waits for compaction
# Waits for flushes to get in are notified (`_flush_done_waiting`, `wake`); this bounds one only
# as a safety net, should a store be dropped without its close running.
WAKE_S = 1.0
KEEP_VERSIONS = 1  # unpinned versions kept: the latest only (pins and read-only handles keep theirs)


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
        self.next_gen = 1  # the next chunk map generation (`take_gen`)
        self.own_gens_from = 1  # chunk files of these generations are this handle's own
        self._published: tuple = (0, [], 0)
        self.below_token = 0  # moves whenever rows below the hot tier change (see `Prefetcher.prefetch`)
        self._round_thread: int | None = None  # a background round folding without the writer lock
        self._round_done = threading.Event()
        self._flush_waiting = 0  # flushes waiting for the writer lock (compaction yields to them)
        self._no_flush_waiting = threading.Condition(core.lock)  # notified when that count drops, and at close
        self._awaiting_round = 0  # of the flushes waiting, those waiting for the background round to end
        self.clean_due = False  # a background clean was asked for (a running compaction runs it between rounds)
        self.writing_seqs: set[int] = set()  # segments being written: garbage collection skips them
        self.writing_gens: set[int] = set()  # compaction generations being written
        self.damage: CorruptStoreError | None = None  # the first damaged file met: background work stops
        self._grown_unflushed = False  # grown since the last flush: no round until it publishes the size
        # rows of the whole table when this store is a shard of one (`ShardedStore` sets it; the
        # manifests record it); the published version's, to flush a change of it alone
        self.table_rows = self._table_published = 0
        me = cast(Writer, weakref.proxy(self))  # held weakly: no cycle keeps a dropped store
        self.bg = Background(core, self)  # the background I/O thread (background.py)
        # other versions on disk, dead records and garbage (garbage.py); compaction (compaction.py)
        self.garbage = Garbage(core, me)
        self.compaction = Compaction(core, me, self.garbage)
        if kept is not None:  # a grown store (growth.py): the same locks, counters and writer lock
            self.flush_lock, self._no_flush_waiting = kept.flush_lock, kept.no_flush_waiting
            self._flush_waiting, self._lock_fd = kept.flush_waiting, kept.lock_fd
            self.compaction.proc_failed, self.compaction.proc_restarts = kept.fold_proc_failed, kept.fold_proc_restarts
            self.version = kept.version

    def compact(self) -> None:
        """Fold every committed delta segment into base chunks now (`Compaction.compact`)."""
        self._require_disk("compact")
        self.compaction.compact()

    # ------------------------------------------------------------------ what compaction asks (Writer)
    @property
    def cmap_gen(self) -> int:
        """The generation of the live chunk map (0: none written yet)."""
        return self._cmap_gen

    @property
    def grown_unflushed(self) -> bool:
        """Grown since the last flush: no round until that flush publishes the size."""
        return self._grown_unflushed

    def take_gen(self) -> int:
        """A chunk map generation for files written now, newer than every other."""
        gen = self.next_gen
        self.next_gen += 1
        return gen

    def publish_layout(self, gen: int, remaining: list[Segment]) -> Manifest:
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

    def record_latest(self, version: int) -> None:
        """Record a version published by `publish_layout` in LATEST, where it is the newest."""
        if version >= self._max_version:
            try:
                self._disk.write_latest(version)  # LATEST links to the newest manifest's file
            except StoreError:
                pass  # the record only lags (open's check stays sound)

    def adopt_layout(self, m: Manifest, before: int, gen: int, cmap: np.ndarray, folded: np.ndarray,
                     remaining: list[Segment], dropped: int, chunks: np.ndarray) -> None:
        """A compaction round's layout ``m`` (published over version ``before``) becomes the live
        one: chunk map ``gen`` with ``cmap`` and ``folded``, the committed segments ``remaining``
        after ``dropped`` left, ``chunks`` folded. Caller holds both locks."""
        self.cmap, self._cmap_gen, self.committed, self.folded = cmap, gen, remaining, folded
        self._published = (gen, [s.seq for s in remaining], self._c.num_rows)
        if m.version != before:
            self._parent = before
            self.version = self._max_version = m.version
        if dropped:
            # Segments left the layout: renumber the index. A round that dropped none leaves
            # it as it is (it indexes segments only; rebuilding it over every delta record,
            # under the store lock, would make a training thread's get wait every round),
            # dropping the entries of the chunks it folded only once they are many.
            self.index_rebuild()
        elif self.rows is not None:
            self.rows.note_folded(chunks, self._c.chunk_rows, folded)
        self.below_token += 1  # same rows, but the folded segments are no longer read

    def round_unlocked(self, running: bool) -> None:
        """A background round of this thread lets go of the writer lock meanwhile (``running``),
        or has ended however it ended: `await_round` waits for that."""
        if running:
            self._round_thread = threading.get_ident()
            self._round_done.clear()
        else:
            self._round_thread = None
            self._round_done.set()

    def wait_for_flushes(self, all_of_them: bool) -> None:
        """Wait until no flush waits for the writer lock (``all_of_them``; else none but those
        waiting for the background round itself, `flushes_to_let_in`), or the store closed."""
        with self._c.lock:
            while (self._flush_waiting if all_of_them else self.flushes_to_let_in()) and not self._c.closed:
                self._no_flush_waiting.wait(WAKE_S)  # notified as flushes get in, and by `wake` (close)

    def clean_if_due(self) -> None:
        """Run the tiers' background write-back where one was asked for (between two rounds)."""
        if self.clean_due:
            self.clean_now()

    def clean_now(self) -> None:
        """Run the tiers' write-back (the background job ``"clean"``, background.py)."""
        self._t.clean()

    def trim_heap(self) -> None:
        """Return freed heap pages to the OS after big background work, in disk mode only.

        There the RSS budget is the point, and background threads' malloc arenas would otherwise
        keep their slack. In memory mode the table is the budget; a trim there only makes the
        training thread fault its next allocations back in (page faults in the get path after every
        flush, until the heap refilled).
        """
        if not self._t.resident():
            trim_heap()

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

    def release_lock(self) -> None:
        """Let go of the LOCK file (`close`, a failed open)."""
        if self._lock_fd is not None:
            lockfile.release(self._lock_fd, self._c.pid)
            self._lock_fd = None

    # ------------------------------------------------------------------ flush and versions
    def flush(self) -> int:
        """Make every update so far durable as a new version and return it.

        Thread-safe: may run in a background thread while another thread calls get/update;
        rows updated during the flush go into the next version.
        """
        self.bg.raise_error()
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
                return self.compaction.needs(HARD_RATIO, 2 * COMPACT_SEGMENTS, HARD_FLOOR, held=True, adding=adding)

            if self.garbage.dead is not None and over():
                self.garbage.dead.run()  # dead records not given back yet go first (holes.py)
            if over():
                self.await_round()
            while over() and self.compaction.compact_round():
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
        self.trim_heap()
        self.compaction.maybe_compact()
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
            gone = set() if self.version in self._pins else gone - self.garbage.sharing.segments
            kept = [g for g in self.committed + pending if g.seq not in gone]
            version = self._max_version + 1
            segs = [g.seq for g in kept]
        try:
            # one no manifest will list need not be durable
            self._disk.sync_segments([p for p in pending if p.seq not in gone])
            new = [self._disk.write_segment(seq, ids, records, reuse=True)] if len(ids) else []
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
        self.apply_retention()
        self.garbage.refresh_sharing()
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
            self.garbage.refresh_sharing()

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
            self.apply_retention()
            self.garbage.refresh_sharing()

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

    def apply_retention(self, collect: bool = True) -> None:
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
            self.garbage.collect_due = True
            self.bg.submit("_collect_garbage")

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
        # and per chunk the newest segment folded into its base file (see `Compaction._publish_round`)
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
        self.own_gens_from = gen + 1  # chunk files of these generations are this handle's own
        # Segment numbers only grow: the chunk map names segments folded (and deleted) long ago,
        # and a new segment numbered like one of them would count as folded before it is.
        self.next_seq = max(seq, int(self.folded.max(initial=0)), max(m.segments, default=0)) + 1
        self.next_gen = gen + 1
        if not self._c.readonly:
            # Leftovers of a crash (unreferenced segments, temp files) are removed by the writer.
            self.garbage.collect(at_open=True)
            # and records base chunks already hold give their blocks back (a crash, or a close
            # before the last punch, may have left them whole)
            self.garbage.start_punching(disk)
            self.garbage.kill_dead(disk.pool.seal())
            self.garbage.refresh_sharing()

    def saw_damage(self, exc: CorruptStoreError) -> None:
        """Fail-stop: from the first damaged file met, no background work writes in this folder
        (compaction, write-back, garbage collection); `stats().damaged` says so. The handle still
        serves what it can read, and flushes (which only append) still run if asked."""
        if self.damage is None:
            self.damage = exc
            proc = self.compaction.fold_proc
            if proc is not None and self._c.pid == os.getpid():
                proc.close()
                self.compaction.fold_proc = None

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
            self._awaiting_round += 1  # (a round folding in place does not let it in: `flushes_to_let_in`)
        try:
            while self._round_thread not in (None, me):
                self.flush_lock.release()
                try:
                    self._round_done.wait()  # set when the round ends, however it ends (`round_unlocked`)
                finally:
                    self.flush_lock.acquire()
        finally:
            with self._c.lock:
                self._awaiting_round -= 1
            self._flush_done_waiting()

    def flushes_to_let_in(self) -> bool:
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
        self.compaction.wake()

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
            r.trusted_from_gen = self.next_gen
            self.chunkrows = r
        return r

    # ---- the delta segments: one index over all of them ----------------------------------------
    def index_add(self, seg: Any) -> None:
        """Index a segment this handle just wrote (a flush or a write-back): newest of all.

        Rows below the hot tier change here too: a prefetch that read a whole chunk before this
        segment existed must not keep that copy (warm tier), even when the write began before
        the prefetch planned its reads (`WriteBack.begin_write_back` moved the token then)."""
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
            self._lock_fd = lockfile.take(root)  # one writer per path
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
            gen = self.take_gen()
            disk.write_chunkmap(gen, cmap, folded)
            self._cmap_gen = gen
        self.cmap, self.folded = cmap, folded
        self.index_rebuild()
        self._grown_unflushed = True
        self.garbage.refresh_sharing()

    def close_files(self) -> None:
        """Close the compaction process, the segments and the disk (caller holds both locks)."""
        proc = self.compaction.fold_proc
        if proc is not None and self._c.pid == os.getpid():
            proc.close()
        for s in self.committed + self.pending:
            s.close()
        if self.chunkrows is not None:
            self.chunkrows.close()
        if self.disk is not None:
            if self.damage is not None:  # fail-stop: nothing deleted (a writable open removes it)
                self._disk.segment_pool.forget()
            self._disk.close()

    def release(self) -> None:
        """Let go of the LOCK file and of the reader lock of a read-only handle (`close`)."""
        self.release_lock()
        Disk.unlock_reader(self._reader_fd)
        self._reader_fd = None

    def after_fork(self) -> None:
        """In a forked child: no thread survived the fork, and a lock may have been held."""
        if self._lock_fd is not None:
            lockfile.drop_in_child(self._lock_fd)  # the lock lives as long as the parent
            self._lock_fd = None
        self._no_flush_waiting = threading.Condition(self._c.lock)
        self.flush_lock = threading.RLock()
        self._round_thread, self._round_done = None, threading.Event()
        self.compaction.fold_proc = None  # the parent's; its handle refuses to serve another process anyway
        self.bg.after_fork()

    def kept(self) -> dict:
        """What a grown store keeps of these (growth.py): the writer lock and its waiters, the LOCK
        file, the compaction process's failures, the version."""
        return {"flush_lock": self.flush_lock, "no_flush_waiting": self._no_flush_waiting,
                "flush_waiting": self._flush_waiting, "lock_fd": self._lock_fd,
                "fold_proc_failed": self.compaction.proc_failed, "fold_proc_restarts": self.compaction.proc_restarts,
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


if TYPE_CHECKING:
    def _serves_compaction(v: Versions) -> Writer:
        return v  # mypy checks that `Versions` offers everything `Writer` names
