"""`embcache verify` checks what is on disk: it reads every row with a record (chunk files,
segments) and skips rows that only `init` computes, so a large fresh table verifies at once."""

from __future__ import annotations

import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.tools import verify_store


def _rows_read(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = EmbeddingStore.get_fields

    def spy(self, ids, names):
        seen.append(len(ids))
        return real(self, ids, names)

    monkeypatch.setattr(EmbeddingStore, "get_fields", spy)
    return seen


def test_verify_reads_the_written_rows_not_the_initial_values(tmp_path, monkeypatch):
    with EmbeddingStore.create(tmp_path / "s", 200_000, 8, init="normal", seed=0, chunk_rows=1000) as s:
        ids = torch.tensor([5, 7, 150_003, 199_999])
        s.update(ids, torch.ones(4, 8))
        s.flush()                                      # version 1: one segment of 4 rows
        s.update(torch.arange(3000, 4000), torch.zeros(1000, 8))
        s.flush()
        s.compact()             # chunks 0, 3, 150 and 199 now have files; the other 196 were never written
    seen = _rows_read(monkeypatch)
    report = verify_store(tmp_path / "s")
    assert report.ok, report.as_dict()
    # the rows of the four chunks with a file, not the 200,000 rows of the table
    assert len(report.versions) == 1 and sum(seen) == 4 * 1000, (seen, len(report.versions))


def test_damage_in_a_segment_is_still_found(tmp_path):
    with EmbeddingStore.create(tmp_path / "s", 200_000, 8, init="normal", seed=0, chunk_rows=1000) as s:
        s.update(torch.tensor([12, 150_003]), torch.ones(2, 8))
        s.flush()
    seg = next((tmp_path / "s" / "segments").iterdir())
    data = bytearray(seg.read_bytes())
    data[-5] ^= 0xFF                                   # inside the last record
    seg.write_bytes(bytes(data))
    report = verify_store(tmp_path / "s")
    assert not report.ok
    assert any(seg.name in d for v in report.versions for d in v.damaged), report.as_dict()
