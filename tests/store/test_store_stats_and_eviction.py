"""stats() reports what the store did (checked against known workloads); evict() and
set_budget() free memory without losing a row."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore, StoreStats

N, DIM, CHUNK = 2048, 16, 128
ROW_BYTES = DIM * 4
SLOT = ROW_BYTES + 11

CONTRACT_FIELDS = {
    "hot_bytes", "warm_bytes", "hot_budget_bytes", "warm_budget_bytes", "disk_bytes", "hot_hits", "hot_misses",
    "warm_hits", "warm_misses", "cold_reads", "dirty_rows", "bytes_read", "bytes_written", "flushes",
    "compression_ratio", "io_wait_seconds", "version", "prefetched_rows", "evicted_bytes",
}


def test_stats_is_a_dataclass_with_the_contract_fields():
    names = {f.name for f in dataclasses.fields(StoreStats)}
    assert CONTRACT_FIELDS <= names, f"missing: {sorted(CONTRACT_FIELDS - names)}"


def test_counters_follow_a_known_workload(shm_path):
    with EmbeddingStore.create(shm_path / "s", N, DIM, chunk_rows=CHUNK, hot_bytes=100 * SLOT) as s:
        s0 = s.stats()
        assert 0.9 * 100 * SLOT <= s0.hot_budget_bytes <= 100 * SLOT and s0.dirty_rows == 0 and s0.flushes == 0 and s0.version == 0
        s.update([1, 2, 3, 3], torch.ones(4, DIM))
        s1 = s.stats()
        assert s1.dirty_rows == 3, f"3 distinct rows written, stats say {s1.dirty_rows} dirty"
        s.get([1, 2, 3])
        s2 = s.stats()
        assert s2.hot_hits - s1.hot_hits == 3 and s2.hot_misses == s1.hot_misses
        s.get([500, 501])
        s3 = s.stats()
        assert s3.hot_misses - s2.hot_misses == 2
        v = s.flush()
        s4 = s.stats()
        assert s4.flushes == 1 and s4.dirty_rows == 0 and s4.version == v
        assert s4.bytes_written - s3.bytes_written >= 3 * ROW_BYTES
        assert s4.disk_bytes > 0 and s4.io_wait_seconds >= s3.io_wait_seconds > 0
        assert s4.hot_bytes <= s4.hot_budget_bytes


def test_lz4_warm_tier_reports_compression_and_hits(shm_path):
    path = shm_path / "s"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, compression="lz4") as s:
        # repetitive rows compress well
        s.update(torch.arange(N), (torch.arange(N) % 4).float()[:, None].expand(N, DIM).contiguous())
        s.flush()
    with EmbeddingStore.open(path, hot_bytes=2 * CHUNK * SLOT, warm_bytes=8 * CHUNK * ROW_BYTES) as s:
        for c in range(4):  # load 4 chunks: they pass through the warm tier
            s.get(torch.arange(c * CHUNK, (c + 1) * CHUNK))
        st = s.stats()
        assert 0 < st.warm_bytes <= st.warm_budget_bytes
        assert st.compression_ratio > 1.05, f"compressible chunks, ratio {st.compression_ratio}"
        # the hot tier holds two chunks, so chunk 0 has left it for the warm tier: no disk read now
        before = s.stats()
        got = s.get(torch.arange(0, CHUNK))
        after = s.stats()
        assert torch.equal(got, (torch.arange(CHUNK) % 4).float()[:, None].expand(CHUNK, DIM))
        assert after.warm_hits > before.warm_hits and after.cold_reads == before.cold_reads


@pytest.mark.parametrize("hot_rows", [None, 300], ids=["memory-path", "disk"])
def test_evict_writes_dirty_rows_back_and_frees_memory(shm_path, hot_rows):
    path = shm_path / "s"
    rng = np.random.default_rng(0)
    hot = None if hot_rows is None else hot_rows * SLOT
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot) as s:
        ids = torch.from_numpy(rng.choice(N, 250, replace=False))
        vals = torch.randn(250, DIM)
        for lo in range(0, 250, 50):  # small batches go through the hot tier
            s.update(ids[lo : lo + 50], vals[lo : lo + 50])
        held = s.stats().hot_bytes
        assert held > 0
        freed = s.evict(10**9)
        st = s.stats()
        assert freed >= held - st.hot_bytes > 0 and st.hot_bytes < held
        assert st.dirty_rows == 0, "evicted dirty rows must have been written back"
        assert torch.equal(s.get(ids), vals)  # nothing lost
        v = s.flush()  # and the written-back rows are part of the next version
    with EmbeddingStore.open(path, version=v, readonly=True) as r:
        assert torch.equal(r.get(ids), vals)


def test_set_budget_lowers_the_hot_tier_at_once(shm_path):
    with EmbeddingStore.create(shm_path / "s", N, DIM, chunk_rows=CHUNK, hot_bytes=400 * SLOT) as s:
        vals = torch.randn(400, DIM)
        for lo in range(0, 400, 50):
            s.update(torch.arange(lo, lo + 50), vals[lo : lo + 50])
        assert s.stats().hot_bytes > 100 * SLOT
        s.set_budget(hot_bytes=50 * SLOT, warm_bytes=0)
        st = s.stats()
        assert st.hot_bytes <= 50 * SLOT and st.hot_budget_bytes <= 50 * SLOT
        assert torch.equal(s.get(torch.arange(400)), vals)
        assert s.stats().hot_bytes <= 50 * SLOT
        s.set_budget(hot_bytes=400 * SLOT)  # raising again lets it fill up
        for lo in range(0, 300, 50):
            s.get(torch.arange(lo, lo + 50))
        assert s.stats().hot_bytes > 50 * SLOT


def test_io_wait_is_counted_per_thread(shm_path):
    """A flush in another thread (DeferredSync's) adds to io_wait_seconds but not to the calling
    thread's thread_io_wait_seconds: the profiler's store_io is what the training thread waited."""
    import threading

    from lightning_embcache.profiling.stores import StoreReadings

    with EmbeddingStore.create(shm_path / "s", N, DIM, chunk_rows=CHUNK) as s:
        s.get(torch.arange(10))
        mine = s.thread_io_wait_seconds()
        assert mine > 0 and mine == s.io_wait_seconds
        s.update(torch.arange(N), torch.randn(N, DIM))
        mine = s.thread_io_wait_seconds()
        other = {}

        def flush() -> None:
            s.flush()
            other["ident"] = threading.get_ident()
            other["seconds"] = s.thread_io_wait_seconds()

        t = threading.Thread(target=flush)
        t.start()
        t.join()
        assert other["seconds"] > 0
        assert s.thread_io_wait_seconds() == mine  # this thread made no call meanwhile
        assert s.thread_io_wait_seconds(other["ident"]) == other["seconds"]
        assert s.io_wait_seconds == pytest.approx(mine + other["seconds"])
        # the profiler reads the calling thread's figure from whatever has one
        assert StoreReadings({"s": s}).io_wait_seconds() == mine


def test_warm_tier_serves_chunks_read_only_and_unchanged():
    """A warm hit is served without copying the chunk (a read-only view of what the tier
    holds): nothing a caller does with it can change the tier's copy, and repeated hits give
    the same rows, raw or LZ4-compressed."""
    from lightning_embcache.store.warm import WarmTier

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (64, 32), dtype=np.uint8)  # incompressible: kept raw
    packed = np.zeros((64, 32), np.uint8)  # compresses: kept LZ4
    tier = WarmTier(1 << 20)
    tier.put(0, raw)
    tier.put(1, packed)
    for chunk, expect in ((0, raw), (1, packed)):
        got = tier.get(chunk)
        assert np.array_equal(got.reshape(64, 32), expect)
        with pytest.raises(ValueError):
            got[0] = 1
        assert np.array_equal(tier.get(chunk).reshape(64, 32), expect)
