"""Fail-stop: a store that met a damaged file stops its background work on that folder and says
so in stats(); a handle dropped without close() (after raising, or not) is released by the
garbage collector: no thread, descriptor or writer lock left, and nothing written afterwards."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from lightning_embcache import CorruptStoreError, EmbeddingStore
from lightning_embcache.store import fileio

N, DIM, CHUNK = 4096, 8, 64
HOT = 64 * (DIM * 4 + 11)


class Recorder:
    """fileio.FAULTS: every write-side operation on store files, after a given moment."""

    def __init__(self) -> None:
        self.armed = False
        self.ops: list[tuple[str, str]] = []

    def before(self, op, name) -> None:
        if self.armed:
            self.ops.append((op, str(name)))

    def after(self, op, name) -> None:
        pass


def _store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("embcache")}


def _threads_gone(before: set[threading.Thread]) -> bool:
    """After gc.collect(): a job running at that moment ends at its next round, then its thread
    goes (bounded wait on the event, not a timing)."""
    for _ in range(200):
        gc.collect()
        if _store_threads() <= before:
            return True
        time.sleep(0.05)
    return False


def _damaged_store(path):
    """A store whose base chunks exist, with delta segments waiting for compaction, and chunk 0 damaged."""
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=HOT) as s:
        s.update(torch.arange(N), torch.randn(N, DIM))
        s.flush()
        s.compact()
        s.flush()
    target = sorted((path / "chunks").glob("c00000000-*"))[-1]
    data = bytearray(target.read_bytes())
    data[-5] ^= 0xFF
    target.write_bytes(bytes(data))


def test_a_store_that_met_damage_stops_its_background_work_and_is_released_when_dropped(tmp_path, monkeypatch):
    path = tmp_path / "s"
    _damaged_store(path)
    rec = Recorder()
    monkeypatch.setattr(fileio, "FAULTS", rec)
    before = _store_threads()
    s = EmbeddingStore.open(path, hot_bytes=HOT)
    for k in range(30):  # segments over many chunks: background compaction has work to do
        ids = torch.arange(k % 2 + 64, N, 37)
        s.update(ids, torch.full((len(ids), DIM), float(k)))
        s.flush()
    with pytest.raises(CorruptStoreError):
        s.get(torch.arange(CHUNK))  # chunk 0: damaged
    st = s.stats()
    assert st.damaged == 1
    rec.armed = True  # from the moment the damage was seen
    del s
    assert _threads_gone(before), [t.name for t in _store_threads() - before]
    writes = [op for op in rec.ops if op[0] in ("write", "rename", "create", "unlink", "fsync")]
    assert not writes, writes[:5]
    with EmbeddingStore.open(path, hot_bytes=HOT):  # the writer lock was released
        pass


def test_a_dropped_healthy_handle_is_released_by_the_garbage_collector(tmp_path):
    before = _store_threads()
    for i in range(5):
        s = EmbeddingStore.create(tmp_path / f"s{i}", N, DIM, chunk_rows=CHUNK, hot_bytes=HOT)
        s.update(torch.arange(N), torch.randn(N, DIM))
        s.flush()
        s.prefetch(torch.arange(100))
        del s
    assert _threads_gone(before), [t.name for t in _store_threads() - before]
    for i in range(5):
        with EmbeddingStore.open(tmp_path / f"s{i}"):
            pass


class _DamageAtFirstUnlink(Recorder):
    """Damage met by another thread at the moment the collection deletes its first file."""

    def __init__(self, versions) -> None:
        super().__init__()
        self.versions = versions

    def before(self, op, name) -> None:
        if self.armed and op == "unlink":
            self.ops.append((op, str(name)))
            if self.versions.damage is None:
                self.versions.damage = CorruptStoreError(str(name), "damaged (the test's)")


def test_damage_met_during_a_collection_stops_it_at_the_next_file(tmp_path, monkeypatch):
    s = EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK, hot_bytes=HOT)
    for k in range(12):  # twelve segments over many chunks: garbage once folded
        ids = torch.arange(k % 3, N, 11)
        s.update(ids, torch.full((len(ids), DIM), float(k)))
        s.flush()
    garbage = s._versions.garbage
    rec = _DamageAtFirstUnlink(s._versions)
    monkeypatch.setattr(fileio, "FAULTS", rec)
    with monkeypatch.context() as m:  # the pass folds and leaves its garbage; this test collects it
        m.setattr(garbage, "collect_replaced", lambda *a, **k: False)
        m.setattr(garbage, "collect_locked", lambda *a, **k: None)
        s.compact()
    before = set((tmp_path / "s" / "segments").iterdir())
    assert len(before) >= 3  # files to delete
    rec.armed = True
    garbage.collect_locked(s._versions.disk, at_open=False)
    assert len(rec.ops) == 1, rec.ops  # the file being deleted when the damage was met, and no other
    assert len(before - set((tmp_path / "s" / "segments").iterdir())) <= 1
    s._versions.damage = None
    s.close()
