"""prefetch(ids) brings rows into the hot tier in the background and never changes a value."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore

N, DIM, CHUNK = 4096, 16, 256
ROW_BYTES = DIM * 4
HOT = 600 * (ROW_BYTES + 11)


def _table(seed: int) -> torch.Tensor:
    return torch.randn(N, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def store(shm_path):
    path = shm_path / "store"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK) as s:
        s.update(torch.arange(N), _table(0))
        s.flush()
    with EmbeddingStore.open(path, hot_bytes=HOT, warm_bytes=4 * CHUNK * ROW_BYTES) as s:
        yield s


def _wait_prefetched(store, before: int, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while store.stats().prefetched_rows < before + n:
        assert time.monotonic() < deadline, f"prefetch of {n} rows did not finish: {store.stats()}"
        time.sleep(0.01)


def test_prefetched_rows_are_hot_hits(store):
    ids = torch.from_numpy(np.random.default_rng(0).choice(N, 200, replace=False))
    before = store.stats()
    t0 = time.perf_counter()
    store.prefetch(ids)
    assert time.perf_counter() - t0 < 0.5, "prefetch() blocked its caller"
    _wait_prefetched(store, before.prefetched_rows, len(ids))
    mid = store.stats()
    got = store.get(ids)
    after = store.stats()
    assert torch.equal(got, _table(0)[ids])
    assert after.hot_hits - mid.hot_hits == len(ids), f"{after.hot_hits - mid.hot_hits} of {len(ids)} were hot hits"
    assert after.hot_misses == mid.hot_misses and after.cold_reads == mid.cold_reads


def test_get_without_prefetch_misses(store):
    """The counterpart: the same read cold counts misses (so the hit test above can fail)."""
    ids = torch.from_numpy(np.random.default_rng(0).choice(N, 200, replace=False))
    before = store.stats()
    assert torch.equal(store.get(ids), _table(0)[ids])
    assert store.stats().hot_misses - before.hot_misses == len(ids)


def test_prefetch_never_changes_values(store):
    rng = np.random.default_rng(1)
    model = _table(0).clone()
    dirty = torch.from_numpy(rng.choice(N, 300, replace=False))
    model[dirty] = _table(1)[dirty]
    store.update(dirty, _table(1)[dirty])  # dirty rows, some evicted (written back) by prefetches
    for _ in range(20):
        store.prefetch(torch.from_numpy(rng.integers(0, N, 400)))
        ids = torch.from_numpy(rng.integers(0, N, 100))
        assert torch.equal(store.get(ids), model[ids])
        vals = torch.randn(len(ids), DIM)
        store.update(ids, vals)
        for i, row in enumerate(ids.tolist()):
            model[row] = vals[i]
    time.sleep(0.1)
    assert torch.equal(store.get(torch.arange(N)), model)
    v = store.flush()
    with EmbeddingStore.open(store.path, version=v, readonly=True) as r:
        assert torch.equal(r.get(torch.arange(N)), model)


def test_prefetch_in_memory_mode_is_harmless(shm_path):
    with EmbeddingStore.create(None, 100, DIM) as s:
        s.update([3], torch.ones(1, DIM))
        s.prefetch(torch.arange(100))
        assert torch.equal(s.get([3, 4]), torch.tensor([[1.0] * DIM, [0.0] * DIM]))
