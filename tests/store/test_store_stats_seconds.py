"""stats() says where the store's own I/O time went: flushes, write-backs of evicted rows and
compaction, each measured around the work (checked here against wall clocks around the calls)."""

from __future__ import annotations

import time

import torch

from lightning_embcache import EmbeddingStore

N, DIM, CHUNK = 8192, 16, 256
ROW = DIM * 4


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_flush_write_back_and_compaction_seconds_follow_the_work(tmp_path):
    with EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK, hot_bytes=N * ROW // 4, init="zeros") as s:
        before = s.stats()
        assert (before.flush_seconds, before.write_back_seconds, before.compaction_seconds) == (0.0, 0.0, 0.0)
        s.update(torch.arange(N // 32), torch.ones(N // 32, DIM))  # fits the hot tier
        wall = _timed(s.flush)
        st = s.stats()
        assert 0 < st.flush_seconds <= wall
        assert st.flush_seconds >= 0.5 * wall, (st.flush_seconds, wall)  # the flush is its writing
        assert st.write_back_seconds == 0.0 and st.compaction_seconds == 0.0

        def dirty_then_evict():
            s.update(torch.arange(N // 4, N // 2), torch.ones(N // 4, DIM))  # more than the hot tier holds
            s.evict(1 << 30)  # the rest written back below it

        wall = _timed(dirty_then_evict)
        st2 = s.stats()
        assert 0 < st2.write_back_seconds <= wall
        assert st2.flush_seconds == st.flush_seconds

        s.flush()
        s._wait_bg()
        done = s.stats().compaction_seconds
        wall = _timed(s.compact)
        st3 = s.stats()
        assert st3.compactions > 0 and 0 < st3.compaction_seconds - done <= wall
