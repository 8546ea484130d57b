"""Opening a store the way a new user does: reads before fit, a path that already holds a store,
close() and `with`, a second model in the same process, the mixin in the wrong place."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from _everyday_model import Model, N, data, on_disk, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_embcache import EmbeddingStore, EmbeddingStoreMixin, InvalidArgumentError, StoreLockedError


def fit(tmp_path, model, **kw):
    trainer(tmp_path, **kw).fit(model, data())


def test_read_before_fit_on_a_fresh_path_keeps_the_training(tmp_path):
    path = tmp_path / "latents"
    model = Model(path, "get")
    init = model.latents.get(torch.arange(N))  # before anything exists on disk
    assert not path.exists()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1)
    trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[ckpt]).fit(model, data())
    trained = on_disk(path)
    assert not torch.equal(trained, init)
    assert (model.latents.row_meta(torch.arange(N))["updates"] == 2).all()
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt")) == ["epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt"]
    model.latents.close()


def test_read_before_fit_on_an_existing_path_then_resume_keeps_both_trainings(tmp_path):
    path = tmp_path / "latents"
    first = Model(path, "get")
    fit(tmp_path, first)
    after_first = on_disk(path)
    second = Model(path, "get", if_exists="resume")
    assert torch.equal(second.latents.get(torch.arange(N)), after_first)
    fit(tmp_path, second)
    after_second = on_disk(path)
    assert not torch.equal(after_second, after_first)
    assert (second.latents.row_meta(torch.arange(N))["updates"] == 2).all(), "moments and counts continued"


def test_fit_on_an_existing_path_without_a_policy_stops_and_changes_nothing(tmp_path):
    path = tmp_path / "latents"
    fit(tmp_path, Model(path, "get"))
    before = on_disk(path)
    rerun = Model(path, "get")  # the same script run again: a fresh decoder
    assert torch.equal(rerun.latents.get(torch.arange(N)), before), "reads are always allowed"
    with pytest.raises(InvalidArgumentError, match="if_exists='resume'"):
        fit(tmp_path, rerun)
    assert torch.equal(on_disk(path), before)
    with pytest.raises(InvalidArgumentError, match="if_exists"):
        rerun.latents.update(torch.arange(2), torch.zeros(2, 4))
    assert torch.equal(on_disk(path), before)


def test_if_exists_overwrite_starts_again_from_init(tmp_path):
    path = tmp_path / "latents"
    fresh_init = Model(tmp_path / "other", "get").latents.get(torch.arange(N))
    fit(tmp_path, Model(path, "get"))
    again = Model(path, "get", if_exists="overwrite")
    fit(tmp_path, again)
    assert (again.latents.row_meta(torch.arange(N))["updates"] == 1).all(), "old counts and moments are gone"
    assert not torch.equal(on_disk(path), fresh_init)


def test_if_exists_overwrite_refuses_a_folder_that_is_not_a_store(tmp_path):
    path = tmp_path / "latents"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="not one"):
        fit(tmp_path, Model(path, "get", if_exists="overwrite"))
    assert (path / "notes.txt").read_text() == "mine"


def test_if_exists_rejects_unknown_values(tmp_path):
    with pytest.raises(ValueError, match=r"if_exists='keep'.*'error', 'resume', 'overwrite'"):
        Model(tmp_path / "latents", "get", if_exists="keep")


def test_resuming_a_checkpoint_needs_no_policy_and_a_kept_model_never_locks_the_resume_out(tmp_path):
    path = tmp_path / "latents"
    model = Model(path, "get")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1)
    trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[ckpt]).fit(model, data())
    store = model.latents.store  # reopened for writing after fit, as the example does
    assert store.version >= 2
    first = tmp_path / "ck" / "epoch=0-step=6.ckpt"
    resumed = Model(path, "get")
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "ck2", save_top_k=-1)
    trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[ckpt2]).fit(resumed, data(), ckpt_path=first)
    assert (resumed.latents.row_meta(torch.arange(N))["updates"] == 2).all(), "resumed at epoch 1's version"
    assert store.closed, "the kept model's writer handed the store over"
    assert torch.equal(model.latents.get(torch.arange(N)), on_disk(path)), "the kept model reads again"


def test_a_second_writer_during_a_fit_is_refused(tmp_path):
    path = tmp_path / "latents"
    fit(tmp_path, Model(path, "get"))
    other = Model(path, "get", if_exists="resume")

    class Intruder(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            with pytest.raises(StoreLockedError, match="fitting"):
                other.latents.update(torch.arange(2), torch.zeros(2, 4))
            trainer.should_stop = True

    fit(tmp_path, Model(path, "get", if_exists="resume"), callbacks=[Intruder()])


def test_close_flushes_and_with_releases_the_writer_lock(tmp_path):
    path = tmp_path / "latents"
    model = Model(path, "get")
    with model.latents as latents:
        latents.update(torch.arange(3), torch.full((3, 4), 7.0))
    assert not model.latents._is_open()
    with EmbeddingStore.open(path) as store:  # writable: nobody holds the lock
        assert torch.equal(store.get(torch.arange(3)), torch.full((3, 4), 7.0))
    assert torch.equal(model.latents.get(torch.arange(3)), torch.full((3, 4), 7.0)), "reopens on demand"
    model.latents.close()
    model.latents.close()  # idempotent


def test_the_mixin_after_lightning_module_is_a_loud_error():
    with pytest.raises(TypeError, match="EmbeddingStoreMixin before LightningModule"):
        class Wrong(L.LightningModule, EmbeddingStoreMixin):  # noqa: F841
            pass


def test_validate_before_the_first_fit_then_fit_keeps_the_training(tmp_path):
    path = tmp_path / "latents"
    model = Model(path, "get")
    trainer(tmp_path).validate(model, data())  # reads the initial rows; nothing exists on disk
    assert not path.exists()
    fit(tmp_path, model)
    assert (model.latents.row_meta(torch.arange(N))["updates"] == 1).all()
    torch.testing.assert_close(on_disk(path), model.latents.get(torch.arange(N)), rtol=0, atol=0)
    model.latents.close()


@pytest.mark.parametrize("ids", [[1, 2, 3], range(1, 4)], ids=["list", "range"])
def test_handle_calls_take_plain_python_ids(tmp_path, ids):
    import numpy as np

    model = Model(tmp_path / "latents", "lookup")
    reference = model.latents.get(torch.tensor([1, 2, 3]))
    for form in (ids, np.asarray(list(ids))):
        assert torch.equal(model.latents.get(form), reference)
        assert torch.equal(model.latents.lookup(form).detach(), reference)
    model.latents.update(ids, torch.zeros(3, 4))
    assert torch.equal(model.latents.get(torch.tensor([1, 2, 3])), torch.zeros(3, 4))
    with pytest.raises(TypeError, match="integer"):
        model.latents.get([1.5, 2.0])
    with pytest.raises(TypeError, match="ids must be a tensor, list, range or numpy array"):
        model.latents.get([[1], [2, 3]])
    model.latents.close()
