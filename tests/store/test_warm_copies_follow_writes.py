"""Warm copies follow writes below the hot tier instead of being dropped, so training in
`ChunkShuffleSampler` order (get + update, flushes, write-backs) reads each chunk once an epoch."""

from __future__ import annotations

import numpy as np
import torch
from _store_helpers import assert_bitwise_equal, compacted_store
from torch.utils.data import BatchSampler

from lightning_embcache import ChunkShuffleSampler, EmbeddingStore
from lightning_embcache.store import writeback

N, DIM, CHUNK = 8192, 16, 256
ROW = DIM * 4


def test_a_flush_keeps_the_warm_copy_of_the_chunks_it_writes(shm_path):
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=512 * (ROW + 11), warm_bytes=4 * CHUNK * ROW) as s:
        chunk = torch.arange(256, 512)
        x = s.get(chunk)  # read whole, held warm
        s.update(chunk[::3], x[::3] + 1)
        s.flush()
        reads = s.stats().cold_reads
        s.set_budget(hot_bytes=1)  # every hot row leaves (clean after the flush: nothing written back)
        want = table[chunk].clone()
        want[::3] += 1
        assert_bitwise_equal(s.get(chunk), want)
        assert s.stats().cold_reads == reads  # served by the patched copy
    with EmbeddingStore.open(shm_path / "s", readonly=True) as r:
        assert_bitwise_equal(r.get(chunk), want)


def test_past_the_patch_budget_warm_copies_are_dropped_and_reads_stay_right(shm_path, monkeypatch):
    monkeypatch.setattr(writeback, "PATCH_BYTES", CHUNK * ROW)  # one chunk's copy per write
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=2048 * (ROW + 11), warm_bytes=8 * CHUNK * ROW) as s:
        ids = torch.arange(0, 4 * CHUNK)
        x = s.get(ids)  # four chunks held warm
        s.update(ids[::5], x[::5] * 2)
        s.flush()
        s.set_budget(hot_bytes=1)
        want = table[ids].clone()
        want[::5] *= 2
        assert_bitwise_equal(s.get(ids), want)
        assert s.stats().cold_reads == 4 + 3  # one chunk patched, three dropped and read again


def _train_in_chunk_order(path, flush_every: int) -> tuple[int, torch.Tensor]:
    """One epoch of get + update (+1) in ChunkShuffleSampler order with the advised warm tier."""
    window = 4
    with EmbeddingStore.open(path, hot_bytes=600 * (ROW + 11), warm_bytes=2 * window * CHUNK * ROW) as s:
        batches = BatchSampler(ChunkShuffleSampler(N, chunk_rows=CHUNK, window=window, seed=0), 64, drop_last=False)
        for i, b in enumerate(batches):
            ids = torch.from_numpy(np.asarray(b, dtype=np.int64))
            s.update(ids, s.get(ids) + 1)
            if (i + 1) % flush_every == 0:
                s.flush()
        s.flush()
        return s.stats().cold_reads, s.get(torch.arange(N))


def test_training_in_chunk_order_reads_each_chunk_about_once(shm_path):
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    reads, rows = _train_in_chunk_order(shm_path / "s", flush_every=5)
    assert_bitwise_equal(rows, table + 1)
    chunks = N // CHUNK
    # dropping the copies at every write-back and flush read the window's chunks again: 1.9x here
    assert reads <= 1.2 * chunks, (reads, chunks)
