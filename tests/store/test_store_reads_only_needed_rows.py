"""Disk-mode misses of a few rows read those rows' 4 KiB blocks, not whole chunks."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache import CorruptStoreError, EmbeddingStore

N, DIM, CHUNK = 8192, 32, 1024  # 128-byte rows, 128 KiB chunks


def _written_store(path, hot_rows=64):
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot_rows * (DIM * 4 + 11))
    model = torch.randn(N, DIM)
    for a in range(0, N, 2048):
        s.update(torch.arange(a, a + 2048), model[a : a + 2048])
    s.flush()
    s.compact()  # base chunk files now hold every row
    # a later delta on top of the base: the sparse path must apply it
    late = torch.arange(5, N, 97)
    model[late] = torch.randn(len(late), DIM)
    s.update(late, model[late])
    s.flush()
    return s, model


def test_random_misses_read_a_block_per_row_and_match_the_model(tmp_path):
    s, model = _written_store(tmp_path / "s")
    s.evict(1 << 30)
    before = s.stats().bytes_read
    ids = torch.tensor([3, 5, 1500, 4000, 4001, 8191, 102])  # includes rows with later deltas
    assert torch.equal(s.get(ids), model[ids])
    read = s.stats().bytes_read - before
    assert read < 7 * (4096 + 1024), f"{read} bytes read for 7 rows: whole chunks were read"
    assert torch.equal(s.get(torch.arange(N)), model)
    s.close()


def test_a_corrupt_block_is_reported_on_the_sparse_read(tmp_path):
    s, _ = _written_store(tmp_path / "s")
    s.close()
    chunk_files = sorted((tmp_path / "s" / "chunks").glob("c00000002-*"))
    assert chunk_files, "compaction should have written chunk 2"
    f = chunk_files[-1]
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF  # inside the last block of chunk 2
    f.write_bytes(bytes(data))
    s = EmbeddingStore.open(tmp_path / "s", hot_bytes=64 * (DIM * 4 + 11))
    with pytest.raises(CorruptStoreError) as info:
        s.get(torch.tensor([3 * CHUNK - 1]))  # last row of chunk 2
    assert f.name in str(info.value)
    s.close()


def test_bytes_read_counts_rows_served_from_delta_segments(tmp_path):
    """stats().bytes_read includes what misses read from delta segments, not only chunk files
    (the demo once reported 'read 0.0 MiB' after 400k cold reads, all from segments)."""
    path = tmp_path / "s"
    rows = torch.randn(N // 8, DIM)  # 12.5% of the table: below the compaction threshold
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK) as s:
        s.update(torch.arange(N // 8), rows)
        s.flush()
        assert s.stats().segments == 1
    with EmbeddingStore.open(path, hot_bytes=64 * (DIM * 4 + 11)) as s:
        before = s.stats().bytes_read
        ids = torch.arange(0, N // 8, 37)
        assert torch.equal(s.get(ids), rows[ids])
        read = s.stats().bytes_read - before
        assert read >= len(ids) * DIM * 4, f"{read} bytes read for {len(ids)} rows of {DIM * 4} bytes from a segment"
