"""store_io comes from a real EmbeddingStore's io_wait_seconds, through the mixin's handles."""

from __future__ import annotations

import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import EmbeddingStoreMixin, StepProfiler


class SlowStoreModule(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path):
        super().__init__()
        self.latents = self.add_embedding_store("latents", num_rows=512, dim=8, path=path)
        self.lin = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        z = self.latents.get(ids)
        self.latents.update(ids, z + 1)
        return self.lin(z).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_store_io_phase_reports_the_store_time(tmp_path, monkeypatch):
    model = SlowStoreModule(tmp_path / "s")
    profiler = StepProfiler(log_every_n_steps=5, report=False)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[profiler])
    # make the store's own time visible: every get spends 5 ms inside the store call (memory
    # mode's steady-state gather, and the tiered read it starts from)
    from lightning_embcache.store import store as store_mod
    from lightning_embcache.store import tiers

    def slowed(original):
        def slow(self, *args):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.005:
                pass
            return original(self, *args)
        return slow

    monkeypatch.setattr(tiers.Tiers, "take", slowed(tiers.Tiers.take))
    monkeypatch.setattr(store_mod.EmbeddingStore, "_gather_checked", slowed(store_mod.EmbeddingStore._gather_checked))
    trainer.fit(model, DataLoader(TensorDataset(torch.arange(512)), batch_size=32))
    epoch = profiler.summary()[0]
    # the 5 ms are inside get(), so they are store_io, taken out of the forward phase
    assert epoch["phases_ms"]["store_io"] >= 4.5, epoch["phases_ms"]
    assert epoch["phases_ms"]["forward"] < epoch["phases_ms"]["store_io"], epoch["phases_ms"]
