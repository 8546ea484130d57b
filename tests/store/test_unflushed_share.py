"""`unflushed_share`: the rows written to disk since the last flush (evicted dirty rows), as a
share of the table, against the segment files on disk that no version lists yet."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from lightning_embcache import EmbeddingStore

N, DIM, BATCH = 4000, 16, 200
TABLE = N * DIM * 4


def _newest_listed(root: Path) -> int:
    """The newest segment any manifest names (segments are numbered in the order written)."""
    newest = 0
    for m in root.glob("manifest-*"):
        raw = m.read_bytes()
        newest = max([newest, *json.loads(raw[raw.index(b"{\"version\""):].decode())["segments"]])
    return newest


def _written_after(root: Path, seq: int) -> int:
    """Bytes of the segment files written after segment ``seq`` (not those still being written)."""
    return sum(p.stat().st_size for p in (root / "segments").iterdir()
               if re.fullmatch(r"s\d{12}", p.name) and int(p.name[1:]) > seq)


def test_share_follows_the_rows_written_back_since_the_last_flush(tmp_path):
    root = tmp_path / "s"
    with EmbeddingStore.create(root, N, DIM, hot_bytes=TABLE // 4) as s:
        assert s.unflushed_share == 0.0
        s.update(torch.arange(N), torch.randn(N, DIM))  # in batches below: evictions write back
        s.flush()
        assert s.unflushed_share == 0.0
        flushed = _newest_listed(root)
        seen = []
        for a in range(0, N, BATCH):
            ids = torch.arange(a, a + BATCH)
            s.update(ids, s.get(ids) + 1)
            seen.append(s.unflushed_share)
            if a % (5 * BATCH) == 0:
                # the files, once the background write-back is done (a directory listed while
                # it renames files into place may miss one)
                s._wait_bg()  # (private)
                assert abs(s.unflushed_share * TABLE - _written_after(root, flushed)) < 1, a
        s._wait_bg()
        assert abs(s.unflushed_share * TABLE - _written_after(root, flushed)) < 1
        assert seen == sorted(seen)  # grows as evicted dirty rows are written back
        # most of the table (the hot tier keeps a quarter), with each row's id and the index
        assert 0.4 < seen[-1] < 1.3
        s.flush()
        assert s.unflushed_share == 0.0 and _newest_listed(root) > flushed


def test_a_memory_store_writes_nothing_between_flushes(tmp_path):
    with EmbeddingStore.create(tmp_path / "m", N, DIM) as s:
        s.update(torch.arange(N), torch.randn(N, DIM))
        assert s.unflushed_share == 0.0
