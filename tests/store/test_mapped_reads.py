"""Rows below the hot tier gathered through maps of the base chunk files (store/mapped.py): no
read call for a cached row, each 4 KiB block verified once per map, damage named, maps follow
compaction and in-place changes (`ChunkRows.invalidate`), every value checked against a model."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _store_helpers import compacted_store, model_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import CorruptStoreError, EmbeddingStore
from lightning_embcache.store import chunkrows, uring
from lightning_embcache.store.disk import Disk

N, DIM, CHUNK = 4096, 128, 256  # 512-byte rows: 8 to a block, 32 blocks per chunk
ROW = DIM * 4
HOT = 64 * (ROW + 11)


def _count_read_calls(monkeypatch) -> list:
    calls: list = []
    for mod, name in ((os, "open"), (os, "pread"), (os, "preadv"), (uring, "read_into")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def test_cached_rows_are_gathered_through_maps_without_a_read_call(shm_path, monkeypatch):
    """Once a chunk file is mapped and the blocks of its rows verified, a miss of those rows opens
    nothing and makes no read call (pread, preadv, io_uring): one gather out of the maps."""
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    ids = torch.from_numpy(np.random.default_rng(0).permutation(N)[:200])
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        assert torch.equal(s.get(ids), table[ids])  # first read: maps the files, verifies the blocks
        s.evict(1 << 30)
        reader = s._versions.chunkrows
        before = reader.map_counts[0]
        calls = _count_read_calls(monkeypatch)
        for part in ids.split(50):
            assert torch.equal(s.get(part), table[part])
        assert calls == [], calls
        assert reader.map_counts[0] - before == len(ids)


def test_each_block_is_verified_once_per_map_until_invalidated(shm_path, monkeypatch):
    """Rows in distinct blocks of a chunk verify exactly those blocks, once; `invalidate(chunk)`
    (a fold about to change the file in place) makes the next read read the file's checksums
    again and verify its blocks anew, without a stale map serving meanwhile."""
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    dirs = []
    real = Disk._raw_chunk_directory
    monkeypatch.setattr(Disk, "_raw_chunk_directory", lambda self, path, chunk, **kw: dirs.append(chunk) or real(self, path, chunk, **kw))
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        ids = torch.tensor([3 * CHUNK + 8 * b for b in (1, 5, 9)])  # blocks 1, 5 and 9 of chunk 3
        assert torch.equal(s.get(ids), table[ids])
        reader = s._versions.chunkrows
        assert reader.map_counts[1] == 3 and dirs == [3]
        s.evict(1 << 30)
        assert torch.equal(s.get(ids), table[ids])
        assert reader.map_counts[1] == 3, "a verified block was checked again"
        reader.invalidate(3)
        assert reader._map_gen[3] == 0 and reader._maps.mapped[3] == 0  # no read in progress: unmapped now
        s.evict(1 << 30)
        assert torch.equal(s.get(ids), table[ids])
        assert reader.map_counts[1] == 6 and dirs == [3, 3]


def test_a_chunk_keeping_needing_first_reads_is_verified_whole(shm_path, numpy_gets):
    """After `WHOLE_AFTER` calls that verify blocks of a chunk one by one, the next checks the
    whole chunk in one pass; then no block of it is checked again. (The general path's rule: the
    C loop checks blocks one by one at no Python cost each, test_mapped_get.py.)"""
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        reader = None
        for k in range(chunkrows.WHOLE_AFTER + 1):
            one = torch.tensor([2 * CHUNK + 8 * k])  # a new block of chunk 2 each call
            assert torch.equal(s.get(one), table[one])
            reader = s._versions.chunkrows
        assert reader.map_counts[1] == chunkrows.WHOLE_AFTER + CHUNK * ROW // 4096
        rest = torch.arange(2 * CHUNK, 3 * CHUNK)
        s.evict(1 << 30)
        assert torch.equal(s.get(rest), table[rest])
        assert reader.map_counts[1] == chunkrows.WHOLE_AFTER + CHUNK * ROW // 4096


@pytest.mark.parametrize("rows", ["one", "dense"])
def test_a_damaged_block_read_through_a_map_is_named_and_never_served(shm_path, rows):
    """A flipped bit in a chunk's records: a read of a row in that block (alone: block by block;
    or with many rows of the chunk: the chunk whole) raises CorruptStoreError naming the file and
    the block, and returns nothing."""
    compacted_store(shm_path / "s", N, DIM, CHUNK)
    f = sorted((shm_path / "s" / "chunks").glob("c00000007-*"))[-1]
    raw = bytearray(f.read_bytes())
    raw[-CHUNK * ROW + 3 * 4096 + 5] ^= 0xFF  # block 3 of chunk 7's records
    f.write_bytes(bytes(raw))
    ids = torch.tensor([7 * CHUNK + 3 * 8 + 1]) if rows == "one" else torch.arange(7 * CHUNK, 8 * CHUNK, 2)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        with pytest.raises(CorruptStoreError) as info:
            s.get(ids)
        assert f.name in str(info.value) and "block 3 of chunk 7" in str(info.value)
        assert s._versions.chunkrows.map_counts[0] == 0


def test_maps_follow_compaction_and_stay_within_their_bound(shm_path, monkeypatch):
    """Rows rewritten and compacted into a new generation are read from the new file's map (the
    old map stops serving at once and goes when no read is in progress); with at most 4 maps
    allowed, reads over 16 chunks stay right and at most 4 files stay mapped."""
    monkeypatch.setattr(chunkrows, "MAX_MAPPED", 4)
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        ids = torch.arange(0, N, 7)
        for part in ids.split(64):
            assert torch.equal(s.get(part), table[part])
        reader = s._versions.chunkrows
        assert reader._maps.count <= 4 and reader.map_counts[0] > 0
        mapped = np.flatnonzero(reader._map_gen)
        c = int(mapped[0])
        mine = torch.arange(c * CHUNK, (c + 1) * CHUNK)
        table[mine] += 1
        s.update(mine, table[mine])
        s.flush()
        s.compact()
        s.flush()
        s.evict(1 << 30)
        assert torch.equal(s.get(mine[::3]), table[mine[::3]])
        assert reader._map_gen[c] == s._versions.cmap[c] == reader._maps.mapped[c]
        assert reader._maps.count <= 4


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["get", "update", "flush", "compact", "evict"]),
                          st.lists(st.integers(0, N - 1), min_size=1, max_size=300)), min_size=1, max_size=12))
def test_reads_through_maps_match_a_tensor_model(shm_path, ops):
    """Gets, updates, flushes, compaction rounds and evictions in any order: every get returns the
    model's rows exactly, whether they come from the hot tier, a delta segment or a map."""
    path = shm_path / f"m{os.getpid()}-{np.random.default_rng().integers(1 << 40)}"
    table = compacted_store(path, N, DIM, CHUNK, seed=1)
    with EmbeddingStore.open(path, hot_bytes=HOT) as s:
        for k, (op, ids) in enumerate(ops):
            model_step(s, table, op, torch.tensor(ids), k)
        s.evict(1 << 30)
        every = torch.arange(N)
        assert torch.equal(s.get(every), table)


