"""What the other versions on disk keep, and what no version keeps any more.

`Garbage` is the part of `Versions` that looks past the writer's own version: the manifests of
the pinned versions and of those read-only handles hold (read once each), which of them share
the writer's chunk files (sharing.py) and get published again after each compaction round
(`repoint`), the delta records they protect from being punched (holes.py), and the collection of
files no version lists (a round's replaced files, leftovers of a crash). It reads the live
layout through `compaction.Writer` (held weakly: `Versions` holds this). Callers hold the writer
lock, or open the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import sharing
from .core import StoreCore
from .disk import Disk, Manifest, Segment
from .errors import StoreError, VersionNotFoundError
from .holes import DeadRecords
from .sharing import Sharing

if TYPE_CHECKING:
    from .compaction import Writer

# Dead records are given back once segments hold this share of the table on disk (a flush past
# HARD_RATIO gives them back first): below it a punch buys nothing, and each costs file-system
# metadata work (journal commits that a flush's fsync may wait for).
PUNCH_FROM = 0.3


class Garbage:
    """Other versions' manifests and sharing, dead records, garbage collection (see the module)."""

    def __init__(self, core: StoreCore, writer: Writer) -> None:
        self._c = core
        self._v = writer
        self.dead: DeadRecords | None = None  # a writer's punching of dead delta records (holes.py)
        # other versions' manifests (only this writer's compaction rounds change them: `repoint`)
        self._manifests_seen: dict[int, Manifest] = {}
        self._chunkmaps_seen: dict[int, np.ndarray] = {}  # other versions' chunk maps, by generation
        self.sharing = Sharing()  # kept versions sharing the chunk files, what rounds fold (sharing.py)
        self.collect_due = False  # a garbage collection was asked for (a running compaction runs it between rounds)

    @property
    def _disk(self) -> Disk:
        disk = self._v.disk
        assert disk is not None, "a store without files has no disk"
        return disk

    def start_punching(self, disk: Disk) -> None:
        """A writable open: dead records are given back from now on (holes.py)."""
        self.dead = DeadRecords(disk)

    def kill_dead(self, ready: int, listed: list[int] | None = None) -> None:
        """Queue the delta records the chunk map now says base chunks hold, to be punched once no
        read begun before epoch ``ready`` runs, and punch those due (holes.py). ``listed``: the
        versions on disk, if the caller has just listed them. Caller holds the writer lock (or
        opens the store)."""
        dead = self.dead
        if dead is None or not dead.works:
            return
        v = self._v
        with self._c.lock:
            segs, folded, gen, version = list(v.committed), v.folded, v.cmap_gen, v.version
        dead.mark(segs, folded, ready, self._protected_segments(version, gen, listed))
        held = sum(s.live_bytes for s in v.committed)
        if held > PUNCH_FROM * self._c.num_rows * self._c.row_bytes:
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
            m = self.manifest_of(v)
            if m is not None and m.chunkmap != gen:
                out.update(m.segments)
        return out

    def manifest_of(self, version: int) -> Manifest | None:
        """Another version's manifest, read once (None: dropped since it was listed)."""
        m = self._manifests_seen.get(version)
        if m is None:
            try:
                m = self._manifests_seen[version] = self._disk.read_manifest(version)
            except (StoreError, OSError):
                return None
        return m

    def chunkmap_of(self, m: Manifest) -> np.ndarray:
        """Another version's chunk map (files never change: read once per generation)."""
        seen = self._chunkmaps_seen
        cm = seen.get(m.chunkmap)
        if cm is None:
            if len(seen) >= 16:
                seen.clear()
            cm = seen[m.chunkmap] = self._disk.read_chunkmap(m.chunkmap, m.num_rows or int(self._c.meta["num_rows"]))
        return cm

    def refresh_sharing(self, listed: list[int] | None = None) -> None:
        """Find the pinned versions that share the writer's chunk files and how far rounds may
        fold without copying the chunks they read (sharing.py). A version a read-only handle
        holds keeps its files: it is left out. Caller holds the writer lock (or opens the store)."""
        v = self._v
        disk = v.disk
        if disk is None or self._c.readonly:
            return
        if listed is None:
            listed = disk.list_versions()
        with self._c.lock:
            segs, gen, version, pins = list(v.committed), v.cmap_gen, v.version, set(v.pinned())
        seqs = {s.seq for s in segs}
        members = []
        for k in listed:
            m = self.manifest_of(k) if k in pins and k != version else None
            if m is None:
                continue
            # a version of another size (before a growth) never shares: its chunk map has its size
            same_size = (m.num_rows or int(self._c.meta["num_rows"])) == self._c.num_rows
            if same_size and sharing.shares(m, gen, seqs) and self._unread(k):
                members.append(m)
        self.sharing = sharing.plan(segs, members, self._c.num_rows * self._c.row_bytes)

    def _unread(self, version: int) -> bool:
        """No read-only handle holds ``version`` now (one that opens it later finds it published
        again, or waits for that: `repoint` holds its lock exclusively)."""
        alone = self._disk.lock_version_alone(version)
        self._disk.unlock_reader(alone)
        return alone is not None

    def repoint(
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
        pins = self._v.pinned()
        for v in members:
            if v not in pins:
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

    def collect_replaced(
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
        v = self._v
        with self._c.lock:
            if v.pinned() or self._c.closed or old_gen in v.writing_gens or old_gen == v.cmap_gen:
                return False
        if listed != [version]:
            return False
        pooled = [(c, g) for c, g in replaced if disk.retire_chunk(c, g, pool=True)]
        if old_gen:
            disk.delete_file(disk.chunkmap_path(old_gen))
        if pooled:
            self._forget(pooled)
        for seg in dropped:  # (after `_forget`: pooling one seals a read epoch)
            disk.retire_segment(seg.path)
        return True

    def collect(self, at_open: bool = False) -> None:
        """Collect the garbage (the background job ``"_collect_garbage"``, and a writable open)."""
        disk = self._v.disk
        if disk is None or self._c.readonly:
            return
        with self._v.flush_lock:  # nothing is being published or compacted while it looks
            if not (at_open or self.collect_due):
                return  # a compaction pass collected it between its rounds (`Compaction.step`)
            self.collect_due = False
            self.collect_locked(disk, at_open)

    def collect_locked(self, disk: Disk, at_open: bool, pool: bool = False) -> None:
        """``pool``: replaced chunk files go into ``disk.pool`` (the next round overwrites them)
        instead of being deleted, where it has room."""
        v = self._v
        with self._c.lock:
            if self._c.closed and not at_open or v.damage is not None:
                return  # fail-stop: a store that met a damaged file deletes nothing in its folder
            live_segs = {s.seq for s in v.committed + v.pending} | v.writing_seqs
            gens = {v.cmap_gen} | v.writing_gens
            # The chunk files the live layout reads: after two compactions with no flush between,
            # it still uses chunks of the first one's generation, which no manifest lists yet.
            cmap = v.cmap
            used = np.flatnonzero(cmap)
            live_files = set(zip(used.tolist(), cmap[used].tolist()))
            # Anything numbered from here on is written after this snapshot: never garbage.
            new_seq, new_gen = v.next_seq, v.next_gen
        pooled = disk.collect_garbage(
            disk.list_versions(),
            live_segs,
            gens,
            new_seq,
            new_gen,
            remove_temp=at_open,
            keep_files=live_files,
            pool=pool,
            stop=lambda: v.damage is not None,  # damage met while this collection runs: keep the rest
        )
        if pooled:
            self._forget(pooled)

    def _forget(self, pooled: list[tuple[int, int]]) -> None:
        """Chunk files that went into the pool: the reader's cached directories of them go."""
        reader = self._v.chunkrows
        if reader is not None:
            reader.forget(pooled)  # a stale plan's read finds them gone, as if deleted
        self._disk.pool.seal()
