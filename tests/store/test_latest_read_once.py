"""A reader opening the store reads ``LATEST`` once: a writer that publishes the next version
while the reader checks it (LATEST moves to the next manifest between two reads) never makes the
reader see one manifest's bytes under another's name (a false CorruptStoreError under load)."""

from __future__ import annotations

import os

import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import fileio


def test_latest_moving_on_during_the_check_is_not_damage(tmp_path, monkeypatch):
    store = EmbeddingStore.create(tmp_path / "s", 64, 4)
    for k in range(3):
        store.update(torch.tensor([k]), torch.full((1, 4), float(k)))
        store.flush()
    disk = store._versions.disk
    latest = store.version
    older = latest - 1  # its manifest differs from LATEST's: the check reads LATEST
    real = fileio.read_raw
    moved = []

    def read_then_publish(path, *args, **kwargs):
        data = real(path, *args, **kwargs)
        if path.name == "LATEST" and not moved:  # a writer publishes the next version right after
            store.update(torch.tensor([9]), torch.ones(1, 4))
            store.flush()
            moved.append(store.version)
        return data

    monkeypatch.setattr(fileio, "read_raw", read_then_publish)
    assert disk.read_latest(older) == latest
    assert moved == [latest + 1]
    st = os.stat(tmp_path / "s" / "LATEST")
    assert st.st_ino == os.stat(disk.manifest_path(latest + 1)).st_ino  # it did move on
    store.close()
