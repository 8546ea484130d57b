"""Codes for unseen samples: train an auto-decoder, then fit codes for new samples with the decoder frozen.

    python examples/fit_new_samples.py              # CPU, well under a minute

What DeepSDF calls inference and NeRF-style pipelines call test-time optimisation of appearance
codes: the decoder has been trained with the codes of the training samples; for new samples (test
shapes, test views) only their codes are optimised, against the frozen decoder.

1. Train codes + decoder on the first ``--samples`` samples (ids ``0 .. samples-1``): a table of
   ``samples`` rows.
2. The ``--new`` unseen samples arrive: ``codes.grow(samples + new)`` adds their rows (ids
   ``samples .. samples+new-1``, initial values as a table made at that size would hold them).
   Fit their codes with a Lightning ``Trainer``: the decoder is frozen (``requires_grad_(False)``),
   the only optimizer is the rows' own (``codes.optimizer.as_torch_optimizer()``), and only the new
   ids are looked up, so the trained rows are untouched, bit for bit.
3. Read the new codes back (``export`` writes every code to a ``.npy`` for inference).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import EmbeddingStoreMixin

DIM, OUT = 16, 32


def make_targets(n: int, seed: int = 0) -> torch.Tensor:
    """Samples from one smooth generator: a true code per sample through a fixed random MLP."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randn(n, DIM, generator=g)
    w1, w2 = torch.randn(DIM, 64, generator=g) / DIM ** 0.5, torch.randn(64, OUT, generator=g) / 8
    return torch.tanh(codes @ w1) @ w2


class AutoDecoder(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path: str, num_rows: int, ids: torch.Tensor, targets: torch.Tensor, *,
                 freeze_decoder: bool = False, if_exists: str = "error") -> None:
        super().__init__()
        self.codes = self.add_embedding_store("codes", num_rows=num_rows, dim=DIM, path=path, init="normal",
                                              init_std=0.01, optimizer="adam", lr=3e-2, if_exists=if_exists)
        self.decoder = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, OUT))
        self.ids, self.targets, self.freeze_decoder = ids, targets, freeze_decoder
        if freeze_decoder:
            self.decoder.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        ids, y = batch
        loss = torch.nn.functional.mse_loss(self.decoder(self.codes.lookup(ids)), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        if self.freeze_decoder:   # the rows' own optimizer only: nothing else may move
            return self.codes.optimizer.as_torch_optimizer()
        return torch.optim.Adam(self.decoder.parameters(), lr=3e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.ids, self.targets), batch_size=64, shuffle=True,
                          generator=torch.Generator().manual_seed(1))


def loss_of(model: AutoDecoder, ids: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model.decoder(model.codes.get(ids)), targets))


def trainer(root: Path, epochs: int) -> L.Trainer:
    return L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--new", type=int, default=200)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--fit-epochs", type=int, default=30)
    p.add_argument("--root", default=None, help="where the store and the exported codes go (default: a temp dir)")
    args = p.parse_args(argv)
    root = Path(args.root or tempfile.mkdtemp(prefix="fit-new-samples-"))
    total = args.samples + args.new
    targets = make_targets(total)
    train_ids, new_ids = torch.arange(args.samples), torch.arange(args.samples, total)
    path = str(root / "codes")

    # 1. codes and decoder, on the training samples: a table of exactly those rows
    model = AutoDecoder(path, args.samples, train_ids, targets[train_ids])
    trainer(root, args.epochs).fit(model)
    trained = model.codes.get(train_ids)
    print(f"trained on {args.samples} samples: loss {loss_of(model, train_ids, targets[train_ids]):.4f}")
    model.codes.close()

    # 2. the new samples arrive: rows for them, then their codes only, decoder frozen
    fit = AutoDecoder(path, args.samples, new_ids, targets[new_ids], freeze_decoder=True, if_exists="resume")
    fit.decoder.load_state_dict(model.decoder.state_dict())
    fit.codes.grow(total)  # durable with the fit's flushes
    before = loss_of(fit, new_ids, targets[new_ids])
    print(f"grew the table to {fit.codes.num_rows} rows; {args.new} unseen samples with untrained codes: "
          f"loss {before:.4f}")
    decoder_before = {k: v.clone() for k, v in fit.decoder.state_dict().items()}
    trainer(root, args.fit_epochs).fit(fit)
    after = loss_of(fit, new_ids, targets[new_ids])
    untouched = torch.equal(fit.codes.get(train_ids), trained)
    frozen = all(torch.equal(v, decoder_before[k]) for k, v in fit.decoder.state_dict().items())
    print(f"fitted {args.new} new codes with the decoder frozen: loss {before:.4f} -> {after:.4f}; "
          f"trained rows untouched bit for bit: {untouched}; decoder unchanged: {frozen}")

    # 3. every code out, for inference
    out = fit.codes.store.export(root / "codes.npy", overwrite=True)
    codes = np.load(out, mmap_mode="r")
    print(f"exported {codes.shape[0]} x {codes.shape[1]} codes to {out}")
    fit.codes.close()
    return {"before": before, "after": after, "untouched": float(untouched), "frozen": float(frozen),
            "exported_rows": float(codes.shape[0])}


if __name__ == "__main__":
    main()
