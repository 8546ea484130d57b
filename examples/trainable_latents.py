"""Auto-decoder with trainable per-sample latent codes kept in a disk-tiered store.

    python examples/trainable_latents.py            # CPU, about a minute
    python examples/trainable_latents.py --gpu      # same on one CUDA device, bf16-mixed
    python examples/trainable_latents.py --gpu --device-mib 2   # a GPU tier of 2 MiB: rows come and go

Each sample has a 32-dim code; the codes are trained by a sparse row-wise Adam whose moments live
beside each row in the store (flushed and checkpointed together). The decoder is an ordinary
module trained by Lightning's optimizer. The loss falls well below what frozen codes reach.

On a GPU the codes and their moments train in GPU memory (the device tier): by default the whole
table when it takes at most a quarter of the GPU; ``--device-mib`` sets a smaller budget, so rows
move between the GPU and host RAM (and disk) as the epoch goes.
"""

from __future__ import annotations

import argparse
import tempfile

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import DeferredSync, EmbeddingStoreMixin, StepProfiler

SAMPLES, DIM, OUT = 50_000, 32, 64


class AutoDecoder(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path: str, samples: int = SAMPLES, device_bytes: int | None = None) -> None:
        super().__init__()
        # 50k x 32 codes (+ Adam moments): a 2 MiB hot budget keeps most of them on disk; 256-row
        # chunks because each batch touches rows all over the table (see docs/tuning.md).
        self.latents = self.add_embedding_store("latents", num_rows=samples, dim=DIM, path=path,
                                                hot_bytes=2 << 20, chunk_rows=256, init="normal",
                                                init_std=0.01, optimizer="adam", lr=1e-2,
                                                device_bytes=device_bytes)  # GPU budget (CUDA only)
        self.decoder = torch.nn.Sequential(torch.nn.Linear(DIM, 128), torch.nn.GELU(), torch.nn.Linear(128, OUT))

    def training_step(self, batch, batch_idx):
        ids, target = batch
        z = self.latents.lookup(ids)  # rows on the module's device, trained by autograd
        loss = torch.nn.functional.mse_loss(self.decoder(z), target)
        self.log("loss", loss, prog_bar=True)
        return loss

    def predict_step(self, batch, batch_idx):
        ids, _ = batch
        return self.decoder(self.latents.lookup(ids))

    def configure_optimizers(self):
        return torch.optim.Adam(self.decoder.parameters(), lr=1e-3)


def synthetic(samples: int = SAMPLES, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randn(samples, 8, generator=g)
    mix = torch.randn(8, OUT, generator=g)
    return TensorDataset(torch.arange(samples), torch.tanh(codes @ mix))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--device-mib", type=float, default=None,
                        help="GPU memory for the rows and their moments (default: the whole table if it fits)")
    args = parser.parse_args(argv)
    device_bytes = None if args.device_mib is None else int(args.device_mib * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoDecoder(f"{tmp}/latents", args.samples, device_bytes)
        trainer = L.Trainer(max_epochs=args.epochs, accelerator="cuda" if args.gpu else "cpu", devices=1,
                            precision="bf16-mixed" if args.gpu else "32-true", logger=False,
                            enable_checkpointing=False,
                            callbacks=[DeferredSync(every_n_epochs=1), StepProfiler(log_every_n_steps=50)])
        data = synthetic(args.samples)
        trainer.fit(model, DataLoader(data, batch_size=512, shuffle=True))
        meta = model.latents.row_meta(torch.arange(args.samples))
        print(f"rows trained: {int((meta['updates'] > 0).sum())} of {args.samples}; "
              f"store: {model.latents.stats().disk_bytes / 2**20:.1f} MiB on disk")
        # predict reads the trained codes (under inference mode); lookup without grad is get
        predicted = torch.cat(trainer.predict(model, DataLoader(data, batch_size=4096)))
        print(f"predict: mean squared error {torch.nn.functional.mse_loss(predicted, data.tensors[1]):.4f}")
        model.latents.close()


if __name__ == "__main__":
    main()
