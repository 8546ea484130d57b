"""Opening a store while its writer publishes a version: the writer renames the new manifest into
place, then records it in LATEST. An open that listed the manifests just before the rename and
read LATEST just after must open the new version, not call the store damaged; a manifest that is
really gone still is."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache import CorruptStoreError, EmbeddingStore
from lightning_embcache.store import disk as disk_mod


def _store_with_versions(path):
    with EmbeddingStore.create(path, 64, 4) as s:
        s.update(torch.arange(8), torch.ones(8, 4))
        s.pin(s.flush())  # an older manifest stays beside the newest
        s.update(torch.arange(8), torch.full((8, 4), 2.0))
        return s.flush()


@pytest.mark.parametrize("readonly", [True, False])
def test_an_open_whose_listing_predates_the_newest_manifest_opens_it(shm_path, monkeypatch, readonly):
    newest = _store_with_versions(shm_path / "s")
    real = disk_mod.Disk.list_versions
    calls = []

    def listing_before_the_rename(self):
        calls.append(1)
        versions = real(self)
        return [v for v in versions if v != newest] if len(calls) == 1 else versions

    monkeypatch.setattr(disk_mod.Disk, "list_versions", listing_before_the_rename)
    with EmbeddingStore.open(shm_path / "s", readonly=readonly) as s:
        assert s.version == newest
        assert torch.equal(s.get(torch.arange(8)), torch.full((8, 4), 2.0))


def test_a_newest_manifest_that_is_gone_is_still_named_damage(shm_path):
    newest = _store_with_versions(shm_path / "s")
    (shm_path / "s" / f"manifest-{newest:012d}").unlink()
    with pytest.raises(CorruptStoreError, match="rolled back"):
        EmbeddingStore.open(shm_path / "s")
