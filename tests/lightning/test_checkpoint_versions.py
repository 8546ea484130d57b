"""Checkpoint-exact stores: a checkpoint names a pinned store version and reopens exactly that."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _lightning_helpers import RecordRows, tiny_model, tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_embcache import CorruptStoreError, EmbeddingStore, VersionNotFoundError
from lightning_embcache.demo import AutoDecoder
from lightning_embcache.lightning.checkpoint_pins import registry_path

ALL = torch.arange(512)


def _fit(tmp_path, steps, *callbacks, model=None, ckpt_path=None, **kw):
    model = model or tiny_model(tmp_path / "latents", **kw)
    trainer = tiny_trainer(tmp_path, max_steps=steps, callbacks=list(callbacks), enable_checkpointing=True)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def _every(n, **kw):
    return ModelCheckpoint(dirpath=kw.pop("dirpath"), filename="{step}", every_n_train_steps=n, **kw)


def test_checkpoint_holds_a_small_reference_not_the_table(tmp_path):
    ckpt = _every(4, dirpath=tmp_path / "ck", save_top_k=-1)
    model = _fit(tmp_path, 4, ckpt)
    saved = torch.load(tmp_path / "ck" / "step=4.ckpt", weights_only=False)
    ref = saved["embedding_stores"]["latents"]
    assert set(ref) == {"path", "version", "manifest_checksum"}
    assert ref["path"] == str(tmp_path / "latents")
    with EmbeddingStore.open(tmp_path / "latents", readonly=True) as store:
        assert ref["version"] in store.pinned()
        assert ref["manifest_checksum"] == store.manifest_checksum(ref["version"])
    assert not any("latents" in k for k in saved["state_dict"])
    assert model.latents.path is not None


def test_checkpoint_restores_its_own_version_after_later_flushes(tmp_path):
    rows = RecordRows()
    ckpt = _every(4, dirpath=tmp_path / "ck", save_top_k=-1)
    from lightning_embcache import DeferredSync

    model = _fit(tmp_path, 12, rows, ckpt, DeferredSync(every_n_steps=1, background=False))
    final = model.latents.get(ALL)
    assert not torch.equal(final, rows.rows[4])
    # load_from_checkpoint: read-only, at the checkpoint's version
    old = AutoDecoder.load_from_checkpoint(tmp_path / "ck" / "step=4.ckpt")
    assert torch.equal(old.latents.get(ALL), rows.rows[4])
    assert old.latents._store.readonly
    old.latents._release()
    # fit(ckpt_path=...) that stops at once: the handle keeps that version, not the store's latest
    resumed = _fit(tmp_path, 4, model=tiny_model(tmp_path / "latents"), ckpt_path=tmp_path / "ck" / "step=4.ckpt")
    assert torch.equal(resumed.latents.get(ALL), rows.rows[4])


def test_resume_writes_new_versions_on_top_of_the_checkpoint_version(tmp_path):
    rows = RecordRows()
    _fit(tmp_path, 8, rows, _every(4, dirpath=tmp_path / "ck", save_top_k=-1))
    with EmbeddingStore.open(tmp_path / "latents", readonly=True) as store:
        latest_before = store.versions()[-1]
    rows2 = RecordRows()
    resumed = _fit(tmp_path, 8, rows2, _every(4, dirpath=tmp_path / "ck2", save_top_k=-1),
                   model=tiny_model(tmp_path / "latents"), ckpt_path=tmp_path / "ck" / "step=4.ckpt")
    assert torch.equal(rows2.rows[8], rows.rows[8])  # same steps again give the same rows
    with EmbeddingStore.open(tmp_path / "latents", readonly=True) as store:
        assert store.version > latest_before
        assert torch.equal(store.get(ALL), resumed.latents.get(ALL))


def test_removed_checkpoints_release_their_versions(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", every_n_train_steps=2, save_top_k=2,
                           monitor="step", mode="max")
    _fit(tmp_path, 16, ckpt)
    files = sorted(str(p) for p in (tmp_path / "ck").glob("*.ckpt"))
    assert [os.path.basename(f) for f in files] == ["step=14.ckpt", "step=16.ckpt"]
    kept = {torch.load(f, weights_only=False)["embedding_stores"]["latents"]["version"] for f in files}
    registry = json.loads(registry_path(tmp_path / "latents").read_text())["versions"]
    assert {int(v) for v in registry} == kept
    assert sorted(sum(registry.values(), [])) == files
    with EmbeddingStore.open(tmp_path / "latents", readonly=True) as store:
        assert set(store.pinned()) == kept
        assert len(store.versions()) <= len(kept) + 2  # the latest two unpinned ones at most


def test_checkpoint_deleted_by_hand_is_released_at_the_next_save(tmp_path):
    class DeleteFirst(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 5:
                os.remove(tmp_path / "ck" / "step=2.ckpt")

    _fit(tmp_path, 6, DeleteFirst(), _every(2, dirpath=tmp_path / "ck", save_top_k=-1))
    registry = json.loads(registry_path(tmp_path / "latents").read_text())["versions"]
    names = sorted(os.path.basename(f) for f in sum(registry.values(), []))
    assert names == ["step=4.ckpt", "step=6.ckpt"]
    with EmbeddingStore.open(tmp_path / "latents", readonly=True) as store:
        assert len(store.pinned()) == 2


def test_overwritten_last_checkpoint_refers_only_to_its_newest_version(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=0, save_last=True)
    _fit(tmp_path, 6, ckpt)
    registry = json.loads(registry_path(tmp_path / "latents").read_text())["versions"]
    assert list(registry.values()) == [[str(tmp_path / "ck" / "last.ckpt")]]
    last = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)["embedding_stores"]["latents"]
    assert list(registry) == [str(last["version"])]


def test_disk_use_stays_bounded_over_20_checkpoints(tmp_path):
    sizes = []

    class Measure(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            # what stays on disk, not a moment inside a background compaction (whose new
            # generation and the one it replaces both exist until it ends)
            pl_module.latents.store._wait_bg()
            sizes.append(sum(p.stat().st_size for p in (tmp_path / "latents").rglob("*") if p.is_file()))

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")
    _fit(tmp_path, 20, ckpt, Measure())
    table = 512 * 16 * 4
    assert len(sizes) == 20
    # Each step rewrites 64 of 512 rows; two pinned checkpoints plus compaction keep the folder bounded.
    assert max(sizes) <= 4 * table + (64 << 10), sizes
    assert max(sizes[10:]) <= 1.5 * max(sizes[:10]) + (16 << 10), sizes


def test_checkpoint_whose_version_is_gone_names_path_and_version(tmp_path):
    _fit(tmp_path, 2, _every(2, dirpath=tmp_path / "ck", save_top_k=-1))
    ckpt = tmp_path / "ck" / "step=2.ckpt"
    version = torch.load(ckpt, weights_only=False)["embedding_stores"]["latents"]["version"]
    with EmbeddingStore.open(tmp_path / "latents") as store:  # as if the store was cleaned up behind our back
        store.unpin(version)
        for i in range(4):
            store.update(torch.arange(4), torch.full((4, 16), float(i)))
            store.flush()
        assert version not in store.versions()
    with pytest.raises(VersionNotFoundError, match=rf"{tmp_path / 'latents'}.*version {version}"):
        _fit(tmp_path, 4, model=tiny_model(tmp_path / "latents"), ckpt_path=ckpt)


def test_checkpoint_of_another_store_at_the_same_path_is_refused(tmp_path):
    _fit(tmp_path, 2, _every(2, dirpath=tmp_path / "ck", save_top_k=-1))
    saved = torch.load(tmp_path / "ck" / "step=2.ckpt", weights_only=False)
    saved["embedding_stores"]["latents"]["manifest_checksum"] = "00000000"  # as if the store was recreated
    model = tiny_model(tmp_path / "latents")
    with pytest.raises(CorruptStoreError, match="not the one the checkpoint saw"):
        model.on_load_checkpoint(saved)


def test_manifest_checksum_of_a_pinned_version_survives_compaction(tmp_path):
    # The checkpoint contract: the checksum a checkpoint recorded stays valid while the version lives.
    with EmbeddingStore.create(tmp_path / "s", 512, 16, hot_bytes=None) as store:
        store.update(torch.arange(64), torch.ones(64, 16))
        version = store.flush()
        store.pin(version)
        before = store.manifest_checksum(version)
        store.compact()
        store.update(torch.arange(8), torch.zeros(8, 16))
        store.flush()
        assert store.manifest_checksum(version) == before
