"""A full disk during flush raises DiskFullError; the previous version stays intact and the
unflushed rows stay in the store, so a retry after space is freed makes them durable."""

from __future__ import annotations

import errno
import os
import subprocess
import types
import uuid
from pathlib import Path

import pytest
import torch
from _store_helpers import assert_snapshot_equal, snapshot

from lightning_embcache import EmbeddingStore, StoreError
from lightning_embcache.store import DiskFullError, fileio

N, DIM, CHUNK = 4096, 32, 256  # 512 KiB of rows
ROW_BYTES = DIM * 4


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB tmpfs of our own (root only); the test is skipped where mounting is not allowed."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(folder: Path) -> Path:
    """Write a filler file until the file system is full."""
    filler = folder / "filler"
    block = b"\xab" * 65536
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
        for size in (4096, 512, 64, 1):  # top off the last bytes
            try:
                while True:
                    f.write(block[:size])
            except OSError:
                pass
    return filler


def _values(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hot_rows", [None, 512], ids=["memory", "disk"])
def test_flush_on_a_really_full_tmpfs_keeps_the_previous_version(small_tmpfs, hot_rows):
    path = small_tmpfs / "store"
    hot = None if hot_rows is None else hot_rows * (ROW_BYTES + 11)
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot)
    store.update(torch.arange(0, N, 7), _values(1, len(range(0, N, 7))))
    v1 = store.flush()
    before = snapshot(store)
    filler = _fill(small_tmpfs)

    ids = torch.arange(N // 2)
    new = _values(2, len(ids))
    with pytest.raises(StoreError) as info:  # from update (a write-back) or, at the latest, flush
        store.update(ids, new)
        store.flush()
    err = info.value
    assert isinstance(err, DiskFullError) and isinstance(err, OSError), f"{type(err).__mro__}: {err}"
    assert err.errno == errno.ENOSPC and "disk full" in str(err)
    store.close()

    with EmbeddingStore.open(path, hot_bytes=hot) as s:  # reopening needs no free space
        assert s.version >= v1  # (a compaction may have republished v1's rows under a new number)
        assert_snapshot_equal(snapshot(s), before, f"version {v1} after a flush failed on a full disk")
    leftovers = [p.name for p in path.rglob("*") if ".tmp" in p.name]
    assert not leftovers, f"a failed flush left temporary files: {leftovers}"

    filler.unlink()
    with EmbeddingStore.open(path, hot_bytes=hot) as s:  # with space again the store takes writes
        s.update(ids, new)
        v2 = s.flush()
        assert v2 > v1
    with EmbeddingStore.open(path, hot_bytes=hot) as s:
        assert torch.equal(s.get(ids), new) and s.version >= v2


class _FailingWrites(types.ModuleType):
    """fileio's view of ``os`` whose write()/pwrite() fail with ENOSPC from the armed call on."""

    def __init__(self) -> None:
        super().__init__("os")
        self.fail_from: int | None = None
        self.calls = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def _arm(self) -> None:
        if self.fail_from is not None:
            self.calls += 1
            if self.calls > self.fail_from:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def write(self, fd, data):
        self._arm()
        return os.write(fd, data)

    def pwrite(self, fd, data, offset):
        self._arm()
        return os.pwrite(fd, data, offset)


@pytest.mark.parametrize("hot_rows", [None, 4096], ids=["memory", "disk"])
def test_injected_enospc_at_each_write_of_a_flush_keeps_previous_version_and_dirty_rows(shm_path, monkeypatch, hot_rows):
    fake = _FailingWrites()
    monkeypatch.setattr(fileio, "os", fake)
    hot = None if hot_rows is None else hot_rows * (ROW_BYTES + 11)
    ids = torch.arange(100, 700)
    new = _values(3, len(ids))

    def prepared(path):
        store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot)
        store.update(torch.arange(0, N, 5), _values(1, len(range(0, N, 5))))
        v1 = store.flush()
        before = snapshot(store)
        store.update(ids, new)
        return store, v1, before

    # how many write() calls does this flush make? (the segment's header and records, the manifest...)
    store, _, _ = prepared(shm_path / "count")
    fake.fail_from, fake.calls = 10**9, 0
    store.flush()
    writes = fake.calls
    store.close()
    assert writes >= 2, f"a flush made {writes} write() calls: the injection below would test nothing"

    for fail_from in range(writes):
        path = shm_path / f"store-{fail_from}"
        fake.fail_from, fake.calls = None, 0
        store, v1, before = prepared(path)
        fake.fail_from = fail_from
        with pytest.raises(DiskFullError) as info:
            store.flush()
        assert info.value.errno == errno.ENOSPC
        assert torch.equal(store.get(ids), new), f"a flush failing at write {fail_from} lost the rows it was writing"

        with EmbeddingStore.open(path, readonly=True) as r:  # the durable state is still version v1's rows
            assert_snapshot_equal(snapshot(r), before, f"version {v1} after a flush failed at write {fail_from}")

        fake.fail_from = None
        v2 = store.flush()  # retry once space is back: every update of before the failure lands
        assert v2 > v1
        store.close()
        with EmbeddingStore.open(path) as s:
            assert s.version >= v2
            want = before["weight"].clone()
            want[ids] = new
            assert torch.equal(s.get(torch.arange(N)), want)
        leftovers = [p.name for p in path.rglob("*") if ".tmp" in p.name]
        assert not leftovers, f"temporary files left behind after a flush failed at write {fail_from}: {leftovers}"
