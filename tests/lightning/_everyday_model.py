"""A small model with a store, shared by the test_everyday_* files."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import EmbeddingStore, EmbeddingStoreMixin

N, DIM, OUT = 96, 4, 3


class Model(EmbeddingStoreMixin, L.LightningModule):
    """Reads its rows with `read` ("get" or "lookup") in every stage; records what it computed."""

    def __init__(self, path, read: str, trainable: bool = True, if_exists: str = "error") -> None:
        super().__init__()
        opt = dict(optimizer="adam", lr=0.05) if trainable else {}
        if if_exists != "error":
            opt["if_exists"] = if_exists
        self.latents = self.add_embedding_store("latents", num_rows=N, dim=DIM, path=path, init="normal", **opt)
        self.decoder = torch.nn.Linear(DIM, OUT)
        self.read = read
        self.seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def rows(self, ids):
        return getattr(self.latents, self.read)(ids)

    def training_step(self, batch, batch_idx):
        ids, y = batch
        if self.latents.optimizer is None:  # direct writes: a step that moves every row it touched
            z = self.latents.get(ids)
            self.latents.update(ids, z + 0.5)
        else:
            z = self.latents.lookup(ids)
        return torch.nn.functional.mse_loss(self.decoder(z), y)

    def _eval(self, stage, batch):
        ids, y = batch
        z = self.rows(ids)
        assert not z.requires_grad
        self.seen.setdefault(stage, []).append((ids.clone(), z.clone()))
        return self.decoder(z)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self._eval("validate", batch), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", torch.nn.functional.mse_loss(self._eval("test", batch), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self._eval("predict", batch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.decoder.parameters(), lr=1e-2)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randperm(N, generator=g), torch.randn(N, OUT, generator=g)), batch_size=16)


def trainer(tmp_path, **kw) -> L.Trainer:
    args = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, max_epochs=1, default_root_dir=tmp_path, num_sanity_val_steps=0)
    args.update(kw)
    return L.Trainer(**args)


def on_disk(path) -> torch.Tensor:
    with EmbeddingStore.open(path, readonly=True) as store:
        return store.get(torch.arange(N))

