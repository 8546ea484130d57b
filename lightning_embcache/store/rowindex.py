"""One index over every delta segment: where the newest record of each id lives.

A miss asks it once per batch (two ``searchsorted`` over sorted arrays), instead of asking each
of dozens of segments. New segments (flushes, write-backs of evicted rows) merge into a small
*recent* run; the recent run merges into the main run once it holds an eighth as many entries,
so adding a segment costs O(its rows + recent) and each entry is re-merged O(1) times on average
(the LSM-tree idea). Memory: 12 bytes per entry (id, segment number, row position; 16 for a
table of more than 2**31 rows).

Given the table's row count, a bitmap of the ids indexed (one bit per row) answers first: ids
without a delta record (never written, or folded into base chunks) skip the binary search, whose
~log2(entries) probes into arrays of megabytes are cache misses when training shares the caches.
"""

from __future__ import annotations

import numpy as np

from . import idsets, uring
from .errors import CorruptStoreError
from .fileio import crc32
from .holes import dead_entries, dead_rows

_EMPTY_I32 = np.zeros(0, np.int32)


def _merge(a: tuple, b: tuple) -> tuple:
    """(ids, seg, pos) runs ``a`` then ``b`` merged by id; of equal ids the entry of ``b`` wins.

    Each output array is allocated once and filled in place (where ``b``'s entries go found by a
    search of ``a``, not a sort of both): besides the inputs and the output it needs about 11
    bytes per entry, where concatenating and sorting needed ~40 (this merge's transient is the
    index's memory peak, and the index grows with the table's delta rows)."""
    ai, bi = a[0], b[0]
    if not len(ai):
        return b
    if not len(bi):
        return a
    at = ai.searchsorted(bi)  # where each of b's entries goes among a's
    hit = at < len(ai)
    hit[hit] = ai[at[hit]] == bi[hit]
    drop = at[hit]  # a's entries that b replaces (sorted, unique)
    n = len(ai) - len(drop) + len(bi)
    bpos = np.arange(len(bi)) + at - np.searchsorted(drop, at)  # b's places in the output
    from_a = np.ones(n, np.bool_)
    from_a[bpos] = False
    keep = None
    if len(drop):
        keep = np.ones(len(ai), np.bool_)
        keep[drop] = False
    out = []
    for x, y in zip(a, b):
        o = np.empty(n, x.dtype)
        o[bpos] = y
        o[from_a] = x[keep] if keep is not None else x
        out.append(o)
    return tuple(out)


