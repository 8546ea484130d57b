"""Runs a new user makes every day print nothing about the mixin's machinery: a Trainer used again
for validate/predict, and a LightningDataModule."""

from __future__ import annotations

import logging
import warnings

import lightning as L
import torch
from _lightning_helpers import tiny_model, tiny_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import EmbeddingStoreMixin
from lightning_embcache.lightning.mixin import _StoreLifecycle

N = 64
DATA = TensorDataset(torch.arange(N), torch.randn(N, 4, generator=torch.Generator().manual_seed(0)))


class Codes(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path):
        super().__init__()
        self.codes = self.add_embedding_store("codes", num_rows=N, dim=4, path=path, optimizer="sgd", lr=0.1)
        self.head = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return torch.nn.functional.mse_loss(self.head(self.codes.lookup(ids)), y)

    def validation_step(self, batch, batch_idx):
        self.training_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self.head(self.codes.lookup(batch[0]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


class Data(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(DATA, batch_size=16, shuffle=True)

    def val_dataloader(self):
        return DataLoader(DATA, batch_size=32)


def _noise(caplog, caught):
    said = [r.getMessage() for r in caplog.records] + [str(w.message) for w in caught]
    return [m for m in said if "_StoreLifecycle" in m or "transfer_batch_to_device" in m]


def test_validate_and_predict_after_fit_on_the_same_trainer_say_nothing_about_the_lifecycle(tmp_path, caplog):
    model = Codes(tmp_path / "codes")
    trainer = tiny_trainer(tmp_path, max_steps=3)
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(DATA, batch_size=16))
        trainer.validate(model, DataLoader(DATA, batch_size=32), verbose=False)
        trainer.predict(model, DataLoader(DATA, batch_size=32))
    assert _noise(caplog, caught) == []
    assert sum(isinstance(c, _StoreLifecycle) for c in trainer.callbacks) == 1


def test_a_datamodule_run_says_nothing_about_transfer_batch_to_device(tmp_path, caplog):
    model = Codes(tmp_path / "codes")
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(tmp_path, max_steps=3, limit_val_batches=1).fit(model, datamodule=Data())
    assert _noise(caplog, caught) == []


def test_a_trainer_fitted_twice_trains_the_rows_at_every_step_of_the_second_fit(tmp_path):
    from lightning_embcache.lightning.mixin import _StoreLifecycle  # noqa: F811

    lifecycle = _StoreLifecycle()
    lifecycle._stepped["latents"] = 1  # what a first fit leaves behind at global step 1
    model = tiny_model(tmp_path / "latents")
    lifecycle.setup(tiny_trainer(tmp_path), model, "fit")
    assert lifecycle._stepped == {}


def test_the_batch_transfer_remembers_the_host_ids_of_a_batch_moved_off_the_cpu(tmp_path):
    # "meta" stands in for a GPU here: what matters is that the ids left the host
    model = Codes(tmp_path / "codes")
    ids, y = torch.arange(16), torch.randn(16, 4)
    moved_ids, moved_y = model._apply_batch_transfer_handler((ids, y), torch.device("meta"))
    assert moved_ids.device.type == "meta"
    assert model._embcache_host_copy(moved_ids) is ids  # a get of these ids reads the host copy: no device sync
