"""add_embedding_store(max_norm=..., norm_type=..., stochastic_rounding=...) through a real Trainer."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import EmbeddingStoreMixin, InvalidArgumentError

N, DIM = 256, 16


class Codes(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path, **store_kw):
        super().__init__()
        self.codes = self.add_embedding_store("codes", N, DIM, path=path, init="normal", init_std=3.0,
                                              optimizer="adam", lr=0.01, **store_kw)
        self.decoder = torch.nn.Linear(DIM, 4)

    def training_step(self, batch, _):
        ids, y = batch
        return torch.nn.functional.mse_loss(self.decoder(self.codes.lookup(ids).float()), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.decoder.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.arange(N), torch.randn(N, 4, generator=g)), batch_size=32,
                          shuffle=True, generator=g)


def _fit(model, root):
    L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, default_root_dir=root).fit(model)


def test_max_norm_bounds_every_looked_up_row_in_a_fit(tmp_path):
    model = Codes(tmp_path / "codes", max_norm=1.0)
    _fit(model, tmp_path)
    rows = model.codes.get(torch.arange(N))
    # each row was rescaled to norm 1 at its lookup, then moved once by Adam (at most lr per value)
    assert rows.norm(dim=1).max() < 1.0 + 0.01 * DIM ** 0.5 * 1.01
    with torch.no_grad():
        seen = model.codes.lookup(torch.arange(N))
    assert seen.norm(dim=1).max() <= 1.0
    assert torch.equal(model.codes.get(torch.arange(N)), rows)   # an evaluation lookup writes nothing


def test_bf16_rows_train_with_stochastic_rounding_by_default(tmp_path):
    model = Codes(tmp_path / "codes", dtype=torch.bfloat16)
    _fit(model, tmp_path)
    assert model.codes._trainable.stochastic_rounding is True
    assert model.codes.get(torch.arange(4)).dtype == torch.bfloat16


@pytest.mark.parametrize("kw,name", [({"max_norm": 0.0}, "max_norm"), ({"max_norm": 1.0, "norm_type": 0}, "norm_type"),
                                     ({"stochastic_rounding": True}, "stochastic_rounding")])
def test_bad_row_options_are_refused_where_they_are_given(tmp_path, kw, name):
    with pytest.raises(InvalidArgumentError, match=name):
        Codes(tmp_path / "codes", **kw)
    assert not (tmp_path / "codes").exists()