class RowIndex:
    """Newest (segment, row position) of each id over the segments added, in order."""

    def __init__(self, segments: list | tuple = (), num_rows: int | None = None,
                 folded: np.ndarray | None = None) -> None:
        self.segs: list = []  # segment number -> Segment; a snapshot of this list stays valid
        # ids as int32 where every id fits (12 bytes an entry, not 16); queries are cast to it,
        # never the index (a search of int32 ids by int64 keys would copy the whole run)
        self._idt = np.dtype(np.int32 if num_rows is not None and num_rows <= np.iinfo(np.int32).max else np.int64)
        self._empty = (np.zeros(0, self._idt), _EMPTY_I32, _EMPTY_I32)
        self._main = self._empty
        self._recent = self._empty
        # bit i % 8 of byte i // 8: id i has an entry (ids are only added until a rebuild)
        self._bits = np.zeros((num_rows + 7) // 8, np.uint8) if num_rows is not None else None
        # per segment number: ids whose newest record it holds (0: every record it holds has a
        # newer one, and a manifest that lists the newer ones needs it no more)
        self._live = np.zeros(0, np.int64)
        self.seqs = np.array([g.seq for g in segments], np.int64)  # per segment number: its ``seq``
        if segments:
            parts = []
            for seg in segments:
                k = len(self.segs)
                self.segs.append(seg)
                ids, pos = seg.ids.astype(self._idt), np.arange(len(seg.ids), dtype=np.int32)
                if folded is not None and len(folded) and len(ids):
                    # records base chunks hold are never read (holes.py): not indexed
                    live = np.repeat(~dead_entries(seg, folded), seg.idx_count)
                    if not live.all():
                        ids, pos = ids[live], pos[live]
                parts.append((ids, np.full(len(ids), k, np.int32), pos))
            ids = np.concatenate([p[0] for p in parts])
            order = np.argsort(ids, kind="stable")
            ids = ids[order]
            keep = np.r_[ids[1:] != ids[:-1], True] if len(ids) else np.zeros(0, np.bool_)
            sel = order[keep]
            self._main = (ids[keep], np.concatenate([p[1] for p in parts])[sel],
                          np.concatenate([p[2] for p in parts])[sel])
            self._mark(self._main[0])
            self._live = np.bincount(self._main[1], minlength=len(self.segs)).astype(np.int64)
        self._dead = 0  # entries (about) whose records base chunks hold since the last prune

    def __len__(self) -> int:
        return len(self._main[0]) + len(self._recent[0])

    @property
    def nbytes(self) -> int:
        return (self._idt.itemsize + 8) * len(self)

    def add(self, seg) -> None:
        """Index ``seg`` (newer than every segment added so far)."""
        k = len(self.segs)
        n = len(seg.ids)
        older = self.find(seg.ids)[0] if n and len(self) else _EMPTY_I32
        self.segs.append(seg)
        self.seqs = np.append(self.seqs, seg.seq)
        self._live = np.append(self._live, n)
        if not n:
            return
        older = older[older >= 0]
        if len(older):
            self._live[: k] -= np.bincount(older, minlength=k)
        self._mark(seg.ids)
        run = (seg.ids.astype(self._idt), np.full(n, k, np.int32), np.arange(n, dtype=np.int32))
        self._recent = _merge(self._recent, run)
        if len(self._recent[0]) > max(4096, len(self._main[0]) // 8):
            self._main = _merge(self._main, self._recent)
            self._recent = self._empty

    def superseded(self, segments: list, newer_ids: np.ndarray) -> set[int]:
        """Numbers (``seq``) of those of ``segments`` (indexed here) every record of which has a
        newer one in a later indexed segment or among ``newer_ids`` (a segment about to be
        written): a manifest listing those newer ones reads the same rows without them. Cost:
        one search of ``newer_ids``, never a scan of the index."""
        live = self._live
        if len(newer_ids) and len(self):
            at = self.find(newer_ids)[0]
            at = at[at >= 0]
            if len(at):
                live = live - np.bincount(at, minlength=len(live))
        where = {id(g): k for k, g in enumerate(self.segs)}
        out = set()
        for g in segments:
            k = where.get(id(g))
            if k is not None and live[k] == 0:
                out.add(g.seq)
        return out

    def note_folded(self, chunks: np.ndarray, chunk_rows: int, folded: np.ndarray) -> None:
        """Compaction folded ``chunks`` (chunk map ``folded``): their entries are dead now (reads
        go to the base files). Once they are a quarter of the index they are dropped (`prune`), so
        the index follows the live records, and so does the work and memory of every later merge."""
        top = np.iinfo(self._idt).max
        lo = np.minimum(chunks * chunk_rows, top).astype(self._idt)  # the runs' type: no copy of them
        hi = np.minimum(chunks * chunk_rows + chunk_rows, top).astype(self._idt)
        for run in (self._main, self._recent):
            if len(run[0]):
                self._dead += int((run[0].searchsorted(hi) - run[0].searchsorted(lo)).sum())
        if self._dead * 4 > len(self):
            self.prune(folded, chunk_rows)

    def prune(self, folded: np.ndarray, chunk_rows: int) -> int:
        """Drop every entry whose record base chunks hold (``folded[chunk] >= its segment's
        seq``); return how many went. A segment all of whose entries went holds nothing a read
        needs: `superseded` names it, and the next flush leaves it out."""
        gone = 0
        runs = []
        for run in (self._main, self._recent):
            ids, seg, pos = run
            if len(ids):
                dead = dead_rows(self.seqs, seg, ids // chunk_rows, folded)
                n = int(np.count_nonzero(dead))
                if n:
                    counted = seg[dead]
                    if run is self._main and len(self._recent[0]):
                        # an id in both runs is the recent one's: its main entry was uncounted
                        # from ``_live`` when the recent one came (`add`)
                        counted = counted[~idsets.isin(ids[dead], self._recent[0], b_sorted_unique=True)]
                    self._live -= np.bincount(counted, minlength=len(self._live))
                    keep = ~dead
                    run = (ids[keep], seg[keep], pos[keep])
                    gone += n
            runs.append(run)
        self._main, self._recent = runs[0], runs[1]
        self._dead = 0
        return gone

    @staticmethod
    def _find_in(run: tuple, ids: np.ndarray, seg: np.ndarray, pos: np.ndarray) -> None:
        rid = run[0]
        n = len(rid)
        if not n:
            return
        at = rid.searchsorted(ids)
        at[at >= n] = n - 1
        hit = rid[at] == ids
        seg[hit] = run[1][at[hit]]
        pos[hit] = run[2][at[hit]]

    def _mark(self, ids: np.ndarray) -> None:
        if self._bits is not None and len(ids):
            np.bitwise_or.at(self._bits, ids >> 3, (1 << (ids & 7)).astype(np.uint8))

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each id: (segment number, row position) of its newest record; segment -1 if none."""
        bits = self._bits
        if bits is not None and len(ids):
            has = (bits[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1
            if not has.all():
                sel = np.flatnonzero(has)
                seg = np.full(len(ids), -1, np.int32)
                pos = np.zeros(len(ids), np.int32)
                if len(sel):
                    seg[sel], pos[sel] = self._search(ids[sel])
                return seg, pos
        return self._search(ids)

    def any_of(self, ids: np.ndarray) -> bool:
        """Whether any of ``ids`` has a delta record (`find`'s answer reduced to one bool, without
        its arrays: the bitmap alone answers for ids never indexed)."""
        bits = self._bits
        if bits is not None and len(ids):
            has = (bits[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1
            if not has.any():
                return False
            ids = ids[has.astype(np.bool_)]
        return bool((self._search(ids)[0] >= 0).any())

    def _search(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if ids.dtype != self._idt:
            ids = ids.astype(self._idt)  # (ids are in range: checked by the store)
        seg = np.full(len(ids), -1, np.int32)
        pos = np.zeros(len(ids), np.int32)
        self._find_in(self._main, ids, seg, pos)
        self._find_in(self._recent, ids, seg, pos)  # newer: overrides
        return seg, pos

    def in_range(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, segment numbers, row positions) of every indexed id in [lo, hi)."""
        parts = []
        top = np.iinfo(self._idt).max
        bounds = np.array([min(lo, top), min(hi, top)], self._idt)  # the runs' type: no copy of them
        for run in (self._main, self._recent):
            a, b = run[0].searchsorted(bounds)
            parts.append((run[0][a:b], run[1][a:b], run[2][a:b]))
        (mi, ms, mp), (ri, rs, rp) = parts
        if len(ri) and len(mi):
            old = ~idsets.isin(mi, ri, b_sorted_unique=True)
            mi, ms, mp = mi[old], ms[old], mp[old]
        return np.concatenate([mi, ri]), np.concatenate([ms, rs]), np.concatenate([mp, rp])


def trust(seg) -> None:
    """Mark every record of ``seg`` verified: this handle wrote them a moment ago (a flush or a
    write-back), so the page cache holds exactly what was checksummed."""
    seg._verified = np.ones(len(seg.idx_chunk), np.bool_)


def _verify_ranges(seg, pos: np.ndarray, out: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows of ``seg`` at sorted positions ``pos`` whose chunk range was not verified through this
    handle yet: read each such range whole, check its checksum, fill ``out[rows[i]]`` from it.
    Returns the mask of positions still to read."""
    rb = seg.row_bytes
    verified = seg._verified
    if verified is None:
        verified = seg._verified = np.zeros(len(seg.idx_chunk), np.bool_)
    ent = seg.idx_start.searchsorted(pos, "right") - 1
    todo = ~verified[ent]
    if todo.any():
        for e in idsets.unique(ent[todo]).tolist():
            a, c = int(seg.idx_start[e]), int(seg.idx_count[e])
            data = seg._read(seg.records_offset + a * rb, c * rb)
            if crc32(data) != int(seg.idx_crc[e]):
                raise CorruptStoreError(seg.path, f"records of chunk {int(seg.idx_chunk[e])} fail their checksum")
            verified[e] = True
            mine = np.flatnonzero(ent == e)
            out[rows[mine]] = np.frombuffer(data, np.uint8).reshape(c, rb)[pos[mine] - a]
    return ~todo


def _fd_of(seg) -> int:
    if seg._fd is None:
        seg._read(seg.records_offset, 0)  # opens the segment's long-lived descriptor
    return seg._fd


def segment_gather(seg, pos: np.ndarray) -> np.ndarray:
    """Records at sorted row positions ``pos`` of ``seg``, checksum-verified."""
    out = np.empty((len(pos), seg.row_bytes), np.uint8)
    gather_deltas(out, np.arange(len(pos)), np.zeros(len(pos), np.int32), pos, [seg])
    return out


def gather_deltas(out: np.ndarray, rows: np.ndarray, seg: np.ndarray, pos: np.ndarray, segs: list,
                  counts: list | None = None) -> None:
    """``out[rows[i]] = record pos[i] of segment seg[i]``, checksum-verified.

    Each chunk range of a segment carries one checksum: the first read of a range through this
    handle reads and verifies it whole; later reads fetch only the rows asked for, one read per
    run of adjacent rows, and the reads of every segment touched go to the kernel as one batch
    (`uring.read_into`) through the segments' long-lived descriptors.
    """
    if not len(seg):
        return
    if len(seg) == 1 or (seg[1:] == seg[:-1]).all():
        order = np.arange(len(seg))
        bounds = [0, len(seg)]
    else:
        order = np.argsort(seg, kind="stable")
        s = seg[order]
        bounds = idsets.runs(s).tolist()
    rb = out.shape[1]
    fds, offs, lens, dsts = [], [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        sel = order[a:b]
        g = segs[int(seg[sel[0]])]
        p, r = pos[sel], rows[sel]
        if len(p) > 1 and (p[1:] < p[:-1]).any():  # positions of one segment in file order
            o = np.argsort(p, kind="stable")
            p, r = p[o], r[o]
        left = _verify_ranges(g, p, out, r)
        if not left.any():
            continue
        p, r = p[left], r[left]
        # runs of adjacent positions that land in adjacent rows of ``out``: one read each
        brk = np.flatnonzero(np.r_[True, (p[1:] != p[:-1] + 1) | (r[1:] != r[:-1] + 1), True])
        st, n = brk[:-1], np.diff(brk)
        fds.append(np.full(len(st), _fd_of(g), np.int64))
        offs.append(g.records_offset + p[st].astype(np.int64) * rb)
        lens.append(n.astype(np.int64) * rb)
        dsts.append(r[st].astype(np.int64) * rb)
        if g.read_counter is not None:
            g.read_counter[0] += int(n.sum()) * rb
    if not fds:
        return
    lens_all = np.concatenate(lens)
    got = uring.read_into(out, np.concatenate(dsts), np.concatenate(fds), lens_all, np.concatenate(offs), counts)
    if not np.array_equal(got, lens_all):
        bad = int(np.flatnonzero(got != lens_all)[0])
        fd = int(np.concatenate(fds)[bad])
        path = next(segs[int(x)].path for x in np.unique(seg).tolist() if _fd_of(segs[int(x)]) == fd)
        raise CorruptStoreError(path, "truncated: a record lies past the end of the file")
