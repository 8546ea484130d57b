"""EmbeddingStoreMixin and its handles with a real Trainer and real store folders."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from _lightning_helpers import RecordRows, tiny_model, tiny_trainer

from lightning_embcache import EmbeddingStore, EmbeddingStoreMixin, InvalidArgumentError, StoreError, StoreLockedError


def test_handle_is_returned_at_construction_and_listed_by_name(tmp_path):
    model = tiny_model(tmp_path / "latents")
    assert model.embedding_stores == {"latents": model.latents}
    assert model.latents.num_rows == 512 and model.latents.dim == 16
    assert not (tmp_path / "latents").exists()  # nothing opened before setup


def test_store_is_not_a_parameter_buffer_or_state_dict_entry(tmp_path):
    model = tiny_model(tmp_path / "latents")
    assert all("latents" not in k for k in model.state_dict())
    assert all("latents" not in n for n, _ in model.named_parameters())
    model.double()  # .to()/.double() move modules and tensors, never the store
    assert model.latents.dtype == torch.float32
    assert model.latents.get(torch.arange(3)).dtype == torch.float32


def test_names_and_options_are_validated(tmp_path):
    model = tiny_model(tmp_path / "latents")
    with pytest.raises(ValueError, match="already exists"):
        model.add_embedding_store("latents", 10, 4)
    with pytest.raises(ValueError, match="identifier"):
        model.add_embedding_store("my table", 10, 4)
    with pytest.raises(TypeError, match="hot_byte"):
        model.add_embedding_store("other", 10, 4, hot_byte=1024)  # a typo is not an optimizer option


def test_optimizer_options_build_the_row_optimizer_and_lookup_needs_one(tmp_path):
    model = tiny_model(tmp_path / "latents")
    handle = model.add_embedding_store("codes", 10, 4, optimizer="adam", lr=0.01, betas=(0.9, 0.99))
    assert handle.optim_config == {"optimizer": "adam", "lr": 0.01, "betas": (0.9, 0.99)}
    assert handle.optimizer.lr == 0.01 and handle.optimizer.state_dict()["betas"] == (0.9, 0.99)
    z = handle.lookup(torch.arange(3))
    assert z.requires_grad and z.shape == (3, 4)
    with pytest.raises(StoreError, match="optimizer="):
        model.latents.lookup(torch.arange(3))  # declared without an optimizer
    with pytest.raises(ValueError, match="lr"):
        model.add_embedding_store("bad", 10, 4, optimizer="adam", lr=-1.0)


def test_fit_creates_the_store_flushes_at_the_end_and_releases_it(tmp_path):
    model = tiny_model(tmp_path / "latents")
    tiny_trainer(tmp_path, max_steps=5).fit(model)
    assert not model.latents._is_open()
    with EmbeddingStore.open(tmp_path / "latents") as store:  # the writer lock is free again
        on_disk = store.get(torch.arange(512))
    assert torch.equal(model.latents.get(torch.arange(512)), on_disk)  # the handle reopens to read
    assert not torch.equal(on_disk, EmbeddingStore.create(None, 512, 16, init="normal", init_std=0.01,
                                                          seed=3).get(torch.arange(512)))


def test_second_fit_continues_from_the_first(tmp_path):
    model = tiny_model(tmp_path / "latents")
    tiny_trainer(tmp_path, max_steps=3).fit(model)
    rows = model.latents.get(torch.arange(512))
    recorder = RecordRows()
    trainer = tiny_trainer(tmp_path, max_steps=3, callbacks=[recorder])
    trainer.fit(model)
    assert not torch.equal(model.latents.get(torch.arange(512)), rows)


def test_an_exception_in_training_releases_the_store(tmp_path):
    model = tiny_model(tmp_path / "latents")

    def boom(batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("boom")
        return type(model).training_step(model, batch, batch_idx)

    model.training_step = boom
    with pytest.raises(RuntimeError, match="boom"):
        tiny_trainer(tmp_path, max_steps=5).fit(model)
    EmbeddingStore.open(tmp_path / "latents").close()  # not locked: the handle released it


def test_one_writer_per_path_is_enforced_across_modules(tmp_path):
    first, second = tiny_model(tmp_path / "latents"), tiny_model(tmp_path / "latents")
    first.latents.update(torch.arange(2), torch.ones(2, 16))  # opens it for writing
    with pytest.raises(InvalidArgumentError, match="if_exists"):  # rows it did not create: no silent mixing
        second.latents.update(torch.arange(2), torch.ones(2, 16))
    assert first.latents._is_open()
    second.latents.if_exists = "resume"  # allowed: the first module, outside a fit, hands over (flushed)
    second.latents.update(torch.arange(1), torch.full((1, 16), 2.0))
    assert not first.latents._is_open()
    assert torch.equal(second.latents.get(torch.arange(2)), torch.tensor([[2.0] * 16, [1.0] * 16]))
    second.latents._in_fit = True  # while a module fits, nobody takes its store
    with pytest.raises(StoreLockedError, match="fitting"):
        first.latents.update(torch.arange(2), torch.ones(2, 16))
    second.latents._in_fit = False
    second.latents.close()


def test_in_memory_store_keeps_its_rows_after_fit_and_warns_at_checkpoints(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = tiny_model(None)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2)
    with pytest.warns(UserWarning, match="path=None"):
        tiny_trainer(tmp_path, max_steps=4, callbacks=[ckpt], enable_checkpointing=True).fit(model)
    assert model.latents._is_open()
    assert model.latents.get(torch.arange(512)).abs().sum() > 0


def test_module_pickles_and_deepcopies_without_the_open_store(tmp_path):
    model = tiny_model(tmp_path / "latents")
    model.latents.update(torch.arange(4), torch.ones(4, 16))
    model.latents.flush()
    clone = pickle.loads(pickle.dumps(model))
    assert clone.latents is clone.embedding_stores["latents"] and not clone.latents._is_open()
    model.latents._release()
    assert torch.equal(clone.latents.get(torch.arange(4)), torch.ones(4, 16))
    clone.latents._release()
    assert copy.deepcopy(model).latents.path == model.latents.path


def test_on_save_checkpoint_override_without_super_is_reported(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = tiny_model(tmp_path / "latents")
    type_ = type("Forgetful", (type(model),), {"on_save_checkpoint": lambda self, checkpoint: None})
    model.__class__ = type_
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2)
    # The mixin never sees the save, so it cannot pin: said when the file is written and when it is loaded.
    with pytest.warns(UserWarning, match="does not call super"):
        tiny_trainer(tmp_path, max_steps=2, callbacks=[ckpt], enable_checkpointing=True).fit(model)
    fresh = tiny_model(tmp_path / "latents")
    with pytest.warns(UserWarning, match="names no embedding store versions"):
        fresh.on_load_checkpoint(torch.load(ckpt.best_model_path, weights_only=False))


def test_mixin_works_on_a_users_own_module(tmp_path):
    import lightning as L

    class Tiny(EmbeddingStoreMixin, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.codes = self.add_embedding_store("codes", 100, 4, path=tmp_path / "codes")
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            ids = batch[0]
            z = self.codes.get(ids)
            self.codes.update(ids, z + 1)
            return self.layer(z).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(100)), batch_size=10)

    model = Tiny()
    tiny_trainer(tmp_path, max_epochs=2).fit(model)
    assert torch.equal(model.codes.get(torch.arange(100)), torch.full((100, 4), 2.0))


def test_prefetching_the_next_batch_changes_no_row(tmp_path):
    rows = []
    for prefetch in (False, True):
        torch.manual_seed(0)  # the same decoder initialisation in both runs
        model = tiny_model(tmp_path / f"latents-{prefetch}", hot_bytes=8 * 1024, prefetch=prefetch)
        tiny_trainer(tmp_path, max_steps=12).fit(model)
        rows.append(model.latents.get(torch.arange(512)))
    assert torch.equal(rows[0], rows[1])
