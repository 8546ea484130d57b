"""Large and deferred writes start their write-back at once (``sync_file_range``), so the sync that
makes them durable later waits only for what was written since: a flush's segment block by block
before its fsync, every chunk file of a compaction round before the round's one sync. Advisory
only: a failing call changes nothing."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from fastpaths import skip_unless

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import disk, fileio

pytestmark = skip_unless(sys.platform.startswith("linux") and fileio._SYNC_FILE_RANGE is not None, "sync_file_range")

N, DIM, CHUNK = 40_000, 64, 1024  # 10 MiB of rows: a full flush streams several blocks


def _record(monkeypatch) -> list[tuple[str, int]]:
    """Events in order: ("writeback", fd) for each call, ("fsync", fd) for each fsync."""
    events: list[tuple[str, int]] = []
    real_range, real_fsync = fileio._SYNC_FILE_RANGE, os.fsync

    def writeback(fd, offset, nbytes, flags):
        events.append(("writeback", fd))
        return real_range(fd, offset, nbytes, flags)

    def fsync(fd):
        events.append(("fsync", fd))
        return real_fsync(fd)

    monkeypatch.setattr(fileio, "_SYNC_FILE_RANGE", writeback)
    monkeypatch.setattr(os, "fsync", fsync)
    return events


def test_a_large_flush_starts_its_segment_on_the_way_before_its_fsync(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBCACHE_COMPACTION_PROCESS", "never")
    rows = torch.from_numpy(np.random.default_rng(0).standard_normal((N, DIM), dtype=np.float32))
    with EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK) as s:
        s.update(torch.arange(N), rows)
        events = _record(monkeypatch)
        s.flush()
        monkeypatch.undo()
        fsynced = [fd for kind, fd in events if kind == "fsync"]
        started = [fd for kind, fd in events if kind == "writeback"]
        # the segment: the descriptor written back once per block then fsynced
        seg = max(set(started), key=started.count)
        assert started.count(seg) >= 2, events
        assert seg in fsynced and events.index(("writeback", seg)) < events.index(("fsync", seg)), events
        # small files (manifest, chunk map) are synced as before, without it
        assert len(started) <= -(-N * DIM * 4 // disk.SEGMENT_BLOCK_BYTES), events
    with EmbeddingStore.open(tmp_path / "s") as s:
        assert torch.equal(s.get(torch.arange(N)), rows)


def test_a_compaction_round_starts_each_chunk_file_before_its_sync(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBCACHE_COMPACTION_PROCESS", "never")
    rng = np.random.default_rng(1)
    rows = torch.from_numpy(rng.standard_normal((N, DIM), dtype=np.float32))
    with EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK) as s:
        s.update(torch.arange(N), rows)
        s.flush()
        s._wait_bg()  # the background pass folds the first flush
        ids = torch.arange(0, N, 4)  # a quarter of the rows, in every chunk: under the threshold
        rows[ids] += 1
        s.update(ids, rows[ids])
        s.flush()
        events = _record(monkeypatch)
        s.compact()  # every chunk file rewritten with durable=False, then made durable at once
        monkeypatch.undo()
        chunks = -(-N // CHUNK)
        assert sum(kind == "writeback" for kind, _ in events) >= chunks, events
        assert torch.equal(s.get(torch.arange(N)), rows)
    with EmbeddingStore.open(tmp_path / "s") as s:
        assert torch.equal(s.get(torch.arange(N)), rows)


def test_a_failing_writeback_call_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBCACHE_COMPACTION_PROCESS", "never")
    calls = [0]

    def failing(fd, offset, nbytes, flags):
        calls[0] += 1
        return -1  # e.g. EIO: the fsync that follows is what reports errors

    monkeypatch.setattr(fileio, "_SYNC_FILE_RANGE", failing)
    rows = torch.from_numpy(np.random.default_rng(2).standard_normal((N, DIM), dtype=np.float32))
    with EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK) as s:
        s.update(torch.arange(N), rows)
        s.flush()
        s.compact()
        assert calls[0] > 0
        assert torch.equal(s.get(torch.arange(N)), rows)
    with EmbeddingStore.open(tmp_path / "s") as s:
        assert torch.equal(s.get(torch.arange(N)), rows)
