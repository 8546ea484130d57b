"""A memory bank of per-sample features, updated by momentum (EMA), with random negatives.

Instance discrimination (Wu et al., 2018): an encoder maps each sample to a unit vector; the bank
keeps one slowly moving unit vector per sample. The loss pulls a sample's feature towards its own
bank row and pushes it from `--negatives` rows drawn at random from the whole bank. After each
step the sample's bank row moves towards the new feature (`ema_update`, momentum 0.5) — a direct
write, no gradient. The bank lives in an `EmbeddingStore` on disk with a RAM budget, so it can
hold far more samples than fit in memory; the rows of random negatives come from any chunk, which
is the access pattern that budget has to serve.

    python examples/memory_bank.py                       # 20k samples, 3 epochs, about a minute on CPU
    python examples/memory_bank.py --samples 2000 --epochs 1

At the end it classifies fresh views of the samples by their nearest bank row (a kNN probe the
encoder never saw labels for); chance is 1 / --classes.
"""

from __future__ import annotations

import argparse
import tempfile

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_embcache import DeferredSync, EmbeddingStoreMixin
from lightning_embcache.optim import ema_update


class Views(Dataset):
    """Sample i: a noisy view of one of `classes` prototypes (the label is never used for training)."""

    def __init__(self, n: int, classes: int, in_dim: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (n,), generator=g)
        prototypes = torch.randn(classes, in_dim, generator=g) * 2
        self.base = prototypes[self.labels] + 0.5 * torch.randn(n, in_dim, generator=g)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.base[i] + 0.3 * torch.randn_like(self.base[i])  # a fresh augmentation each time


class InstanceDiscrimination(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, num_samples: int, path: str, dim: int = 32, negatives: int = 256,
                 temperature: float = 0.1, momentum: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        # one unit vector per sample, initialised at random on the sphere, updated by EMA
        self.bank = self.add_embedding_store("bank", num_rows=num_samples, dim=dim, path=path, init="normal",
                                             hot_bytes=1 << 20, chunk_rows=256, if_exists="overwrite")
        self.encoder = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.encoder(x), dim=-1)

    def training_step(self, batch, batch_idx):
        ids, x = batch
        h = self.hparams
        f = self(x)                                                    # (B, dim), unit norm
        positive = F.normalize(self.bank.get(ids), dim=-1)             # (B, dim)
        neg_ids = torch.randint(0, h.num_samples, (h.negatives,))      # shared random negatives
        negative = F.normalize(self.bank.get(neg_ids), dim=-1)         # (K, dim)
        logits = torch.cat([(f * positive).sum(-1, keepdim=True), f @ negative.T], dim=1) / h.temperature
        loss = F.cross_entropy(logits, torch.zeros(len(ids), dtype=torch.long, device=logits.device))
        # momentum update of this batch's rows: v <- normalize(m * v + (1 - m) * f)
        self.bank.update(ids, ema_update(positive, f.detach(), momentum=h.momentum, normalize=True))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.encoder.parameters(), lr=1e-3)


@torch.no_grad()
def knn_accuracy(model: InstanceDiscrimination, data: Views, probe: int = 1000) -> float:
    """Nearest bank row (excluding the sample itself) for fresh views of `probe` samples: same class?"""
    bank = F.normalize(model.bank.get(torch.arange(len(data))), dim=-1)
    labels = data.labels
    ids = torch.arange(min(probe, len(data)))
    views = torch.stack([data[int(i)][1] for i in ids])
    sims = model(views) @ bank.T
    sims[torch.arange(len(ids)), ids] = -2.0  # its own row would be trivial
    return float((labels[sims.argmax(1)] == labels[ids]).float().mean())


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--negatives", type=int, default=256)
    p.add_argument("--root", default=None, help="where the bank is stored (default: a temporary folder)")
    args = p.parse_args(argv)
    L.seed_everything(0, verbose=False)
    data = Views(args.samples, args.classes)
    with tempfile.TemporaryDirectory() as tmp:
        model = InstanceDiscrimination(args.samples, f"{args.root or tmp}/bank", negatives=args.negatives)
        before = knn_accuracy(model, data)
        trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_model_summary=False, enable_progress_bar=False,
                            callbacks=[DeferredSync(every_n_steps=50)])
        trainer.fit(model, DataLoader(data, batch_size=256, shuffle=True))
        after = knn_accuracy(model, data)
        stats = model.bank.stats()
        print(f"kNN accuracy through the bank: {before:.1%} before training, {after:.1%} after "
              f"(chance {1 / args.classes:.0%}); bank version {stats.version}, "
              f"{stats.disk_bytes / 2**20:.1f} MiB on disk")
        model.bank.close()
    return {"before": before, "after": after}


if __name__ == "__main__":
    main()
