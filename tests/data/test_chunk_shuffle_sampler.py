"""ChunkShuffleSampler visits every index once per epoch, deterministically, a few chunks at a time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_embcache import ChunkShuffleSampler, InvalidArgumentError


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 300), st.integers(1, 12), st.integers(0, 5), st.integers(0, 3))
def test_every_index_exactly_once_and_a_window_of_chunks_at_a_time(n, chunk_rows, window, seed, epoch):
    s = ChunkShuffleSampler(n, chunk_rows, window=window, seed=seed)
    s.set_epoch(epoch)
    order = np.array(list(s))
    assert len(order) == len(s) == n
    assert np.array_equal(np.sort(order), np.arange(n))
    # consecutive groups of `window` chunks: the yielded chunks change group only at boundaries
    chunks = order // chunk_rows
    seen: list[set] = []
    for c in chunks.tolist():
        if not seen or (c not in seen[-1] and len(seen[-1]) == window):
            seen.append(set())
        seen[-1].add(c)
    assert all(len(g) <= window for g in seen)
    assert sum(len(g) for g in seen) == len(np.unique(chunks)), "each chunk is read in one group only"


def test_order_is_fixed_by_seed_and_epoch():
    a, b = ChunkShuffleSampler(5000, 64, 4, seed=1), ChunkShuffleSampler(5000, 64, 4, seed=1)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(ChunkShuffleSampler(5000, 64, 4, seed=2)) != list(ChunkShuffleSampler(5000, 64, 4, seed=1))


def test_store_ids_group_samples_by_their_rows_chunk():
    rng = np.random.default_rng(0)
    ids = rng.permutation(100_000)[:2000]
    s = ChunkShuffleSampler(2000, 1000, window=2, seed=0, store_ids=ids)
    order = np.array(list(s))
    assert np.array_equal(np.sort(order), np.arange(2000))
    chunks = (ids[order] // 1000).tolist()
    groups: list[set] = []
    for c in chunks:
        if not groups or (c not in groups[-1] and len(groups[-1]) == 2):
            groups.append(set())
        groups[-1].add(c)
    assert sum(len(g) for g in groups) == len(set(chunks)), "each chunk's samples come in one window"


def test_bad_arguments_are_named():
    with pytest.raises(InvalidArgumentError, match="window=0"):
        ChunkShuffleSampler(10, 4, window=0)
    with pytest.raises(InvalidArgumentError, match="chunk_rows"):
        ChunkShuffleSampler(10, 0)
    with pytest.raises(InvalidArgumentError, match="store_ids"):
        ChunkShuffleSampler(10, 4, store_ids=[1, 2])


def test_iterating_holds_one_group_of_chunks_not_an_epoch():
    """The first indices come without the epoch's whole order: 5M samples as a list of Python
    ints would hold ~180 MB, as an array 40 MB; one group of 16 chunks is 16,384 indices."""
    import tracemalloc

    sampler = ChunkShuffleSampler(5_000_000, chunk_rows=1024, window=16, seed=3)
    tracemalloc.start()
    try:
        it = iter(sampler)
        first = [next(it) for _ in range(100)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.0f} MiB held to yield the first indices"
    assert first == sampler.order()[:100].tolist()
