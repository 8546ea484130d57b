"""flush() after k dirty rows writes O(k x row bytes), not whole chunks or the table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

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
