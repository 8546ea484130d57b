"""Profile a small training run with StepProfiler and read where the step time goes.

    python examples/profile_training.py [--workers 2] [--load-ms 2] [--plot phases.png]

The dataset costs `--load-ms` per batch to produce (standing in for decoding), a callback adds
some per-batch loop work (standing in for logging), and the model is a small MLP. The printed
table splits each step into data_wait, forward, backward, optimizer, store_io and other, and
compares each epoch's wall time with what the profiler predicted after 5% of it; see
docs/profiler.md for how to read both.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_embcache import StepProfiler


class SlowBatches(Dataset):
    def __init__(self, n: int, load_ms: float) -> None:
        self.n, self.load_s = n, load_ms / 1e3

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.load_s:  # CPU work, like decoding
            pass
        x = torch.randn(64, 128)
        return x, x.sum(1, keepdim=True)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class BusyLoop(L.Callback):
    """Per-batch work between batches (what logging and progress bars cost): shows up as 'other'."""

    def __init__(self, ms: float) -> None:
        self.s = ms / 1e3

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--load-ms", type=float, default=2.0)
    ap.add_argument("--loop-ms", type=float, default=1.0)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()

    # a callback (not Trainer(profiler=...)); it logs every Trainer(log_every_n_steps) batches
    profiler = StepProfiler(warmup_steps=10, plot=args.plot)
    trainer = L.Trainer(max_epochs=args.epochs, callbacks=[profiler, BusyLoop(args.loop_ms)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=50)
    loader = DataLoader(SlowBatches(args.batches, args.load_ms), batch_size=None, num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    trainer.fit(Model(), loader)

    last = profiler.summary()[-1]
    print(f"\nlast epoch: {last['batches']} batches in {last['epoch_seconds']:.2f} s "
          f"-> true average {last['avg_batch_ms']:.2f} ms/batch (steady {last['steady_batch_ms']:.2f})")
    for phase, ms in last["phases_ms"].items():
        print(f"  {phase:<10} {ms:7.3f} ms")
    for e in profiler.summary():
        if e["predicted_epoch_seconds"] is not None:
            print(f"epoch {e['epoch']}: predicted {e['predicted_epoch_seconds']:.2f} s (90% interval "
                  f"{e['predicted_epoch_low_seconds']:.2f}-{e['predicted_epoch_high_seconds']:.2f} s) after "
                  f"{e['predicted_at_batch']} batches, took {e['epoch_wall_seconds']:.2f} s "
                  f"({e['prediction_error_pct']:+.1f}%)")
    # the same phase the end-of-fit table names: the last epoch's
    print(f"dominant: {last['dominant_phase']}; try --workers 2 when it is data_wait (docs/profiler.md)")
    if last["slow_steps"] is not None:
        print(f"last epoch's slow steps: {last['slow_steps']['reason']}")


if __name__ == "__main__":
    main()
