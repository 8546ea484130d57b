"""An auto-decoder on your own module: one trainable latent code per sample, kept in an EmbeddingStore.

The per-sample table lives on disk with a RAM budget instead of in an nn.Embedding, is flushed by
DeferredSync without stalling the step, shrinks under memory pressure, and is checkpointed exactly
(the checkpoint names a store version; resuming reopens that version).

    python examples/autodecoder.py                 # 100k samples, 2 epochs, evaluation, then a resume
    python examples/autodecoder.py --samples 1000000 --epochs 1 --root runs/example
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_embcache import DeferredSync, EmbeddingStoreMixin, MemoryPressure


class Targets(Dataset):
    """Your data: here sample i is a 32-dim vector, returned with its index (the row id)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.tanh(torch.randn(n, 8, generator=g) @ torch.randn(8, 32, generator=g))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.x[i]


class AutoDecoder(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, num_samples: int, code_dim: int = 64, store_path: str = "runs/example/latents",
                 hot_bytes: int | None = 16 << 20, latent_lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False  # the codes are written directly, the decoder uses Adam
        self.latents = self.add_embedding_store("latents", num_samples, code_dim, path=store_path,
                                                hot_bytes=hot_bytes, chunk_rows=1024, init="normal", init_std=0.01)
        self.decoder = nn.Sequential(nn.Linear(code_dim, 128), nn.ReLU(), nn.Linear(128, 32))

    def training_step(self, batch, batch_idx):
        ids, x = batch
        z = self.latents.get(ids).requires_grad_()  # rows on the module's device
        loss = F.mse_loss(self.decoder(z), x)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        with torch.no_grad():
            self.latents.update(ids, z - self.hparams.latent_lr * len(ids) * z.grad)  # direct write
        self.log("loss", loss, prog_bar=True)

    def validation_step(self, batch, batch_idx):
        ids, x = batch
        # under inference mode (Lightning's default for validate/test/predict): reads the trained codes
        self.log("val_loss", F.mse_loss(self.decoder(self.latents.get(ids)), x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.decoder.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--root", default=None, help="an empty or new folder (default: a temporary one)")
    args = p.parse_args(argv)
    if args.root is None:
        with tempfile.TemporaryDirectory() as tmp:
            return run(args, Path(tmp))
    root = Path(args.root)
    if root.exists() and any(root.iterdir()):
        sys.exit(f"--root {root} is not empty; choose an empty or new folder")
    run(args, root)


def run(args: argparse.Namespace, root: Path) -> None:
    data = DataLoader(Targets(args.samples), batch_size=512, shuffle=True)

    def trainer(epochs: int) -> L.Trainer:
        return L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_model_summary=False,
                         callbacks=[DeferredSync(every_n_steps=100),        # durable every 100 batches
                                    MemoryPressure(check_every_n_steps=50),  # evict if RAM runs short
                                    ModelCheckpoint(dirpath=root / "checkpoints", save_top_k=-1)])

    model = AutoDecoder(args.samples, store_path=str(root / "latents"))
    trainer(args.epochs).fit(model, data)

    # After fit the handle still reads: evaluate, export the codes, or look at the store's figures.
    evaluation = DataLoader(Targets(args.samples), batch_size=2048)
    print("validate:", trainer(1).validate(model, evaluation, verbose=False))
    codes = model.latents.get(torch.arange(args.samples))
    print("codes", tuple(codes.shape), "mean norm", codes.norm(dim=1).mean().item())
    with model.latents as latents:  # close() at the end: flushes and releases the store for others
        store = latents.store
        print("store version", store.version, "versions", store.versions(), "pinned", store.pinned())

    # Resume from the first epoch's checkpoint: the store reopens at that checkpoint's version,
    # even though training flushed newer versions after it.
    first = sorted((root / "checkpoints").glob("epoch=0-*.ckpt"))[0]
    resumed = AutoDecoder(args.samples, store_path=str(root / "latents"))
    trainer(args.epochs).fit(resumed, data, ckpt_path=first)
    print("resumed from", first.name, "-> store version", resumed.latents.stats().version)


if __name__ == "__main__":
    main()
