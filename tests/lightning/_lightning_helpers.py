"""Small models and trainers shared by the Lightning-layer tests."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_embcache.demo import AutoDecoder  # noqa: E402

SAMPLES, BATCH = 512, 64  # 8 steps per epoch

warnings.filterwarnings("ignore", message=".*manual optimization and every_n_train_steps.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def tiny_model(store_path: Path | str | None, hot_bytes: int | None = None, **kw: Any) -> AutoDecoder:
    """A 512 x 16 latent table; memory mode (hot_bytes=None) unless a budget is given."""
    args = dict(num_samples=SAMPLES, code_dim=16, out_dim=8, hidden=32, batch_size=BATCH, num_workers=0, seed=3,
                latent_init="normal")
    args.update(kw)
    return AutoDecoder(store_path=None if store_path is None else str(store_path), hot_bytes=hot_bytes, **args)


def tiny_trainer(root: Path, callbacks: list[Callback] | None = None, **kw: Any) -> L.Trainer:
    args = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, default_root_dir=root)
    args.update(kw)
    return L.Trainer(callbacks=callbacks or [], **args)


def all_rows(handle_or_store: Any) -> torch.Tensor:
    return handle_or_store.get(torch.arange(handle_or_store.num_rows if hasattr(handle_or_store, "num_rows") else SAMPLES))


class RecordRows(Callback):
    """Snapshots every row at each checkpoint save, keyed by global step."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.rows[trainer.global_step] = pl_module.latents.get(torch.arange(pl_module.latents.num_rows))
