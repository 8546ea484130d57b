"""A prefetch reads below the hot tier without the store lock, beside the training thread and
compactions: a row it read before a compaction folded a newer record must never be installed,
and a chunk reader shared by both threads must read the generation each one asked for."""

from __future__ import annotations

import numpy as np
import torch
from _store_helpers import compacted_store

from lightning_embcache import EmbeddingStore
from lightning_embcache.store.chunkrows import ChunkRows

N, DIM, CHUNK = 1024, 8, 64


def _store(path):
    return compacted_store(path, N, DIM, CHUNK)


def test_prefetch_read_before_a_compaction_is_not_installed(shm_path):
    """The plan finds row 5 in its base chunk; while it reads, the row is updated, evicted,
    flushed and compacted into a new base chunk: before and after, the index says "base chunk",
    so only the chunk's new generation tells that the value read is stale."""
    table = _store(shm_path / "s")
    with EmbeddingStore.open(shm_path / "s", hot_bytes=64 * (DIM * 4 + 32)) as s:
        read_below = s._tiers.read_below
        new = torch.full((1, DIM), 7.0)

        def racing_read(plan, **kw):
            out = read_below(plan, **kw)  # row 5 as it is now: the table's value
            s.update(torch.tensor([5]), new)
            s.evict(1 << 30)  # written back to a pending segment
            s.flush()
            s.compact()  # folded into a new generation of chunk 0
            return out

        s._tiers.read_below = racing_read
        s._tiers.prefetch.prefetch_once(np.array([5]))
        s._tiers.read_below = read_below
        assert torch.equal(s.get(torch.tensor([5])), new)
        assert not torch.equal(new, table[5:6])


def test_a_reader_never_reads_another_generation_than_asked(shm_path):
    """Thread A opens chunk 0's new generation; before it reads, thread B (a prefetch planned
    earlier) opens the old one in the shared reader: A must still read the new rows."""
    _store(shm_path / "s")
    with EmbeddingStore.open(shm_path / "s") as s:
        old_gen = int(s._versions.cmap[0])
        s.update(torch.arange(CHUNK), torch.ones(CHUNK, DIM))
        s.flush()
        with EmbeddingStore.open(shm_path / "s", readonly=True):  # keeps the old chunk files
            s.compact()
        new_gen = int(s._versions.cmap[0])
        assert new_gen > old_gen
        reader = ChunkRows(s._versions.disk)
        ensure = reader._ensure_open

        def interleaved(chunks, gens):
            ensure(chunks, gens)
            reader._open(0, old_gen)  # what the prefetch thread did in between
        reader._ensure_open = interleaved
        local = np.arange(4)
        got = reader.read(np.zeros(4, np.int64), local, np.full(4, new_gen, np.int64))
        want = s._versions.disk.read_chunk(0, new_gen)[local]
        assert np.array_equal(got, want)
        assert not np.array_equal(got, s._versions.disk.read_chunk(0, old_gen)[local])
        reader.close()
