"""A pass of compaction rounds overwrites the chunk files the previous round replaced instead of
creating and deleting files; no read of this process ever sees a file while it is reused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _store_helpers import assert_bitwise_equal, in_forked_child

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import compaction
from lightning_embcache.store.errors import CorruptStoreError
from lightning_embcache.store.recycle import POOL_PREFIX

N, DIM, CHUNK = 2048, 8, 64  # 32 chunks of 2 KiB


@pytest.fixture
def small_rounds(monkeypatch):
    """Rounds of 4 chunks, so one compact() is a pass of 8 rounds, each writing new chunk files
    (a file folded in place is not replaced: nothing to reuse; inplace.py)."""
    monkeypatch.setattr(compaction, "ROUND_BYTES", 4 * CHUNK * DIM * 4)
    monkeypatch.setattr(compaction, "FOLD_IN_PLACE", False)


def _pooled(path) -> list[str]:
    return [n for n in os.listdir(path / "chunks") if n.startswith(POOL_PREFIX)]


def _update_all(store, table: torch.Tensor, step: int) -> None:
    """Every row gets a new value (so every chunk's next generation differs from the last)."""
    ids = torch.randperm(N, generator=torch.Generator().manual_seed(step))
    values = torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM)[ids] + 1000.0 * step
    store.update(ids, values)
    table[ids] = values


def _pass(store, table: torch.Tensor, step: int) -> None:
    """Update every row, flush, and fold it all in one pass of rounds."""
    _update_all(store, table, step)
    store.flush()
    store.compact()


def _create(path) -> EmbeddingStore:
    return EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=N * DIM * 4 // 4, init="zeros")


def test_passes_reuse_replaced_files_and_keep_rows(tmp_path, small_rounds):
    path = tmp_path / "s"
    table = torch.zeros(N, DIM)
    with _create(path) as s:
        for step in range(1, 5):
            _pass(s, table, step)
            assert not _pooled(path), "a finished pass leaves no pooled file behind"
            assert_bitwise_equal(s.get(torch.arange(N)), table, f"rows after pass {step}")
        reused = s._versions.disk.pool.reused
    # 4 passes of 8 rounds: every round after a pass's first overwrites the files of the one before
    assert reused >= 3 * 7 * 4, reused
    with EmbeddingStore.open(path) as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after reopening")
    assert not _pooled(path)


def test_a_stale_descriptor_never_reads_a_reused_file(tmp_path, small_rounds):
    """A read planned before a round replaced chunk 0 (a prefetch holds such plans) asks for the
    old generation after the file was reused for another chunk: it must fail as if the file had
    been deleted, never return the other chunk's bytes (the block was verified once already, so
    without the forgetting the cached descriptor would serve them unchecked)."""
    path = tmp_path / "s"
    table = torch.zeros(N, DIM)
    with _create(path) as s:
        _pass(s, table, 1)
        reader = s._versions.chunkrows_reader()
        old_gen = int(s._versions.cmap[0])
        at = (np.array([0]), np.array([5]), np.array([old_gen]))
        before = reader.read(*at).copy()
        assert np.array_equal(before.view(np.float32)[0], table[5].numpy())
        _pass(s, table, 2)  # chunk 0's file of old_gen is pooled and overwritten by a later round
        assert s._versions.disk.pool.reused > 0 and int(s._versions.cmap[0]) != old_gen
        with pytest.raises(CorruptStoreError, match="missing"):
            reader.read(*at)


def test_reuse_waits_for_reads_that_began_before(tmp_path, small_rounds):
    """While a read that began before a round pooled its files is in flight, nothing pooled then
    is overwritten (new files are written instead); once it ends, the next pass reuses again."""
    path = tmp_path / "s"
    table = torch.zeros(N, DIM)
    with _create(path) as s:
        _pass(s, table, 1)
        pool = s._versions.disk.pool
        reused = pool.reused
        epoch = pool.begin_read()  # a read of the layout before the pass, still running
        _pass(s, table, 2)
        assert pool.reused == reused, "a file a running read may reach was overwritten"
        pool.end_read(epoch)
        _pass(s, table, 3)
        assert pool.reused > reused
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows")


def test_background_passes_reuse_files_and_match_a_reference(tmp_path, monkeypatch):
    """Flushes that trigger background passes (the default round size): rows always equal a
    plain tensor model, and the folder holds no pooled file once the store is closed."""
    monkeypatch.setattr(compaction, "FOLD_IN_PLACE", False)  # (a file folded in place is not replaced)
    path = tmp_path / "s"
    table = torch.zeros(N, DIM)
    rng = np.random.default_rng(0)
    with _create(path) as s:
        for step in range(40):
            ids = torch.from_numpy(rng.integers(0, N, 300))
            values = torch.from_numpy(rng.standard_normal((300, DIM)).astype(np.float32))
            s.update(ids, values)
            for i, row in enumerate(ids.tolist()):
                table[row] = values[i]
            s.flush()
            got = s.get(torch.from_numpy(rng.integers(0, N, 200)))
            assert got.shape == (200, DIM)
        s._wait_bg()
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows")
        assert s.stats().compactions > 0 and s._versions.disk.pool.reused > 0
    assert not _pooled(path)
    with EmbeddingStore.open(path) as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after reopening")


def test_a_forked_child_never_deletes_the_writers_pooled_files(tmp_path):
    """A DataLoader worker forked mid-pass inherits the pool; closing its copy (as a child's
    store close does) must leave the writer's files alone."""
    from lightning_embcache.store.recycle import FilePool

    (tmp_path / "c00000000-g00000001").write_bytes(b"x" * 4096)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        pool = FilePool(fd)
        pool.limit = 1
        assert pool.put("c00000000-g00000001")
        in_forked_child(pool.close)
        assert len(_pooled_in(tmp_path)) == 1, "the child deleted the writer's pooled file"
        pool.close()
        assert not _pooled_in(tmp_path)
    finally:
        os.close(fd)


def _pooled_in(folder) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(POOL_PREFIX)]
