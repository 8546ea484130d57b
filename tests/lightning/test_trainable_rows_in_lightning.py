"""Trainable rows through the mixin: a real Trainer, real stores, a reference nn.Embedding."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import EmbeddingStoreMixin

N, DIM, SAMPLES = 64, 4, 256


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, N, (SAMPLES,), generator=g)
    true = torch.randn(N, DIM, generator=g)
    decoder = torch.randn(DIM, 8, generator=g)
    return TensorDataset(ids, true[ids] @ decoder), decoder


class AutoDecoder(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path, decoder, *, trainable=True, lr=0.05):
        super().__init__()
        self.decoder = decoder
        self.latents = self.add_embedding_store("latents", num_rows=N, dim=DIM, path=path, hot_bytes=16 * 64,
                                                chunk_rows=16, optimizer="adam" if trainable else None,
                                                **({"lr": lr} if trainable else {}))
        self.bias = torch.nn.Parameter(torch.zeros(8))
        self.trainable = trainable
        self.losses = []

    def training_step(self, batch, batch_idx):
        ids, target = batch
        z = self.latents.lookup(ids) if self.trainable else self.latents.get(ids)
        loss = ((z @ self.decoder + self.bias - target) ** 2).mean()
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD([self.bias], lr=0.0)


def _fit(tmp_path, trainable, epochs=8, accumulate=1):
    ds, decoder = _data()
    model = AutoDecoder(tmp_path / ("t" if trainable else "f"), decoder, trainable=trainable)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accumulate_grad_batches=accumulate)
    trainer.fit(model, DataLoader(ds, batch_size=32, shuffle=True))
    return model


def test_trained_rows_reach_a_lower_loss_than_frozen_rows(tmp_path):
    torch.manual_seed(0)
    trained = _fit(tmp_path, True)
    torch.manual_seed(0)
    frozen = _fit(tmp_path, False)
    last = lambda m: sum(m.losses[-8:]) / 8  # noqa: E731
    assert last(trained) < 0.5 * last(frozen), (last(trained), last(frozen))
    meta = trained.latents.row_meta(torch.arange(N))
    seen = torch.zeros(N, dtype=torch.bool)
    seen[_data()[0].tensors[0]] = True
    assert (meta["updates"][seen] > 0).all() and (meta["updates"][~seen] == 0).all()
    assert int(meta["last_step"].max()) == 8 * 8  # 8 epochs x 8 optimizer steps


def test_mixin_rows_match_nn_embedding_with_sparse_adam(tmp_path):
    """Same batches, gradient accumulation over 2 micro-batches: rows equal SparseAdam's."""
    ds, decoder = _data(1)
    torch.manual_seed(1)
    model = AutoDecoder(tmp_path / "s", decoder)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
    trainer.fit(model, DataLoader(ds, batch_size=32, shuffle=False))
    emb = torch.nn.Embedding(N, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.zero_()
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.05)
    loader = list(DataLoader(ds, batch_size=32, shuffle=False))
    for _ in range(2):
        for k in range(0, len(loader), 2):
            opt.zero_grad()
            for ids, target in loader[k:k + 2]:
                (((emb(ids) @ decoder - target) ** 2).mean() / 2).backward()
            opt.step()
    torch.testing.assert_close(model.latents.get(torch.arange(N)), emb.weight.detach(), rtol=1e-5, atol=1e-6)
