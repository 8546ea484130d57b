"""A get whose rows lie in chunks the warm tier holds whole is served from those copies without
taking hot slots; updates still land in the hot tier and win, and nothing below the hot tier
changes without its warm copy following (patched, or dropped). With lookahead in `ChunkShuffleSampler` order no chunk file
is opened for a few rows of a chunk that is read whole anyway."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from _store_helpers import InlineExecutor, assert_bitwise_equal, compacted_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler

from lightning_embcache import ChunkShuffleSampler, EmbeddingStore, LookaheadSampler
from lightning_embcache.store import chunkrows

N, DIM, CHUNK = 4096, 16, 256
ROW = DIM * 4


@pytest.fixture
def _inline_background(monkeypatch):
    """Background write-back and prefetch run inline, so every example replays exactly."""
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_embcache.store") and hasattr(module, "ThreadPoolExecutor"):
            monkeypatch.setattr(module, "ThreadPoolExecutor", InlineExecutor)


def _hot_rows(s: EmbeddingStore) -> int:
    return s.stats().hot_bytes // (ROW + 11)


def test_a_get_from_a_chunk_held_warm_takes_no_hot_slot(shm_path):
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=64 * (ROW + 11), warm_bytes=4 * CHUNK * ROW) as s:
        ids = torch.arange(0, 200, 5)  # 40 rows of chunk 0: it is read whole and kept warm
        assert_bitwise_equal(s.get(ids), table[ids])
        assert _hot_rows(s) == 0
        assert s.stats().cold_reads == 1
        more = torch.tensor([255, 1, 1, 7, 0])  # other rows of that chunk, repeats and any order
        assert_bitwise_equal(s.get(more), table[more])
        assert _hot_rows(s) == 0
        assert s.stats().cold_reads == 1  # served by the warm copy
        assert s.stats().warm_hits >= 1


def test_a_get_mixing_hot_rows_and_rows_held_warm_reads_each_from_its_tier(shm_path):
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=64 * (ROW + 11), warm_bytes=4 * CHUNK * ROW) as s:
        s.update(torch.tensor([3, 5]), torch.full((2, DIM), 7.0))  # hot and dirty
        ids = torch.tensor([5, 0, 3, 10, 3, 2000])  # 2000: alone in its chunk, read as a row
        want = table[ids].clone()
        want[ids == 3] = 7.0
        want[ids == 5] = 7.0
        assert_bitwise_equal(s.get(torch.arange(0, 256, 4)), torch.where(
            torch.isin(torch.arange(0, 256, 4), torch.tensor([3, 5]))[:, None], 7.0, table[torch.arange(0, 256, 4)]))
        assert_bitwise_equal(s.get(ids), want)
        assert _hot_rows(s) == 3  # the two updated rows and 2000; chunk 0's rows came from its copy


def test_an_update_of_a_row_got_from_a_warm_copy_lands_hot_and_wins(shm_path):
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=64 * (ROW + 11), warm_bytes=4 * CHUNK * ROW) as s:
        ids = torch.arange(256, 512, 2)
        x = s.get(ids)
        assert _hot_rows(s) == 0
        s.update(ids[:10], x[:10] + 1)
        assert _hot_rows(s) == 10 and s.stats().dirty_rows == 10
        want = table[ids].clone()
        want[:10] += 1
        assert_bitwise_equal(s.get(ids), want)  # the hot rows win over the warm copy
        s.flush()
    with EmbeddingStore.open(shm_path / "s", hot_bytes=64 * (ROW + 11), warm_bytes=4 * CHUNK * ROW) as s:
        assert_bitwise_equal(s.get(ids), want)


@pytest.mark.usefixtures("_inline_background")
def test_a_write_back_of_rows_of_a_warm_chunk_keeps_its_copy_exact(shm_path):
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=64 * (ROW + 11), warm_bytes=4 * CHUNK * ROW) as s:
        chunk = torch.arange(512, 768)
        assert_bitwise_equal(s.get(chunk), table[chunk])  # chunk 2 held warm
        s.update(torch.tensor([600]), torch.full((1, DIM), -3.0))
        for a in range(3072, 3072 + 4 * 32, 32):  # updates of other rows evict row 600 (written back)
            s.update(torch.arange(a, a + 32), torch.zeros(32, DIM))
        assert s.stats().evicted_bytes > 0 and s._tiers.hot.slot_of[600] == 0  # row 600 left the hot tier
        want = table[chunk].clone()
        want[600 - 512] = -3.0
        reads = s.stats().cold_reads
        assert_bitwise_equal(s.get(chunk), want)  # not the copy read before the write-back
        assert s.stats().cold_reads == reads  # the copy took the written-back row: no read


def test_a_get_larger_than_the_hot_tier_from_warm_copies_is_right(shm_path):
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=16 * (ROW + 11), warm_bytes=16 * CHUNK * ROW) as s:
        s.update(torch.tensor([9]), torch.full((1, DIM), 2.0))
        ids = torch.randperm(N, generator=torch.Generator().manual_seed(1))[:3000]
        want = table[ids].clone()
        want[ids == 9] = 2.0
        assert_bitwise_equal(s.get(ids), want)


# ---- a sequence of operations against a tensor --------------------------------------------------
SN, SCHUNK = 1024, 128  # 8 chunks; a call asking 2 or more rows of a chunk reads it whole
FIELDS = {"m": (torch.float32, 2)}


_ids = st.one_of(
    st.lists(st.integers(0, SN - 1), min_size=1, max_size=40),  # scattered
    st.tuples(st.integers(0, SN // SCHUNK - 1), st.integers(1, 60)).map(  # many rows of one chunk
        lambda cn: [cn[0] * SCHUNK + (7 * k) % SCHUNK for k in range(cn[1])]),
)
_op = st.one_of(
    st.tuples(st.just("get"), _ids),
    st.tuples(st.just("get"), _ids),
    st.tuples(st.just("get"), _ids),
    st.tuples(st.just("update"), _ids),
    st.tuples(st.just("update_m"), _ids),
    st.tuples(st.just("upcoming"), _ids),
    st.tuples(st.just("flush"), st.just(None)),
    st.tuples(st.just("evict"), st.integers(1, 40)),
    st.tuples(st.just("warm"), st.integers(0, 4)),
)


@pytest.mark.usefixtures("_inline_background")
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, max_size=30), disk_reads=st.booleans(), seed=st.integers(0, 2**16))
def test_gets_updates_flushes_and_hints_with_a_warm_tier_match_a_tensor(tmp_path_factory, ops, disk_reads, seed):
    """Whatever mix of get, update (whole rows and one field), hints, flushes, evictions and
    warm budgets: every get returns what a plain tensor holds, and after reopening the store
    holds what the last flush made durable."""
    path = tmp_path_factory.mktemp("warm") / "s"
    rng = np.random.default_rng(seed)
    with EmbeddingStore.create(path, SN, DIM, chunk_rows=SCHUNK, fields=FIELDS) as s:
        w0 = torch.from_numpy(rng.integers(-8, 8, (SN, DIM)) / 4.0).float()
        s.update(torch.arange(SN), w0)
        s.flush()
        s.compact()
        s.flush()
    model = {"weight": w0.clone(), "m": torch.zeros(SN, 2)}
    durable = {k: v.clone() for k, v in model.items()}
    row = s.row_bytes
    s = EmbeddingStore.open(path, hot_bytes=96 * (row + 11), warm_bytes=3 * SCHUNK * row)
    try:
        if disk_reads:  # as if reads waited for the disk: hints ask the kernel (`_advise`)
            s._tiers.readahead._uncached_share = 1.0
            s._tiers.readahead._cache_seen = (1 << 62, 0)
        for step, (op, arg) in enumerate(ops):
            if op in ("get", "update", "update_m", "upcoming"):
                ids = torch.tensor(arg, dtype=torch.int64)
            if op == "get":
                got = s.get_fields(ids, ("weight", "m"))
                assert_bitwise_equal(got["weight"], model["weight"][ids], f"step {step} weight")
                assert_bitwise_equal(got["m"], model["m"][ids], f"step {step} m")
            elif op == "update":
                v = torch.full((len(ids), DIM), float(step)) + torch.arange(len(ids))[:, None]
                s.update(ids, v)
                model["weight"][ids] = v  # of repeated ids the last wins, as in the store
            elif op == "update_m":
                v = torch.full((len(ids), 2), -float(step)) - torch.arange(len(ids))[:, None]
                s.update_fields(ids, {"m": v})
                model["m"][ids] = v
            elif op == "upcoming":
                s.upcoming(ids)
            elif op == "flush":
                s.flush()
                durable = {k: v.clone() for k, v in model.items()}
            elif op == "evict":
                s.evict(arg * (row + 11))
            else:
                s.set_budget(warm_bytes=arg * SCHUNK * row)
            st_ = s.stats()
            assert st_.hot_bytes <= st_.hot_budget_bytes and st_.warm_bytes <= st_.warm_budget_bytes
        every = torch.arange(SN)
        got = s.get_fields(every, ("weight", "m"))
        assert_bitwise_equal(got["weight"], model["weight"], "all rows")
        assert_bitwise_equal(got["m"], model["m"], "all m")
    finally:
        s.close()  # unflushed updates are dropped
    with EmbeddingStore.open(path, hot_bytes=96 * (row + 11), warm_bytes=3 * SCHUNK * row) as s:
        got = s.get_fields(torch.arange(SN), ("weight", "m"))
        assert_bitwise_equal(got["weight"], durable["weight"], "reopened weight")
        assert_bitwise_equal(got["m"], durable["m"], "reopened m")


# ---- ChunkShuffleSampler order with lookahead -----------------------------------------------------
@pytest.mark.parametrize("uncached_share", [1.0, 0.0])
@pytest.mark.parametrize("kernel_threads", [True, False], ids=["read-ahead", "page-cache"])
def test_chunk_order_with_lookahead_opens_no_file_for_a_few_rows_of_a_chunk(shm_path, monkeypatch, uncached_share,
                                                                          kernel_threads, request):
    """Batches of 100 straddle the sampler's windows, so a window's first batch meets each of its
    chunks with a few rows: neither the hint nor the get opens the chunk's file for them (the
    next batches read it whole); every chunk is read ahead whole by kernel threads once (where
    io_uring is there; else asked from the kernel once, whole) and read from below once; no row
    is read ahead into the hot tier, whether recent reads waited for the disk or not; every row
    matches the table."""
    request.getfixturevalue("read_ahead" if kernel_threads else "no_read_ahead")
    n, chunk, window = 16_384, 1024, 4
    table = compacted_store(shm_path / "s", n, DIM, chunk)
    opened = []
    real_open = chunkrows.ChunkRows._open
    monkeypatch.setattr(chunkrows.ChunkRows, "_open", lambda self, c, g: (opened.append(c), real_open(self, c, g))[1])
    asked = []
    real = chunkrows.os.posix_fadvise
    monkeypatch.setattr(chunkrows.os, "posix_fadvise",
                        lambda fd, off, k, adv: (asked.append((off, k, adv)), real(fd, off, k, adv))[1])
    with EmbeddingStore.open(shm_path / "s", hot_bytes=n * (ROW + 11) // 4,
                             warm_bytes=2 * window * chunk * ROW) as s:
        s._tiers.readahead._uncached_share = uncached_share  # 1.0: reads wait for the disk; 0.0: the page cache serves them
        s._tiers.readahead._cache_seen = (1 << 62, 0)
        sampler = ChunkShuffleSampler(n, chunk_rows=chunk, window=window, seed=5)
        batches = LookaheadSampler(BatchSampler(sampler, 100, drop_last=False), s, lookahead=4)
        seen = []
        for batch in batches:
            ids = torch.as_tensor(batch)
            assert_bitwise_equal(s.get(ids), table[ids])
            seen.append(ids)
        st_ = s.stats()
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(n))
    assert opened == []
    whole = [a for a in asked if a[2] == chunkrows._FADV_WILLNEED and a[:2] == (0, 0)]
    assert len(whole) == (0 if kernel_threads else n // chunk)
    assert st_.chunks_read_ahead == (n // chunk if kernel_threads else 0)
    assert len(asked) == len(whole)  # no block-by-block request
    assert st_.cold_reads == n // chunk
    assert st_.prefetched_rows == 0 and st_.hot_bytes == 0


def test_a_random_order_read_from_the_page_cache_is_still_read_ahead_with_a_warm_tier(shm_path):
    """Where reads come from the page cache and the announced rows lie a row or two per chunk
    (a uniform shuffle), a miss reads the coming batches' rows with its own into the hot tier,
    warm tier or not (asking the kernel block by block would only cost system calls)."""
    n = 16_384
    table = compacted_store(shm_path / "s", n, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=n * (ROW + 11) // 2, warm_bytes=8 * CHUNK * ROW) as s:
        s._tiers.readahead._uncached_share = 0.0  # the page cache serves the reads
        s._tiers.readahead._cache_seen = (1 << 62, 0)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(2)).tolist()
        batches = LookaheadSampler(BatchSampler(order, 64, drop_last=False), s, lookahead=4)
        for batch in batches:
            ids = torch.as_tensor(batch)
            assert_bitwise_equal(s.get(ids), table[ids])
        assert s.stats().prefetched_rows > n // 2


def test_whole_chunks_are_asked_for_beside_the_training_thread(shm_path, monkeypatch, no_read_ahead):
    """The kernel's part of asking for a whole chunk (page allocation, queueing its reads) runs on
    a helper thread, not in the `upcoming` call of the training thread; every chunk is still
    asked for once and every row matches."""
    import threading

    n, chunk, window = 8192, 1024, 4
    table = compacted_store(shm_path / "s", n, DIM, chunk)
    asked = []
    real = chunkrows.os.posix_fadvise
    monkeypatch.setattr(chunkrows.os, "posix_fadvise", lambda fd, off, k, adv: (
        asked.append((off, k, threading.current_thread().name)), real(fd, off, k, adv))[1])
    with EmbeddingStore.open(shm_path / "s", hot_bytes=n * (ROW + 11) // 4,
                             warm_bytes=2 * window * chunk * ROW) as s:
        sampler = ChunkShuffleSampler(n, chunk_rows=chunk, window=window, seed=1)
        for batch in LookaheadSampler(BatchSampler(sampler, 128, drop_last=False), s, lookahead=4):
            ids = torch.as_tensor(batch)
            assert_bitwise_equal(s.get(ids), table[ids])
    whole = [a for a in asked if a[:2] == (0, 0)]
    assert len(whole) == n // chunk
    assert all(name.startswith("embcache-advise") for _, _, name in whole), whole


def test_hints_for_chunks_already_asked_for_ask_nothing_more(shm_path, monkeypatch):
    """In chunk order the batches announced ahead of a window all name its chunks: once they were
    asked for whole, the later hints (and those wholly in warm chunks) return without asking the
    kernel anything, so the block-asking code runs about once per window, not once per hint."""
    n, chunk, window, bsz = 16_384, 512, 4, 128  # 8 windows of 16 batches
    table = compacted_store(shm_path / "s", n, DIM, chunk)
    calls = []
    real = chunkrows.ChunkRows.will_need
    monkeypatch.setattr(chunkrows.ChunkRows, "will_need", lambda self, *a: (calls.append(1), real(self, *a))[1])
    with EmbeddingStore.open(shm_path / "s", hot_bytes=n * (ROW + 11) // 4,
                             warm_bytes=2 * window * chunk * ROW) as s:
        sampler = ChunkShuffleSampler(n, chunk_rows=chunk, window=window, seed=2)
        for batch in LookaheadSampler(BatchSampler(sampler, bsz, drop_last=False), s, lookahead=6):
            ids = torch.as_tensor(batch)
            assert_bitwise_equal(s.get(ids), table[ids])
        assert s.stats().cold_reads == n // chunk
    windows = n // (chunk * window)
    assert len(calls) <= 2 * windows, f"{len(calls)} hints asked the kernel over {windows} windows"


def test_each_epoch_in_chunk_order_asks_the_kernel_for_every_chunk_again(shm_path, monkeypatch, no_read_ahead):
    """The store remembers which chunks it asked for whole only for about half a table of
    announcements: in a table far beyond the page cache the next epoch's chunks are gone from
    it, so each epoch asks for its chunks again (a table of 256 chunks was remembered whole, and
    its second epoch asked for nothing)."""
    n, chunk, window = 256 * 64, 64, 4
    table = compacted_store(shm_path / "s", n, DIM, chunk)
    whole = []
    real = chunkrows.os.posix_fadvise
    monkeypatch.setattr(chunkrows.os, "posix_fadvise",
                        lambda fd, off, k, adv: ((off, k) == (0, 0) and whole.append(fd), real(fd, off, k, adv))[1])
    with EmbeddingStore.open(shm_path / "s", hot_bytes=n * (ROW + 11) // 8,
                             warm_bytes=2 * window * chunk * ROW) as s:
        sampler = ChunkShuffleSampler(n, chunk_rows=chunk, window=window, seed=4)
        batches = LookaheadSampler(BatchSampler(sampler, 64, drop_last=False), s, lookahead=4)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for batch in batches:
                ids = torch.as_tensor(batch)
                assert_bitwise_equal(s.get(ids), table[ids])
    # every chunk once in the first epoch; in the second, all but those the end of the first
    # asked for within the last half table of announcements (likely still cached)
    assert 1.5 * (n // chunk) <= len(whole) <= 2 * (n // chunk)
