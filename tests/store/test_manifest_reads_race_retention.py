"""A version that retention drops while it is being read is a VersionNotFoundError, never a raw
FileNotFoundError: the manifest is read once, not checked for existence and read afterwards."""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch

from lightning_embcache import EmbeddingStore, VersionNotFoundError


def _two_versions(path):
    s = EmbeddingStore.create(path, 100, 4)
    s.update(torch.arange(3), torch.ones(3, 4))
    v1 = s.flush()
    s.pin(v1)  # kept by retention until the test removes its manifest itself
    s.update(torch.arange(3), torch.full((3, 4), 2.0))
    s.flush()
    return s, v1


def test_a_manifest_dropped_between_a_check_and_its_read_is_version_not_found(tmp_path, monkeypatch):
    """The interleaving made deterministic: every existence check says yes (as it would just before
    retention's unlink), and the manifest is already gone when it is read."""
    s, v1 = _two_versions(tmp_path / "s")
    try:
        (tmp_path / "s" / f"manifest-{v1:012d}").unlink()  # as retention drops it
        monkeypatch.setattr(pathlib.Path, "exists", lambda self, **kw: True)
        with pytest.raises(VersionNotFoundError, match=f"version={v1}"):
            s.manifest_checksum(v1)
        with pytest.raises(VersionNotFoundError, match=f"version={v1}"):
            EmbeddingStore.open(tmp_path / "s", version=v1, readonly=True)
    finally:
        monkeypatch.undo()
        s.close()


def test_checksums_asked_while_retention_drops_versions_are_found_or_not_found(tmp_path):
    s = EmbeddingStore.create(tmp_path / "s", 100, 4)
    errors: list[BaseException] = []
    versions = [s.flush()]
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            for v in list(versions):
                try:
                    s.manifest_checksum(v)
                except VersionNotFoundError:
                    pass
                except BaseException as exc:  # a raw OSError is the bug
                    errors.append(exc)
                    return

    t = threading.Thread(target=ask)
    t.start()
    try:
        for i in range(60):  # each flush lets retention drop the unpinned older versions
            s.update(torch.arange(3), torch.full((3, 4), float(i)))
            versions.append(s.flush())
    finally:
        stop.set()
        t.join()
        s.close()
    assert not errors, errors[:3]
