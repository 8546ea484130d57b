"""add_embedding_store(device_bytes=...): checked up front; on a CPU module it changes nothing."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import EmbeddingStore, EmbeddingStoreMixin

N, DIM = 500, 8


class _Model(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path, **kw):
        super().__init__()
        self.latents = self.add_embedding_store("latents", num_rows=N, dim=DIM, path=path, init="normal",
                                                optimizer="adam", lr=0.05, **kw)
        self.net = torch.nn.Linear(DIM, 4)

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return torch.nn.functional.mse_loss(self.net(self.latents.lookup(ids)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.0)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1GB"])
def test_a_bad_device_budget_is_refused_by_name(tmp_path, bad):
    with pytest.raises(ValueError, match="device_bytes"):
        _Model(tmp_path / "s", device_bytes=bad)


def test_on_cpu_the_device_budget_changes_nothing(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, N, (256,), generator=g), torch.randn(256, 4, generator=g))
    rows = {}
    for name, kw in (("default", {}), ("budget", {"device_bytes": 1 << 20}), ("none", {"device_bytes": 0})):
        L.seed_everything(0)
        model = _Model(tmp_path / name, **kw)
        L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(model, DataLoader(data, batch_size=32))
        assert model.latents._device_tier is None
        with EmbeddingStore.open(tmp_path / name, readonly=True) as s:
            rows[name] = s.get(torch.arange(N))
    assert torch.equal(rows["default"], rows["budget"]) and torch.equal(rows["default"], rows["none"])
    assert not torch.equal(rows["default"], EmbeddingStore.create(None, N, DIM, init="normal").get(torch.arange(N)))
