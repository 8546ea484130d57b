"""The background fill of a memory-mode table, split over several threads (one stretch of chunks
each), makes every never-written row exactly as a materialized table holds it, keeps rows a step
wrote meanwhile, and ends with the table marked whole."""

from __future__ import annotations

import os
import time

import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import tiers


def test_several_fill_threads_make_the_table_a_materialized_one_holds(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(tiers, "FILL_BYTES", 64 << 10)  # many steps per thread
    n, dim = 40_000, 16
    store = EmbeddingStore.create(None, n, dim, init="normal", seed=3, chunk_rows=128)
    assert store._filler is not None and store._filler._max_workers == 6
    store.update(torch.tensor([5, 39_999]), torch.full((2, dim), 7.0))  # written while the fill runs
    deadline = time.monotonic() + 120
    while not store._hot.all_loaded and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store._hot.all_loaded and store._hot.loaded.all()
    want = EmbeddingStore.create(None, n, dim, init="normal", seed=3, chunk_rows=128, materialize=True)
    expect = want.get(torch.arange(n))
    expect[[5, 39_999]] = 7.0
    assert torch.equal(store.get(torch.arange(n)), expect)
    store.close()
    want.close()
