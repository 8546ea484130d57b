"""What a step's boundaries look like from outside Lightning's loop: the profiler actions that
bracket the loader's ``next()``, the host-to-device transfer and the optimizer step, and the batch
size of a batch."""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.utilities.data import extract_batch_size

Hook = Callable[[], None]


def loop_actions(trainer: Any, *, fetch: tuple[Hook, Hook], transfer: tuple[Hook, Hook], auto_step_stop: Hook,
                 manual_step: tuple[Hook, Hook]) -> tuple[dict[str, Hook], dict[str, Hook]]:
    """``(on_start, on_stop)``: action name -> hook, for a
    :class:`~lightning_embcache.profiling.tap.ProfilerTap` on ``trainer``'s profiler. Each pair is
    (called at the action's start, called at its stop)."""
    loop_name = type(trainer.fit_loop.epoch_loop).__name__
    strategy = type(trainer.strategy).__name__
    module = type(trainer.lightning_module).__name__
    fetch_action = f"[{loop_name}].train_dataloader_next"
    transfer_action = f"[Strategy]{strategy}.batch_to_device"
    on_start = {fetch_action: fetch[0], transfer_action: transfer[0], "optimizer_step": manual_step[0]}
    on_stop = {fetch_action: fetch[1], transfer_action: transfer[1],
               f"[LightningModule]{module}.optimizer_step": auto_step_stop, "optimizer_step": manual_step[1]}
    return on_start, on_stop


def batch_size(batch: Any) -> int:
    """Lightning's ``extract_batch_size`` (about 10 us) with a fast path for the common layouts."""
    # exact types first (a check each; shape[0] costs half of size(0)); subclasses below
    kind = type(batch)
    if kind is torch.Tensor:
        shape = batch.shape
        return shape[0] if shape else 1
    if (kind is tuple or kind is list) and batch and type(batch[0]) is torch.Tensor:
        shape = batch[0].shape
        if shape:
            return shape[0]
    if isinstance(batch, torch.Tensor):
        return batch.size(0) if batch.ndim else 1
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].ndim:
        return batch[0].size(0)
    return extract_batch_size(batch)
