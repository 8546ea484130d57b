"""Rows never written come from init lazily: a 100M-row store is created without writing rows."""

from __future__ import annotations

import torch

from lightning_embcache import EmbeddingStore

DIM = 16


def test_creating_a_100m_row_store_writes_no_rows(shm_path):
    calls = []

    def init(ids: torch.Tensor) -> torch.Tensor:
        calls.append(len(ids))
        return ids.to(torch.float32)[:, None].expand(len(ids), DIM) * 1e-3

    with EmbeddingStore.create(shm_path / "big", 100_000_000, DIM, chunk_rows=4096, hot_bytes=1 << 20, init=init) as s:
        assert not calls, f"create() called init for {sum(calls)} rows"
        disk = s.stats().disk_bytes
        assert disk < (1 << 20), f"a fresh 100M-row store takes {disk} B on disk"
        ids = torch.tensor([0, 99_999_999, 50_000_123])
        assert torch.equal(s.get(ids), init(ids))
        assert sum(calls) <= 3 * 4096, f"reading 3 rows (3 chunks) initialised {sum(calls)} rows"
    with EmbeddingStore.open(shm_path / "big", readonly=True, hot_bytes=1 << 20, init=init) as s:
        assert torch.equal(s.get(torch.tensor([7])), init(torch.tensor([7])))
