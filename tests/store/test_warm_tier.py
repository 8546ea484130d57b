"""The warm tier keeps chunks compressed where LZ4 pays, serves recent ones without decompressing
them again, stays within its budget; with lookahead in `ChunkShuffleSampler` order each chunk is
asked from the kernel once and read from below once, and every value matches the table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _store_helpers import compacted_store
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler

from lightning_embcache import ChunkShuffleSampler, EmbeddingStore, LookaheadSampler
from lightning_embcache.store import chunkrows, warm
from lightning_embcache.store.warm import WarmTier

RAW = 4096  # bytes of one chunk's records in the unit tests


def _chunk(kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":  # trained float32 codes: LZ4 cannot shrink them
        return rng.integers(0, 256, RAW, dtype=np.uint8)
    return np.repeat(rng.integers(0, 4, RAW // 64, dtype=np.uint8), 64)  # compresses well


def test_a_compressed_chunk_is_decompressed_once_while_it_is_recent(monkeypatch):
    calls = []
    real = warm.lz4.block.decompress
    monkeypatch.setattr(warm.lz4.block, "decompress", lambda *a, **k: calls.append(1) or real(*a, **k))
    tier = WarmTier(8 * RAW)
    data = _chunk("compressible", 0)
    tier.put(5, data)
    assert tier.compression_ratio > 4  # kept compressed
    for _ in range(10):
        assert np.array_equal(tier.get(5), data)
    assert calls == []  # the copy made at put is served
    tier._raw.clear()
    tier._raw_copy_bytes = 0
    for _ in range(10):
        assert np.array_equal(tier.get(5), data)
    assert len(calls) == 1  # decompressed once, then served from the copy


def test_copies_go_first_when_the_budget_is_short():
    tier = WarmTier(3 * RAW)
    chunks = {c: _chunk("compressible", c) for c in range(10)}
    for c, data in chunks.items():
        tier.put(c, data)
        assert tier.nbytes <= tier.budget
    assert len(tier) == 10  # all ten fit compressed; only recent ones have copies
    assert tier._raw_copy_bytes <= 3 * RAW
    for c, data in chunks.items():
        assert np.array_equal(tier.get(c), data)
        assert tier.nbytes <= tier.budget


def test_incompressible_chunks_stop_the_lz4_attempts_for_a_while(monkeypatch):
    calls = []
    real = warm.lz4.block.compress
    monkeypatch.setattr(warm.lz4.block, "compress", lambda *a, **k: calls.append(1) or real(*a, **k))
    tier = WarmTier(100 * RAW)
    for c in range(warm.GIVE_UP_AFTER + warm.SKIP_PUTS + 1):
        tier.put(c, _chunk("random", c))
    assert len(calls) == warm.GIVE_UP_AFTER + 1  # tried, gave up for SKIP_PUTS puts, tried again
    assert tier.compression_ratio == 1.0


def test_a_kept_chunk_is_read_only_and_owns_exactly_its_bytes():
    tier = WarmTier(100 * RAW)
    big = np.zeros(4 * RAW, np.uint8)
    tier.put(1, big[:RAW])  # part of a larger buffer: copied, so the tier never pins the rest
    assert tier.get(1).base is None or tier.get(1).base.nbytes == RAW
    with pytest.raises(ValueError):
        tier.get(1)[0] = 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "discard", "shrink"]), st.integers(0, 6),
                          st.sampled_from(["random", "compressible"]), st.integers(0, 5)), max_size=60),
       st.integers(1, 6))
def test_the_tier_agrees_with_a_dict_and_its_budget(ops, chunks_in_budget):
    """Every chunk the tier returns holds exactly what was put last (or it is gone), and the
    bytes it holds never exceed the budget, whatever the sequence of operations."""
    tier = WarmTier(chunks_in_budget * RAW)
    model: dict[int, np.ndarray] = {}
    for op, c, kind, seed in ops:
        if op == "put":
            data = _chunk(kind, seed)
            tier.put(c, data)
            model[c] = data
        elif op == "get":
            got = tier.get(c)
            if got is not None:
                assert np.array_equal(got, model[c])
        elif op == "discard":
            tier.discard(c)
            model.pop(c, None)
            assert c not in tier
        else:
            tier.shrink(seed * RAW // 2)
            assert tier.nbytes <= seed * RAW // 2
        assert tier.nbytes <= tier.budget
        assert tier.nbytes == sum(len(d) if isinstance(d, bytes) else d.nbytes for d, _, _ in tier._items.values()) \
            + sum(a.nbytes for a in tier._raw.values())


N, DIM, CHUNK = 16_384, 16, 256
ROW = DIM * 4


@pytest.mark.parametrize("kernel_threads", [True, False], ids=["read-ahead", "page-cache"])
def test_lookahead_in_chunk_order_asks_each_chunk_once_and_reads_it_once(shm_path, monkeypatch, kernel_threads, request):
    """With a warm tier, the announced batches of a `ChunkShuffleSampler` epoch have kernel
    threads read each chunk once, whole, into the warm tier (where io_uring is there; else ask
    the kernel for each chunk once, whole), no prefetch thread runs, each chunk is read from
    below once, and every row matches the table."""
    request.getfixturevalue("read_ahead" if kernel_threads else "no_read_ahead")
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    asked = []
    real = chunkrows.os.posix_fadvise
    monkeypatch.setattr(chunkrows.os, "posix_fadvise",
                        lambda fd, off, n, adv: (asked.append((fd, off, n, adv)), real(fd, off, n, adv))[1])
    window = 4
    with EmbeddingStore.open(shm_path / "s", hot_bytes=N * (ROW + 11) // 4,
                             warm_bytes=2 * window * CHUNK * ROW) as s:
        s._tiers.readahead._uncached_share = 1.0  # reads wait for the disk (a fresh page cache on a real disk)
        s._tiers.readahead._cache_seen = (1 << 62, 0)  # ... and nothing read here makes it think otherwise
        sampler = ChunkShuffleSampler(N, chunk_rows=CHUNK, window=window, seed=3)
        batches = LookaheadSampler(BatchSampler(sampler, 128, drop_last=False), s, lookahead=4)
        seen = []
        for batch in batches:
            ids = torch.as_tensor(batch)
            assert torch.equal(s.get(ids), table[ids])
            seen.append(ids)
        assert s._tiers.prefetch.executor is None, "a prefetch thread was started"
        st_ = s.stats()
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(N))
    whole = [a for a in asked if a[3] == chunkrows._FADV_WILLNEED and a[1:3] == (0, 0)]  # whole files
    assert len(whole) == (0 if kernel_threads else N // CHUNK)  # each chunk once, whole
    assert st_.chunks_read_ahead == (N // CHUNK if kernel_threads else 0)
    assert st_.cold_reads == N // CHUNK  # each chunk read from below once; its other rows came warm
    assert st_.warm_hits > 0


def test_without_a_warm_tier_lookahead_still_loads_rows_in_the_background(shm_path):
    """The counterpart: no warm tier, rows waiting for the disk: the prefetch thread loads the
    announced rows into the hot tier (what the kernel's readahead alone would not do)."""
    compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=N * (ROW + 11) // 4) as s:
        s._tiers.readahead._uncached_share = 1.0
        s._tiers.readahead._cache_seen = (1 << 62, 0)
        s.upcoming(torch.arange(0, 200))
        s._tiers.prefetch.executor.submit(lambda: None).result(10)
        assert s.stats().prefetched_rows > 0
