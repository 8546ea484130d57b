"""Fault paths: a rejected call changes nothing; open() refuses a rolled-back or foreign store;
the store never writes or deletes outside its folder; no descriptor, lock or segment pile-up
outlives close() or many short runs."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from lightning_embcache import CorruptStoreError, EmbeddingStore, StoreError
from lightning_embcache.store import fileio
from lightning_embcache.store.errors import DiskFullError, StoreIOError
from lightning_embcache.store.prefetch import Prefetcher

N, DIM, CHUNK = 4096, 16, 64
ROW = DIM * 4


class FailWrites:
    """fileio.FAULTS: every write/open/fsync/rename fails with ``err`` while armed."""

    def __init__(self, err: int) -> None:
        self.err, self.armed = err, False

    def before(self, op, name):
        if self.armed and op in ("write", "open", "fsync", "rename", "link"):
            raise OSError(self.err, os.strerror(self.err) + " (injected)")

    def after(self, op, name):
        pass


@pytest.fixture
def faults(monkeypatch):
    f = FailWrites(errno.ENOSPC)
    monkeypatch.setattr(fileio, "FAULTS", f)
    return f


def _flushed_store(path, hot_rows=512):
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot_rows * (ROW + 11))
    s.update(torch.arange(0, N, 3), torch.full((len(range(0, N, 3)), DIM), 1.0))
    s.flush()
    # that flush's segment holds a third of the table: a background compaction follows; let it end
    # before a test arms its faults, so they hit the call under test, not that compaction
    s._wait_bg()
    return s


def _retry_flush(store):
    for _ in range(3):
        try:
            return store.flush()
        except StoreError:  # a background write-back that failed while armed is reported once
            continue
    return store.flush()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES], ids=["ENOSPC", "EACCES"])
@pytest.mark.parametrize("size", [300, 9000], ids=["evicting", "sliced"])
def test_a_rejected_update_leaves_no_row_applied(shm_path, faults, err, size):
    faults.err = err
    s = _flushed_store(shm_path / "store")
    s.update(torch.arange(1, 400), torch.full((399, DIM), 2.0))  # dirty rows fill the hot tier
    before = s.get(torch.arange(N)).clone()
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, N, size))
    faults.armed = True
    with pytest.raises(StoreIOError) as info:
        for _ in range(20):  # write-backs happen once the hot tier is full
            s.update(ids, torch.full((size, DIM), 7.0))
            before = s.get(torch.arange(N)).clone()  # an update that went through is the new "before"
            ids = torch.from_numpy(rng.integers(0, N, size))
    faults.armed = False
    assert info.value.errno == err and isinstance(info.value, OSError)
    assert isinstance(info.value, DiskFullError) == (err == errno.ENOSPC)
    after = s.get(torch.arange(N))
    changed = int((after != before).any(dim=1).sum())
    assert changed == 0, f"{changed} rows of a rejected update were applied"
    v = _retry_flush(s)
    s.close()
    with EmbeddingStore.open(shm_path / "store") as r:
        assert r.version == v
        assert torch.equal(r.get(torch.arange(N)), before), "the next flush made a rejected update durable"


@pytest.mark.parametrize("err, named", [(errno.EACCES, StoreIOError), (errno.EIO, StoreIOError),
                                        (errno.EFBIG, DiskFullError), (errno.EDQUOT, DiskFullError)],
                         ids=["EACCES", "EIO", "EFBIG", "EDQUOT"])
def test_flush_os_errors_are_named_errors_and_keep_the_rows(shm_path, faults, err, named):
    faults.err = err
    s = _flushed_store(shm_path / "store")
    s.update(torch.tensor([5, 6]), torch.full((2, DIM), 3.0))
    faults.armed = True
    with pytest.raises(named, match=errno.errorcode[err]) as info:
        s.flush()
    assert info.value.errno == err and info.value.filename
    faults.armed = False
    v = s.flush()
    s.close()
    with EmbeddingStore.open(shm_path / "store") as r:
        assert r.version == v and torch.equal(r.get(torch.tensor([5, 6])), torch.full((2, DIM), 3.0))


# ---------------------------------------------------------------------------- rollback, foreign
def test_open_refuses_a_store_whose_newest_manifest_was_deleted(shm_path):
    path = shm_path / "store"
    s = _flushed_store(path)
    v1 = s.version
    s.pin(v1)
    s.update(torch.tensor([1]), torch.full((1, DIM), 9.0))
    v2 = s.flush()
    s.close()
    (path / f"manifest-{v2:012d}").unlink()
    for kw in ({}, {"readonly": True}):
        with pytest.raises(CorruptStoreError, match=f"version {v2} was published"):
            EmbeddingStore.open(path, **kw)
    assert any((path / "segments").iterdir()), "the newer rows' segments must not be collected"
    with EmbeddingStore.open(path, version=v1, readonly=True) as r:  # explicit recovery still works
        assert r.version == v1


def test_open_refuses_another_stores_manifest_and_files(shm_path):
    a = _flushed_store(shm_path / "a")
    b = EmbeddingStore.create(shm_path / "b", N, DIM, chunk_rows=CHUNK, hot_bytes=512 * (ROW + 11))
    b.update(torch.arange(3000), torch.full((3000, DIM), 5.0))
    vb = b.flush()
    va = a.version
    a.close()
    b.close()
    # copy b's newest manifest (numbered above a's) and its segments into a
    for seg in (shm_path / "b" / "segments").iterdir():
        target = shm_path / "a" / "segments" / seg.name
        if not target.exists():
            shutil.copy(seg, target)
    newer = max(va, vb) + 1
    shutil.copy(shm_path / "b" / f"manifest-{vb:012d}", shm_path / "a" / f"manifest-{newer:012d}")
    with pytest.raises(CorruptStoreError, match="belongs to another store"):
        with EmbeddingStore.open(shm_path / "a", readonly=True) as s:
            s.get(torch.arange(N))


# ---------------------------------------------------------------------------- never outside
def _outside(shm_path):
    victim = shm_path / "outside.txt"
    victim.write_bytes(b"precious")
    return victim


def test_a_symlink_planted_at_a_temporary_name_is_never_written_through(shm_path):
    path = shm_path / "store"
    victim = _outside(shm_path)
    s = _flushed_store(path)
    tid = threading.get_ident()
    v = s.version + 1
    seq = s._versions.next_seq
    planted = [path / f".manifest-{v:012d}.tmp{os.getpid()}-{tid}", path / f".PINS.tmp{os.getpid()}-{tid}"]
    planted += [path / "segments" / f".s{q:012d}.tmp{os.getpid()}-{tid}" for q in range(seq, seq + 4)]
    planted += [p.with_name(p.name.rsplit("-", 1)[0]) for p in planted]  # the names before thread ids
    for p in planted:
        os.symlink(victim, p)
    s.update(torch.tensor([1, 2]), torch.full((2, DIM), 4.0))
    s.flush()
    s.pin(s.version)
    s.close()
    assert victim.read_bytes() == b"precious"
    with EmbeddingStore.open(path) as r:
        assert torch.equal(r.get(torch.tensor([1, 2])), torch.full((2, DIM), 4.0))


def test_a_symlinked_segments_folder_is_refused_and_its_target_untouched(shm_path):
    path = shm_path / "store"
    s = _flushed_store(path)
    s.close()
    elsewhere = shm_path / "elsewhere"
    shutil.move(path / "segments", elsewhere)
    (elsewhere / "s000000000999").write_bytes(b"not garbage of the store")  # GC would delete this
    os.symlink(elsewhere, path / "segments")
    before = sorted(p.name for p in elsewhere.iterdir())
    for kw in ({}, {"readonly": True}):
        with pytest.raises(CorruptStoreError, match="symlink"):
            EmbeddingStore.open(path, **kw)
    assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_checkpoint_registry_never_writes_through_a_symlink(shm_path):
    from lightning_embcache.lightning.checkpoint_pins import CheckpointPins, registry_path

    victim = _outside(shm_path)
    store_path = shm_path / "store"
    reg = registry_path(store_path)
    os.symlink(victim, reg.with_name(f".{reg.name}.tmp{os.getpid()}-{threading.get_ident()}"))
    os.symlink(victim, reg.with_name(reg.name + ".tmp"))  # the old fixed temporary name
    pins = CheckpointPins(store_path)
    pins.versions[3] = ["/ckpt/a.ckpt"]
    pins.save()
    assert victim.read_bytes() == b"precious"
    assert CheckpointPins(store_path).versions == {3: ["/ckpt/a.ckpt"]}


# ---------------------------------------------------------------------------- leaks
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("hot_rows", [None, 512], ids=["memory", "disk"])
def test_open_close_cycles_leak_no_descriptor(shm_path, hot_rows):
    path = shm_path / "store"
    hot = None if hot_rows is None else hot_rows * (ROW + 11)
    EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot).close()
    gc.collect()
    start = _fds()
    for i in range(20):
        with EmbeddingStore.open(path, hot_bytes=hot) as s:
            s.update(torch.tensor([i]), torch.ones(1, DIM))
            s.get(torch.arange(0, N, 7))
            s.flush()
        with EmbeddingStore.open(path, readonly=True, hot_bytes=hot) as r:
            r.get(torch.arange(0, N, 5))
    gc.collect()
    assert _fds() == start, f"{_fds() - start} descriptors leaked over 20 open/close cycles"


def test_a_failed_create_leaves_nothing_and_a_correct_create_works(shm_path):
    path = shm_path / "store"
    start = _fds()
    for _ in range(5):
        with pytest.raises(StoreError):
            EmbeddingStore.create(path, 2**47, 4096)  # memory mode: the pool cannot be mapped
    assert _fds() == start
    assert not path.exists()
    with EmbeddingStore.create(path, N, DIM) as s:
        s.update(torch.tensor([0]), torch.ones(1, DIM))
        s.flush()


@pytest.mark.parametrize("cycles", [120, pytest.param(300, marks=pytest.mark.slow)])
def test_many_short_runs_keep_segments_compacted(shm_path, cycles, monkeypatch):
    from lightning_embcache.store.versions import COMPACT_SEGMENTS

    # Each run closes right after its flush: a compaction process forced on for this small
    # table would be closed before it is up, and the rounds it was started for never run.
    monkeypatch.setenv("EMBCACHE_COMPACTION_PROCESS", "auto")

    path = shm_path / "store"
    EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK).close()
    rng = np.random.default_rng(0)
    model = torch.zeros(N, DIM)
    for i in range(cycles):
        with EmbeddingStore.open(path) as s:
            ids = torch.from_numpy(rng.choice(N, 8, replace=False))
            s.update(ids, torch.full((8, DIM), float(i)))
            model[ids] = float(i)
            s.flush()
    segs = len(list((path / "segments").iterdir()))
    print(f"\nLEAKS segments after {cycles} short runs: {segs}")
    assert segs <= COMPACT_SEGMENTS + 2, f"{segs} segments after {cycles} short runs"
    with EmbeddingStore.open(path) as s:
        assert torch.equal(s.get(torch.arange(N)), model)


def test_dropping_the_last_reference_with_a_prefetch_in_flight_releases_the_lock(shm_path, monkeypatch):
    path = shm_path / "store"
    s = _flushed_store(path)
    real = Prefetcher.prefetch

    def slow(self, idx):
        time.sleep(0.3)
        return real(self, idx)

    monkeypatch.setattr(Prefetcher, "prefetch", slow)
    s.prefetch(torch.arange(N))
    del s
    gc.collect()
    deadline = time.monotonic() + 10
    while True:
        try:
            with EmbeddingStore.open(path):
                break
        except StoreError:
            assert time.monotonic() < deadline, "the writer lock was never released"
            time.sleep(0.05)


@pytest.mark.parametrize("rows, loops, bound", [(24576, 60, 1.5), pytest.param(98304, 120, 1.5, marks=pytest.mark.slow)],
                         ids=["3MiB", "12MiB"])
def test_a_flush_loop_keeps_disk_use_near_the_documented_bound(shm_path, rows, loops, bound):
    """docs/store-format.md: ~table x (1 + 0.3) plus the newest flush's segment and one round of
    chunks, whatever the flush rate (flushes over the threshold fold rounds first): 1.36-1.38x
    measured here. Whole-table compactions reached 2.36-3.9x."""
    dim = 32
    table = rows * dim * 4
    s = EmbeddingStore.create(shm_path / "store", rows, dim, chunk_rows=1024, hot_bytes=table // 3)
    rng = np.random.default_rng(0)
    peak = 0
    for _ in range(loops):
        ids = torch.from_numpy(rng.choice(rows, rows // 24, replace=False))
        s.update(ids, torch.randn(len(ids), dim))
        s.flush()
        peak = max(peak, s.stats().disk_bytes)
    s.close()
    print(f"\nLEAKS flush loop over a {table >> 20} MiB table: peak disk use {peak / table:.2f}x the table")
    assert peak <= bound * table, f"disk use reached {peak / table:.2f}x the table"


def test_a_failed_compaction_keeps_the_version_and_a_retry_publishes_its_layout(shm_path, faults):
    """compact() publishes each round itself (the version's manifest names the new layout): a
    round that fails (full disk) leaves the version's rows and layout as they were, a retry
    folds every segment, and reopening finds no segment left, the same version and rows."""
    path = shm_path / "store"
    s = _flushed_store(path)
    s.update(torch.tensor([7]), torch.full((1, DIM), 5.0))
    v = s.flush()
    want = s.get(torch.arange(N))
    ident = s.manifest_checksum(v)
    faults.armed = True
    with pytest.raises(StoreIOError):
        s.compact()
    faults.armed = False
    with EmbeddingStore.open(path, readonly=True) as r:
        assert r.version == v and r.stats().segments >= 1
        assert torch.equal(r.get(torch.arange(N)), want)
    s.compact()
    assert s.version == v and s.flush() == v  # same rows: the version number does not move
    assert s.manifest_checksum(v) == ident  # a checkpoint that recorded v still recognises it
    s.close()
    with EmbeddingStore.open(path) as r:
        assert r.version == v and r.stats().segments == 0
        assert torch.equal(r.get(torch.arange(N)), want)


def test_versions_after_close_lists_the_store_not_the_working_directory(shm_path, monkeypatch):
    s = _flushed_store(shm_path / "store")
    v = s.version
    s.close()
    monkeypatch.chdir(shm_path)
    (shm_path / "manifest-000000000099").write_bytes(b"")  # a look-alike in the working directory
    assert s.versions() == [v]
