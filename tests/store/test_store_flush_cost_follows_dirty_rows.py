"""flush() after k dirty rows writes O(k x row bytes), not whole chunks or the table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_embcache import EmbeddingStore

N, DIM, CHUNK = 100_000, 32, 1024  # 12.8 MB of rows
ROW_BYTES = DIM * 4
SLACK = 64 << 10


def _files(path: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("hot_rows", [None, 12_000, 600], ids=["memory-path", "disk", "disk-tiny-hot"])
def test_bytes_written_by_flush_follow_dirty_rows(shm_path, hot_rows):
    path = shm_path / "store"
    hot = None if hot_rows is None else hot_rows * (ROW_BYTES + 11)
    rng = np.random.default_rng(7)
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot) as s:
        s.get(torch.arange(0, N, 97))  # touch every chunk, so loads are not mistaken for writes
        for k in (1, 10, 100, 1_000, 10_000):
            ids = rng.choice(N, size=k, replace=False)  # spread over all ~98 chunks
            before_stats = s.stats().bytes_written
            before_files = _files(path)
            for lo in range(0, k, 512):
                batch = ids[lo : lo + 512]
                s.update(torch.from_numpy(batch), torch.randn(len(batch), DIM))
            s.flush()
            written = s.stats().bytes_written - before_stats
            after_files = _files(path)
            new_bytes = sum(size for f, size in after_files.items() if before_files.get(f) != size)
            bound = 2 * k * ROW_BYTES + SLACK
            assert written <= bound, (
                f"flush of {k} dirty rows ({k * ROW_BYTES} B) wrote {written} B by stats(); allowed 2 x dirty + 64 KiB = {bound}"
            )
            assert new_bytes <= bound, (
                f"flush of {k} dirty rows ({k * ROW_BYTES} B) created {new_bytes} B of new files; allowed {bound}"
            )
            assert written >= k * ROW_BYTES, f"stats() reports {written} B written for {k} dirty rows: too few to be durable"


def test_flush_with_nothing_dirty_writes_nothing(shm_path):
    path = shm_path / "store"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=1000 * (ROW_BYTES + 11)) as s:
        s.update([5], torch.ones(1, DIM))
        v = s.flush()
        before = s.stats().bytes_written
        s.get(torch.arange(0, 5000))
        assert s.flush() == v
        assert s.stats().bytes_written == before


def test_a_flush_finds_its_dirty_rows_without_scanning_every_slot(shm_path, monkeypatch):
    """The rows to write come from the log of rows marked dirty, not from a pass over the
    table's dirty flags: a flush of a few rows of a large memory-mode table reads no array as
    long as the table (every numpy reduction or search over one is counted)."""
    big = 2_000_000
    with EmbeddingStore.create(shm_path / "store", big, 4, chunk_rows=CHUNK) as s:
        s.update(torch.arange(0, big, 99_991), torch.ones(21, 4))
        s.flush()
        seen: list[int] = []
        for name in ("flatnonzero", "count_nonzero", "nonzero"):
            real = getattr(np, name)
            monkeypatch.setattr(np, name, lambda a, *x, _real=real, **k: (seen.append(np.size(a)), _real(a, *x, **k))[1])
        s.update(torch.tensor([3, 1_500_000, 7]), torch.full((3, 4), 2.0))
        s.flush()
        monkeypatch.undo()
        assert max(seen, default=0) < big // 8, max(seen)
    with EmbeddingStore.open(shm_path / "store") as s:
        assert torch.equal(s.get(torch.tensor([3, 1_500_000, 7, 99_991])),
                           torch.tensor([[2.0] * 4, [2.0] * 4, [2.0] * 4, [1.0] * 4]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["mark", "clean", "look", "forget"]),
                          st.lists(st.integers(0, 299), max_size=40)), max_size=40))
def test_the_dirty_log_gives_exactly_the_dirty_slots(ops):
    """Against the flags themselves (the reference): any sequence of rows marked, rows cleaned
    (written back, dropped), looks, and a store forgetting every change; a small cap makes the
    log overflow to a scan and start again."""
    from lightning_embcache.store.hot import HotTier

    hot = HotTier(300, 8, 16, 300)
    hot._log_cap = 50
    for op, slots in ops:
        s = np.asarray(slots, np.int64)
        if op == "mark":
            hot.mark_dirty(s)
        elif op == "clean":
            hot.dirty[s] = 0
        elif op == "forget":
            hot.dirty[:] = 0
            hot.forget_log()
        else:
            assert np.array_equal(hot.dirty_slots(), np.flatnonzero(hot.dirty))
    assert np.array_equal(hot.dirty_slots(), np.flatnonzero(hot.dirty))
