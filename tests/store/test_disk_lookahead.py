"""The hot tier uses the lookahead window: announced rows stay until read, rows read for the last
time go first, nothing unflushed is ever lost; the stats report hits, stalls and disk use."""

from __future__ import annotations

import time

import numpy as np
import torch
from _store_helpers import compacted_store
from torch.utils.data import BatchSampler, RandomSampler

from lightning_embcache import EmbeddingStore, LookaheadSampler
from lightning_embcache.store import tiers

N, DIM, CHUNK = 6000, 16, 128
ROW = DIM * 4
SLOTS = 600
HOT = SLOTS * (ROW + 11)


def _populated(path):
    return compacted_store(path, N, DIM, CHUNK)


def _wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "background load did not finish"
        time.sleep(0.01)


def test_announced_rows_survive_eviction_pressure_until_read(shm_path):
    table = _populated(shm_path / "s")
    rng = np.random.default_rng(1)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        coming = torch.from_numpy(rng.choice(N, 200, replace=False))
        s.upcoming(coming)
        _wait(lambda: s.stats().prefetched_rows >= 200)
        others = torch.from_numpy(np.setdiff1d(np.arange(N), coming.numpy()))
        for k in range(4):  # 4 x 300 other rows through a 600-row hot tier
            part = others[torch.from_numpy(rng.choice(len(others), 300, replace=False))]
            assert torch.equal(s.get(part), table[part])
        before = s.stats()
        assert torch.equal(s.get(coming), table[coming])
        after = s.stats()
        assert after.hot_misses == before.hot_misses, "an announced row was evicted before it was read"
        assert after.prefetch_hits - before.prefetch_hits == 200 and after.prefetch_misses == 0
        assert after.prefetch_hit_rate == 1.0


def test_without_the_window_plain_clock_evicts_announced_rows(shm_path, monkeypatch):
    """The counterpart: the same pressure after a plain prefetch loses some of the rows (gets
    that evict, `tiers.GETS_EVICT`: by default a get evicts nothing)."""
    monkeypatch.setattr(tiers, "GETS_EVICT", True)
    table = _populated(shm_path / "s")
    rng = np.random.default_rng(1)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        coming = torch.from_numpy(rng.choice(N, 200, replace=False))
        s.prefetch(coming)
        _wait(lambda: s.stats().prefetched_rows >= 200)
        others = torch.from_numpy(np.setdiff1d(np.arange(N), coming.numpy()))
        for k in range(4):
            part = others[torch.from_numpy(rng.choice(len(others), 300, replace=False))]
            s.get(part)
        before = s.stats().hot_misses
        assert torch.equal(s.get(coming), table[coming])
        assert s.stats().hot_misses > before


def test_epochs_with_lookahead_never_lose_an_unflushed_row(shm_path):
    """get + update through a LookaheadSampler over a table 10x the hot tier, flushing now and
    then: every read matches a tensor model, and after a reopen so does the whole table."""
    model = _populated(shm_path / "s").clone()
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        for epoch in range(2):
            inner = BatchSampler(RandomSampler(range(N), generator=torch.Generator().manual_seed(epoch)), 100, False)
            for step, batch in enumerate(LookaheadSampler(inner, s, lookahead=3)):
                ids = torch.tensor(batch)
                rows = s.get(ids)
                assert torch.equal(rows, model[ids])
                model[ids] = rows * 0.5 + step
                s.update(ids, model[ids])
                if step % 17 == 16:
                    s.flush()
        st = s.stats()
        assert st.prefetch_hits > 0 and st.evicted_bytes > 0 and st.cleaned_rows + st.evicted_bytes > 0
        s.flush()
    with EmbeddingStore.open(shm_path / "s") as s:
        assert torch.equal(s.get(torch.arange(N)), model)


def test_stats_report_stalls_tier_bytes_and_disk_use(shm_path):
    table = _populated(shm_path / "s")
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT, warm_bytes=8 * CHUNK * ROW) as s:
        assert torch.equal(s.get(torch.arange(0, 500)), table[:500])  # dense: whole chunks, kept warm
        assert torch.equal(s.get(torch.arange(3000, 3500)), table[3000:3500])  # evicts the first rows
        assert torch.equal(s.get(torch.arange(0, 500)), table[:500])  # from the warm tier
        st = s.stats()
        assert st.stall_seconds > 0 and st.stall_seconds_per_get > 0
        assert st.warm_bytes_written > 0 and st.warm_bytes_read > 0
        assert st.table_bytes == N * ROW
        assert 1.0 <= st.disk_use_ratio == st.disk_bytes / st.table_bytes < 3.0


def test_the_prefetch_thread_reads_one_announced_batch_per_round_oldest_first(shm_path, monkeypatch):
    """A get that misses rows of a prefetch round waits for the whole round: rounds of one
    announced batch each, oldest first, so the first batch's get never waits for the reads of
    the whole window announced at the start of an epoch."""
    import threading

    _populated(shm_path / "s")
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        monkeypatch.setattr(s._tiers.readahead, "_reads_cached", lambda: False)  # reads wait for the disk
        rounds, gate = [], threading.Event()
        real = s._tiers.prefetch.prefetch_once

        def recorded(idx, upcoming=False):
            rounds.append(np.sort(np.asarray(idx)).tolist())
            gate.wait(10)  # the first round holds on until the whole window is announced
            return real(idx, upcoming)

        monkeypatch.setattr(s._tiers.prefetch, "prefetch_once", recorded)
        batches = [np.arange(k * 50, k * 50 + 40) for k in range(4)]
        for b in batches:
            s.upcoming(torch.from_numpy(b))
        gate.set()
        _wait(lambda: not s._tiers.readahead._hint_task)
        assert rounds == [b.tolist() for b in batches]
        assert s.stats().prefetched_rows == 160
