"""A segment's chunk directory adds nothing for the garbage collector to walk.

A compaction pass asks every committed segment for every chunk: building a tuple per directory
entry made hundreds of GC-tracked objects per segment, which set off full collections of the whole
process's heap (89 ms of a 0.6 s pass of 14 segments). The directory is ints only.
"""

from __future__ import annotations

import gc

import numpy as np
import torch

from lightning_embcache import EmbeddingStore


def test_chunk_directory_allocates_no_tracked_objects(tmp_path):
    s = EmbeddingStore.create(tmp_path / "s", 64 * 2000, 4, hot_bytes=1 << 20, chunk_rows=64)
    ids = torch.from_numpy(np.arange(0, 64 * 2000, 128))  # one row in each even chunk
    s.update(ids, torch.ones(len(ids), 4))
    s.flush()
    seg = s._versions.committed[-1]
    assert len(seg.idx_chunk) == 1000
    seg._entries = None
    gc.disable()
    try:
        before = gc.get_count()[0]
        for c in range(0, 2000, 14):
            got = seg.rows_of_chunk(c)
            assert got is not None and torch.equal(torch.from_numpy(got[1].copy()).view(torch.float32), torch.ones(1, 4))
        made = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert not gc.is_tracked(seg._entries)
    assert made < 200, made  # a handful per call; a tuple per directory entry made 1,000+
    assert seg.rows_of_chunk(1) is None
    s.close()
