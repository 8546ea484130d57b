"""Disk use stays bounded when background compaction makes no progress at all (the worst a
loaded host can do): 40 flushes that each rewrite 10% of the rows, spread over the table, keep
the folder within the table plus the backpressure limit (segments past ``HARD_RATIO`` of the
table are folded by the flush itself) plus one flush's own segment, at every flush and once
closed; the rows read back exactly. Without the flushes' backpressure the folder grows by a
tenth of the table per flush (5x after 40)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import compaction, versions

N, DIM, CHUNK = 16384, 32, 256  # 2 MiB table, 64 chunks
TABLE = N * DIM * 4
SMALL_FILES = 64 << 10  # META, manifests, chunk maps, headers of chunk files and segments
HARD = versions.HARD_RATIO  # the shipped backpressure limit


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def test_forty_flushes_of_a_tenth_stay_within_one_and_a_half_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(compaction.Compaction, "maybe_compact", lambda self: None)  # no background pass
    path = tmp_path / "s"
    rng = np.random.default_rng(3)
    model = torch.zeros(N, DIM)
    peak = 0
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=TABLE // 4) as store:
        for _ in range(40):
            ids = torch.from_numpy(rng.choice(N, N // 10, replace=False))
            vals = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
            store.update(ids, vals)
            model[ids] = vals
            store.flush()
            peak = max(peak, _disk_bytes(path))
        assert torch.equal(store.get(torch.arange(N)), model)
    closed = _disk_bytes(path)
    bound = (1 + 1.5 * HARD) * TABLE + SMALL_FILES  # 1.6x: segments, then one flush's
    assert peak <= bound, f"peak {peak / TABLE:.2f}x the table"
    assert closed <= bound, f"closed {closed / TABLE:.2f}x the table"
    with EmbeddingStore.open(path, readonly=True) as again:
        assert torch.equal(again.get(torch.arange(N)), model)
