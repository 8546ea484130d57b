"""torch.compile(model) of the whole LightningModule: store calls are graph breaks, one compile for N steps."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import EmbeddingStoreMixin


class Whole(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path, trainable: bool):
        super().__init__()
        opt = dict(optimizer="adam", lr=0.05) if trainable else {}
        self.latents = self.add_embedding_store("latents", num_rows=512, dim=8, path=path, init="normal", **opt)
        self.decoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.trainable = trainable

    def forward(self, ids):  # what torch.compile(model) compiles: store call, then the decoder
        z = self.latents.lookup(ids) if self.trainable else self.latents.get(ids)
        return self.decoder(z), z

    def training_step(self, batch, batch_idx):
        ids, target = batch
        out, z = self(ids)
        loss = torch.nn.functional.mse_loss(out, target)
        if not self.trainable:
            self.latents.update(ids, z - 0.1 * torch.sign(z))
        return loss

    def predict_step(self, batch, batch_idx):
        return self(batch[0])[0]

    def configure_optimizers(self):
        return torch.optim.Adam(self.decoder.parameters(), lr=1e-2)


class Losses(L.Callback):
    """Records each step's loss outside the compiled code (a list growing inside it would recompile)."""

    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("trainable", [True, False], ids=["lookup", "get"])
def test_compiling_the_whole_module_trains_and_compiles_once(tmp_path, trainable):
    torch._dynamo.reset()
    compiled_graphs = []

    def counting_backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (1024,), generator=g)
    target = torch.randn(512, 4, generator=g)[ids]
    model = Whole(tmp_path / "latents", trainable)
    compiled = torch.compile(model, backend=counting_backend, dynamic=False)
    record = Losses()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[record])
    trainer.fit(compiled, DataLoader(TensorDataset(ids, target), batch_size=64, drop_last=True))
    assert len(record.losses) == 32
    assert 1 <= len(compiled_graphs) <= 2, f"{len(compiled_graphs)} graphs compiled for 32 batches of one shape"
    assert sum(record.losses[-4:]) < sum(record.losses[:4])
    preds = trainer.predict(compiled, DataLoader(TensorDataset(ids[:64], target[:64]), batch_size=64))
    with torch.no_grad():
        torch.testing.assert_close(preds[0], model.decoder(model.latents.get(ids[:64])))
    model.latents.close()
