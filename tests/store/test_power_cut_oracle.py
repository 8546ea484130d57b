"""Durable against power loss, not only against kill -9: at every commit point of a workload of
flushes with write-back, background compaction rounds, garbage collection, pins and reopens,
every file the new manifest names has its bytes and its name on disk (`_durability.PowerCutOracle`).
The oracle itself is shown to catch the two mutations that kill -9 tests cannot see: a write-back
segment not fsynced before the manifest lists it, and a rename whose folder is never fsynced."""

from __future__ import annotations

import pytest

from lightning_embcache.store import disk as disk_mod
from lightning_embcache.store import fileio

from _durability import PowerCutOracle
from _fault_workload import CHUNK, N, run_workload, set_mode


@pytest.fixture(autouse=True)
def _in_process_compaction(monkeypatch):
    monkeypatch.setenv("EMBCACHE_COMPACTION_PROCESS", "never")  # its file operations pass the hooks
    set_mode("disk")
    yield
    fileio.FAULTS = None


def _run(tmp_path, monkeypatch) -> PowerCutOracle:
    path = tmp_path / "s"
    oracle = PowerCutOracle(path, N // CHUNK)
    oracle.patch(monkeypatch)
    try:
        out = run_workload(path, oracle)
    finally:
        fileio.FAULTS = None
    assert out["wrong"] == 0
    return oracle


def test_every_commit_names_only_durable_files(tmp_path, monkeypatch):
    oracle = _run(tmp_path, monkeypatch)
    assert oracle.commits >= 10  # flushes and compaction rounds were checked
    assert oracle.violations == [], "\n".join(oracle.violations[:10])


def test_a_write_back_segment_not_fsynced_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_mod.Disk, "sync_segment", lambda self, seg: None)
    oracle = _run(tmp_path, monkeypatch)
    assert any("were not fsynced" in v for v in oracle.violations), oracle.violations[:5]


def test_a_rename_whose_folder_is_never_fsynced_is_caught(tmp_path, monkeypatch):
    real = fileio.fsync

    def no_folder_fsync(fd, name):
        if not fileio.os.path.isdir(str(name)):
            real(fd, name)

    monkeypatch.setattr(fileio, "fsync", no_folder_fsync)
    oracle = _run(tmp_path, monkeypatch)
    assert any("folder fsync" in v for v in oracle.violations), oracle.violations[:5]
