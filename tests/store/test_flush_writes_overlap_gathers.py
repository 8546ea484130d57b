"""A flush's segment is streamed in blocks: each block of 1 MiB or more is written by a helper
thread while the next block's rows are gathered (the gather keeps the GIL, the write lets go of
it). The rows and crash safety are those of a plain write, and a failing write of any block
surfaces in the flush as the named error, leaving nothing behind."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
import torch

from lightning_embcache import DiskFullError, EmbeddingStore
from lightning_embcache.store import fileio

N, DIM, CHUNK = 40_000, 64, 1024  # 10 MiB of rows: a full flush streams its segment in several blocks


class _Writes:
    """Records the thread of every write; fails the ``fail_at``-th write of a segment."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.threads: list[int] = []
        self.fail_at = fail_at
        self.segment_writes = 0

    def before(self, op: str, name) -> None:
        if op != "write" or "segments" not in str(name):
            return
        self.threads.append(threading.get_ident())
        self.segment_writes += 1
        if self.fail_at is not None and self.segment_writes == self.fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def after(self, op: str, name) -> None:
        pass


def _fill(store: EmbeddingStore, seed: int) -> torch.Tensor:
    vals = torch.from_numpy(np.random.default_rng(seed).standard_normal((N, DIM)).astype(np.float32))
    store.update(torch.arange(N), vals)
    return vals


def test_a_large_flush_writes_its_blocks_beside_the_gather_and_reads_back_the_same(tmp_path, monkeypatch):
    writes = _Writes()
    monkeypatch.setattr(fileio, "FAULTS", writes)
    with EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK, hot_bytes=2 * N * DIM * 4, init="zeros") as s:
        vals = _fill(s, 0)
        s.flush()
    monkeypatch.setattr(fileio, "FAULTS", None)
    me = threading.get_ident()
    assert len(writes.threads) >= 3, "expected the flush's segment to be streamed in blocks"
    assert any(t != me for t in writes.threads), "every block was written by the flushing thread"
    with EmbeddingStore.open(tmp_path / "s") as s:
        assert torch.equal(s.get(torch.arange(N)), vals)


def _blocks(n: int, size: int):
    for i in range(n):
        yield np.full(size, i, np.uint8)


def test_a_stream_of_blocks_is_written_in_order_beside_its_making(tmp_path, monkeypatch):
    writes = _Writes()
    monkeypatch.setattr(fileio, "FAULTS", writes)
    path = tmp_path / "segments" / "f"
    path.parent.mkdir()
    n = fileio.write_parts(path, _blocks(5, 3 << 20))
    assert n == 5 * (3 << 20)
    data = np.fromfile(path, np.uint8)
    assert np.array_equal(data, np.repeat(np.arange(5, dtype=np.uint8), 3 << 20))
    assert any(t != threading.get_ident() for t in writes.threads)


@pytest.mark.parametrize("fail_at", [1, 2, 3, 5])
def test_a_failing_block_write_raises_the_named_error_and_leaves_no_file(tmp_path, monkeypatch, fail_at):
    monkeypatch.setattr(fileio, "FAULTS", _Writes(fail_at))
    d = tmp_path / "segments"
    d.mkdir()
    with pytest.raises(DiskFullError):
        fileio.write_parts(d / "f", _blocks(5, 2 << 20))
    assert os.listdir(d) == [], "a failed write left a file behind"
    assert not [t for t in threading.enumerate() if t.name.startswith("embcache-write")], "a writer thread outlived the call"
