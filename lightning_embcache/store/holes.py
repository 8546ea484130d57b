"""Dead delta records: give back their disk blocks as soon as base chunks hold them.

A flush writes one segment with rows of (nearly) every chunk, and a segment file can go only
once every chunk it touches has been folded into its base file: one whole sweep of compaction
rounds round the table. Meanwhile the records of the chunks already folded are never read again
(a record of segment ``s`` for chunk ``c`` is *dead* once the chunk map's ``folded[c] >= s.seq``:
the base file holds that row's value, and reads and folds go there instead), so their blocks are
handed back to the file system (``fallocate(PUNCH_HOLE)``) once segments hold a fair share of
the table (garbage.PUNCH_FROM; a flush past the limit first gives back what is due), and disk
use and the compaction thresholds follow the bytes held, not the files' sizes: a flush that finds
segments over the limit waits for about one round, not for the rest of a sweep.

What may be punched, and when (writer handles only, under the writer lock):

* only records dead under the chunk map just published, in segments listed by no other version
  on disk with an older chunk map (a pinned version, one a read-only handle holds), whose readers
  would still read them;
* only once every read of this process that may have planned to read them has ended: reads
  planned without the store lock (a prefetch) register in the file pool's epochs
  (recycle.FilePool), and a round seals an epoch when it publishes; the records it killed are
  punched once no read begun before that seal is running. Reads made under the store lock plan
  after the publish, so they never plan to read a dead record.

A crash at any point leaves each punched range either punched or whole; nothing reads it either
way. On a file system without holes nothing is punched and the accounting stays on whole files.
"""

from __future__ import annotations

import os

import numpy as np

from . import fileio
from .disk import Segment


def dead_entries(seg: Segment, folded: np.ndarray) -> np.ndarray:
    """Which index entries (one per chunk) of ``seg`` base chunks already hold."""
    return folded[seg.idx_chunk] >= seg.seq


def dead_rows(seqs: np.ndarray, seg: np.ndarray, chunks: np.ndarray, folded: np.ndarray) -> np.ndarray:
    """For rows whose newest delta record is in segment number ``seg`` (-1: none) of an index whose
    segments have sequence numbers ``seqs``: is that record dead (read the base chunk instead)?"""
    out = seg >= 0
    if not len(folded) or not out.any():
        return np.zeros(len(seg), np.bool_)
    out &= folded[chunks] >= seqs[np.maximum(seg, 0)]
    return out


def _ranges(seg: Segment, punched: np.ndarray, new: np.ndarray) -> tuple[list[tuple[int, int]], int]:
    """Byte ranges to punch for the entries ``new`` (already set in ``punched``), and the whole
    4 KiB pages every maximal run of ``punched`` entries holds (what punching them has freed).

    A range covers a run's new entries and reaches one page into the dead entries beside them,
    so the partial pages at the seams with earlier holes go too, and what was punched already
    is not punched again."""
    idx = np.flatnonzero(punched)
    if not len(idx):
        return [], 0
    page = fileio.PAGE
    rb = seg.row_bytes
    starts = seg.records_offset + seg.idx_start * rb
    ends = starts + seg.idx_count * rb
    brk = np.flatnonzero(np.diff(idx) != 1)
    first = idx[np.r_[0, brk + 1]]
    last = idx[np.r_[brk, len(idx) - 1]]
    lo, hi = starts[first], ends[last]
    pages = int(np.maximum(hi // page - (-(-lo // page)), 0).sum()) * page
    nidx = np.flatnonzero(new)
    if not len(nidx):
        return [], pages
    # per run: its first and last new entry
    run_of = np.searchsorted(first, nidx, "right") - 1
    bounds = np.flatnonzero(np.r_[True, run_of[1:] != run_of[:-1], True])
    r = run_of[bounds[:-1]]
    a = np.maximum(starts[nidx[bounds[:-1]]] - page, lo[r])
    b = np.minimum(ends[nidx[bounds[1:] - 1]] + page, hi[r])
    return list(zip(a.tolist(), (b - a).tolist())), pages


class DeadRecords:
    """Punches the dead records of a writer's segments (see the module docstring)."""

    def __init__(self, disk) -> None:
        self.disk = disk
        self.works = fileio.punch_supported()
        self._queue: list[tuple[Segment, np.ndarray, int]] = []  # (segment, entries, ready epoch)
        self.punched_bytes = 0  # given back so far

    def mark(self, segs: list[Segment], folded: np.ndarray, ready: int, protected: set[int]) -> None:
        """Queue the entries of ``segs`` dead under ``folded`` and not punched or queued yet, to be
        punched once no read begun before epoch ``ready`` runs. Segments in ``protected`` (listed
        by an older version) are left whole."""
        if not self.works:
            return
        for s in segs:
            if s.seq in protected:
                continue
            dead = dead_entries(s, folded)
            if s.doomed is None:
                s.doomed = np.zeros(len(dead), np.bool_)
            new = dead & ~s.doomed
            if new.any():
                s.doomed |= new
                self._queue.append((s, new, ready))

    def run(self) -> None:
        """Punch what is queued and no read can reach any more (caller holds the writer lock)."""
        if not self._queue:
            return
        pool = self.disk.pool
        left = []
        for s, new, ready in self._queue:
            if pool.reads_before(ready):
                left.append((s, new, ready))
                continue
            self._punch(s, new)
        self._queue = left

    def _punch(self, s: Segment, new: np.ndarray) -> None:
        if s.punched is None:
            s.punched = np.zeros(len(new), np.bool_)
        s.punched |= new
        ranges, pages = _ranges(s, s.punched, new)
        try:
            fd = os.open(s.path.name, os.O_WRONLY | fileio._NOFOLLOW | fileio._CLOEXEC, dir_fd=self.disk._segments_fd)
        except OSError:
            return  # gone (dropped meanwhile) or unwritable: nothing to give back
        try:
            ok = fileio.punch_holes(fd, ranges, s.path) >= 0
        except OSError:  # an injected fault (the fault-injection suite): the bytes stay
            return
        finally:
            os.close(fd)
        if not ok:
            self.works = False  # no holes on this file system: thresholds stay on whole files
            self._queue = []
            return
        self.punched_bytes += max(0, pages - s.freed)
        s.freed = pages
