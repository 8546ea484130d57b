"""A user's own Dataset trained with ResumableLoader (or a plain shuffled DataLoader), as a subprocess
the resume test SIGKILLs mid-epoch, or in-process for the runs that are not killed.

    python tests/lightning/_own_dataset_script.py ROOT --loader resumable|plain [--resume CKPT] [--step-sleep S]

Prints ``STEP n`` after every step; at the end saves the parameters to ROOT/final.pt.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_embcache import EmbeddingStoreMixin, ResumableLoader

SAMPLES, BATCH, STEPS, CKPT_EVERY = 600, 64, 30, 7  # 10 batches an epoch (the last one short)


class Molecules(Dataset):
    """A user's own map-style dataset: sample i is (its id, a target computed from i)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        return i, torch.randn(4, generator=g)


class Codes(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, root: Path, hot_bytes: int | None):
        super().__init__()
        self.codes = self.add_embedding_store("codes", num_rows=SAMPLES, dim=8, path=root / "codes", init="normal",
                                              hot_bytes=hot_bytes, optimizer="adam", lr=0.05)
        self.head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return F.mse_loss(self.head(self.codes.lookup(ids)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.head.parameters(), lr=1e-2)


class Report(Callback):
    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        print(f"STEP {trainer.global_step}", flush=True)
        if self.sleep:
            time.sleep(self.sleep)


def loader_for(kind: str, workers: int = 0):
    if kind == "resumable":
        return ResumableLoader(Molecules(), batch_size=BATCH, shuffle=True, seed=7, num_workers=workers)
    return DataLoader(Molecules(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7),
                      num_workers=workers)


def train(root: Path, kind: str, resume: str | None = None, step_sleep: float = 0.0, hot_bytes: int | None = None,
          workers: int = 0) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        L.seed_everything(0, verbose=False)
        model = Codes(root, hot_bytes)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            callbacks=[Report(step_sleep),
                                       ModelCheckpoint(dirpath=root / "checkpoints", filename="{step}",
                                                       every_n_train_steps=CKPT_EVERY, save_top_k=-1)])
        trainer.fit(model, loader_for(kind, workers), ckpt_path=resume)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "final.pt")
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--loader", default="resumable")
    p.add_argument("--resume")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hot-bytes", type=int, default=0)
    p.add_argument("--workers", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    train(Path(args.root), args.loader, args.resume, args.step_sleep, args.hot_bytes or None, args.workers)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
