"""A training run the resume tests start as a subprocess (and SIGKILL): the demo's AutoDecoder, tiny.

    python tests/lightning/_lightning_train_script.py ROOT --steps N --ckpt-every K [--resume CKPT] [--step-sleep S]

Prints ``STEP n`` after every step and ``SAVING n`` before every checkpoint, flushed, so the parent can
kill it at a chosen moment; at the end saves the parameters to ROOT/final.pt. Tests also call
`train` in-process (same code, same single thread) for the runs that are not killed.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_embcache import DeferredSync
from lightning_embcache.demo import AutoDecoder

SAMPLES, BATCH = 512, 64  # 8 steps per epoch: checkpoints fall mid-epoch


def model_for(root: Path, hot_bytes: int | None) -> AutoDecoder:
    return AutoDecoder(num_samples=SAMPLES, code_dim=16, out_dim=8, hidden=32, store_path=str(root / "latents"),
                       hot_bytes=hot_bytes, batch_size=BATCH, num_workers=0, seed=3, latent_init="normal")


class Report(Callback):
    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        print(f"STEP {trainer.global_step}", flush=True)
        if self.sleep:
            time.sleep(self.sleep)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        print(f"SAVING {trainer.global_step}", flush=True)


def train(root: Path, steps: int, ckpt_every: int = 5, resume: str | None = None, step_sleep: float = 0.0,
          background: bool = True, hot_bytes: int | None = None) -> AutoDecoder:
    """Train (or resume) to `steps`; saves the parameters to root/final.pt and returns the model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        L.seed_everything(0, verbose=False)
        model = model_for(root, hot_bytes)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=root,
            callbacks=[
                Report(step_sleep),
                DeferredSync(every_n_steps=2, background=background),
                ModelCheckpoint(dirpath=root / "checkpoints", filename="{step}", every_n_train_steps=ckpt_every,
                                save_top_k=-1),
            ],
        )
        trainer.fit(model, ckpt_path=resume)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "final.pt")
    finally:
        torch.set_num_threads(threads)
    return model


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--resume")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--background", type=int, default=1)
    p.add_argument("--hot-bytes", type=int, default=0, help="0: whole table resident (memory mode)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    train(Path(args.root), args.steps, args.ckpt_every, args.resume, args.step_sleep, bool(args.background),
          args.hot_bytes or None)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
