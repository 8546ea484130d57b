"""I/O faults and kills during compaction rounds that publish pinned versions again with the
chunk files they share: for every I/O call of a compact() (and the close after it), failing it or
killing the process right after it leaves every pinned version reading its rows bit for bit,
and the latest version reading the last flush's rows."""

from __future__ import annotations

import errno
import os
import shutil
import signal

import numpy as np
import pytest
import torch
from _fault_workload import Counter, FailAt, KillAfter

from lightning_embcache import EmbeddingStore, StoreError
from lightning_embcache.store import fileio

N, DIM, CHUNK = 512, 8, 32  # 16 chunks
ALL = torch.arange(N)


def _template(path) -> dict[int, torch.Tensor]:
    """A store whose table lives in chunk files, with two pinned versions and a latest one that
    share those files and whose segments a compact() folds; returns each version's rows."""
    rng = np.random.default_rng(5)
    rows: dict[int, torch.Tensor] = {}
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=128 * (DIM * 4 + 11)) as s:
        s.update(ALL, torch.from_numpy(rng.standard_normal((N, DIM)).astype(np.float32)))
        s.flush()
        s.compact()
        for pin in (True, True, False):
            ids = torch.from_numpy(rng.choice(N, 40, replace=False))
            s.update(ids, torch.from_numpy(rng.standard_normal((40, DIM)).astype(np.float32)))
            v = s.flush()
            rows[v] = s.get(ALL).clone()
            if pin:
                s.pin(v)
    return rows


def _compact(path, faults) -> None:
    s = EmbeddingStore.open(path, hot_bytes=128 * (DIM * 4 + 11))
    fileio.FAULTS = faults
    try:
        s.compact()
    except StoreError:
        pass
    finally:
        try:
            s.close()
        except StoreError:
            pass
        fileio.FAULTS = None


def _check(path, rows: dict[int, torch.Tensor], what: str) -> None:
    latest = max(rows)
    with EmbeddingStore.open(path) as s:
        assert torch.equal(s.get(ALL), rows[latest]), f"latest version after {what}"
        assert s.pinned() == sorted(v for v in rows if v != latest)
    for v in s.pinned():
        with EmbeddingStore.open(path, version=v, readonly=True) as r:
            assert torch.equal(r.get(ALL), rows[v]), f"pinned version {v} after {what}"


@pytest.fixture
def template(shm_path):
    path = shm_path / "template"
    rows = _template(path)
    counter = Counter()
    probe = shm_path / "probe"
    shutil.copytree(path, probe)
    _compact(probe, counter)
    with EmbeddingStore.open(probe, version=min(rows), readonly=True) as old, \
            EmbeddingStore.open(probe, readonly=True) as new:
        shares = old._versions.cmap_gen == new._versions.cmap_gen
    assert shares, "the compaction did not publish the pinned version with the new chunk files"
    return path, rows, counter.calls


def test_a_failed_io_call_during_a_sharing_compaction_loses_nothing(shm_path, template):
    path, rows, calls = template
    assert calls > 20
    fired = 0
    for i in range(calls):
        trial = shm_path / f"fail-{i}"
        shutil.copytree(path, trial)
        faults = FailAt(i, errno.EIO if i % 2 else errno.ENOSPC)
        _compact(trial, faults)
        fired += faults.fired is not None
        _check(trial, rows, f"call {i} ({faults.fired}) failed")
        shutil.rmtree(trial)
    assert fired == calls


def test_a_kill_during_a_sharing_compaction_loses_nothing(shm_path, template):
    path, rows, calls = template
    for i in range(0, calls, max(1, calls // 25)):
        trial = shm_path / f"kill-{i}"
        shutil.copytree(path, trial)
        pid = os.fork()
        if pid == 0:
            try:
                _compact(trial, KillAfter(i))
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL or os.WEXITSTATUS(status) == 0
        _check(trial, rows, f"a kill after call {i}")
        shutil.rmtree(trial)
