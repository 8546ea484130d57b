"""torch.compile on the rest of the model: store calls stay outside the graph, no recompiles per batch."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import EmbeddingStoreMixin


class Compiled(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self):
        super().__init__()
        self.latents = self.add_embedding_store("latents", num_rows=1000, dim=8, optimizer="adam", lr=0.05)
        decoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.decoder = torch.compile(decoder, backend="aot_eager", dynamic=False)
        self.losses = []

    def training_step(self, batch, batch_idx):
        ids, target = batch
        loss = torch.nn.functional.mse_loss(self.decoder(self.latents.lookup(ids)), target)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.decoder.parameters(), lr=1e-2)


def test_compiled_decoder_trains_rows_without_recompiling_per_batch():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (1024,), generator=g)
    target = torch.randn(1000, 4, generator=g)[ids]
    model = Compiled()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(ids, target), batch_size=64, drop_last=True))
    compiled_frames = counters["stats"]["unique_graphs"]
    assert 1 <= compiled_frames <= 2, f"{compiled_frames} graphs compiled for 32 batches of one shape"
    assert sum(model.losses[-4:]) < sum(model.losses[:4])
    assert int(model.latents.row_meta(torch.arange(1000))["updates"].sum()) > 0