def test_rows_of_never_written_chunks_are_computed_beside_mapped_ones(shm_path):
    """A chunk never written has no file (generation 0): its rows are computed, never gathered
    from a map, also when the other rows of the call lie in chunks read through maps (a map
    slot read for it would be unmapped memory)."""
    written = torch.arange(2 * CHUNK)
    vals = torch.randn(len(written), DIM, generator=torch.Generator().manual_seed(3))
    with EmbeddingStore.create(shm_path / "s", N, DIM, chunk_rows=CHUNK) as s:
        s.update(written, vals)
        s.flush()
        s.compact()
        s.flush()
    model = torch.zeros(N, DIM)
    model[written] = vals
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        for _ in range(2):
            assert torch.equal(s.get(written), model[written])  # chunks 0 and 1 verified whole
            s.evict(1 << 30)
        mixed = torch.tensor([5, CHUNK + 9, 7 * CHUNK + 3, 12 * CHUNK])
        assert torch.equal(s.get(mixed), model[mixed])
        assert torch.equal(s.get(mixed[2:]), model[mixed[2:]])


def test_while_reads_wait_for_the_disk_block_checks_ask_for_their_blocks_first(shm_path, monkeypatch, numpy_gets):
    """When reads lately missed the page cache, the blocks a call checks in the maps are asked
    from the kernel first (one hint per block, or per chunk checked whole), so their reads run
    together rather than one page fault at a time; over the page cache nothing is asked. (The
    general path's rule; the C loop's: test_mapped_get.py.)"""
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    asked = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, adv: asked.append((off, n, adv)) or real(fd, off, n, adv))
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        one = torch.tensor([5 * CHUNK + 8])
        assert torch.equal(s.get(one), table[one])
        willneed = [a for a in asked if a[2] == os.POSIX_FADV_WILLNEED]
        assert willneed == []  # nothing read yet says the disk is slow
        s._versions.chunkrows.cache_counts[:] = [100, 50]  # half the reads lately waited for the disk
        ids = torch.tensor([6 * CHUNK + 8 * b for b in (0, 3)] + list(range(9 * CHUNK, 10 * CHUNK, 2)))
        assert torch.equal(s.get(ids), table[ids])
        willneed = [a for a in asked if a[2] == os.POSIX_FADV_WILLNEED]
        assert (0, 0, os.POSIX_FADV_WILLNEED) in willneed  # chunk 9, checked whole
        assert sum(1 for a in willneed if a[1] == 4096) == 2  # the two blocks of chunk 6
