"""Folding delta segments into one base chunk: the body of a compaction round.

Shared by the store's own thread and the compaction process (`foldproc`), which imports this
module without torch: a fold needs numpy, the store's files and nothing else, except the initial
values of rows nobody wrote, which only the store can compute (its ``init`` may be a callable).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .disk import Disk, Segment

# A chunk whose base is never-written or sparse stays sparse (a file of just the rows ever written;
# the others keep their initial values) while those rows are under this share of the chunk.
SPARSE_SHARE = 0.5


def fold_chunk(
    disk: Disk,
    c: int,
    base_gen: int,
    segs: list[Segment],
    *,
    verify: bool,
    init_rows: Callable[[np.ndarray], np.ndarray] | None,
    folded: int = 0,
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Chunk ``c``'s records with every segment's records of it applied, oldest first, and
    which rows they are: None for every row of the chunk, else the sorted chunk-relative rows
    ever written, when its base is never-written (``base_gen`` 0) or sparse and those rows are
    under SPARSE_SHARE of the chunk (a sparse file then holds just them: compaction never writes
    the initial value of a row nobody wrote).

    ``verify``: check the base file's block checksums (False for a file this handle wrote: the page
    cache holds what was checksummed). A chunk that becomes dense computes the initial values of
    the rows nobody wrote with ``init_rows(ids)``; without it, the fold returns None (only the
    store can compute them: the compaction process leaves such a chunk to it).

    ``folded``: the newest segment the base file already holds (the chunk map's; a raw file that
    records holding less is refused: `Disk.check_folded`); older segments' records of this chunk
    are dead and may be punched out of their files (holes.py): skipped."""
    rows = disk.chunk_rows_of(c)
    lo = c * disk.chunk_rows
    deltas = [got for s in segs if s.seq > folded and (got := s.rows_of_chunk(c)) is not None]
    if base_gen:
        present, recs = disk.read_chunk_present(c, base_gen, verify=verify, folded=folded)
        if present is None:  # a dense base stays dense
            for ids, records in deltas:
                recs[ids - lo] = records
            return recs, None
    else:
        present, recs = np.zeros(0, np.int64), np.zeros((0, disk.row_bytes), np.uint8)
    written = np.zeros(rows, np.bool_)
    written[present] = True
    for ids, _ in deltas:
        written[ids - lo] = True
    local = np.flatnonzero(written)
    if len(local) >= SPARSE_SHARE * rows:
        rest = np.flatnonzero(~written)
        if len(rest) and init_rows is None:
            return None
        dense = np.empty((rows, disk.row_bytes), np.uint8)
        if len(rest):  # the store's `_init_rows` also serves stores initialised per chunk
            dense[rest] = init_rows(rest + lo)  # type: ignore[misc]
        dense[present] = recs
        for ids, records in deltas:
            dense[ids - lo] = records
        return dense, None
    packed = np.empty((len(local), disk.row_bytes), np.uint8)
    packed[local.searchsorted(present)] = recs
    for ids, records in deltas:
        packed[local.searchsorted(ids - lo)] = records
    return packed, local
