"""What the Trainer will still run, read from its settings: batches left in the epoch and the fit,
validation runs, checkpoint saves. Used by the epoch-time prediction."""

from __future__ import annotations

import math
from typing import Any

import torch


def _finite_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return int(v) if math.isfinite(v) and v >= 0 else None


def batch_budget(trainer: Any) -> int | None:
    """Training batches the fit may still run under ``max_steps`` (None: no step limit)."""
    max_steps = _finite_int(getattr(trainer, "max_steps", -1))
    if max_steps is None or getattr(trainer, "max_steps", -1) == -1:
        return None
    acc = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
    return max(0, max_steps - int(trainer.global_step)) * acc


def epochs_left(trainer: Any) -> int | None:
    """Epochs after the current one under ``max_epochs`` (None: no epoch limit)."""
    max_epochs = getattr(trainer, "max_epochs", None)
    if max_epochs is None or max_epochs == -1:
        return None
    return max(0, int(max_epochs) - int(trainer.current_epoch) - 1)


def val_runs(trainer: Any, epoch: int, first_batch: int, last_batch: int, total_before: int = 0) -> int | None:
    """Validation runs Lightning starts after batches ``first_batch .. last_batch - 1`` of
    ``epoch`` (the rule of ``_TrainingEpochLoop._should_check_val_fx``); None when they follow
    wall-clock time (``val_check_interval`` as a duration) and cannot be counted ahead."""
    if last_batch <= first_batch:
        return 0
    try:
        if not trainer.enable_validation:
            return 0
    except Exception:  # no val loop attached (a stub trainer)
        return 0
    every = getattr(trainer, "check_val_every_n_epoch", 1)
    if every is not None and (epoch + 1) % every:
        return 0
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return None
    vcb = getattr(trainer, "val_check_batch", None)
    if vcb is None:
        return None
    if not math.isfinite(float(vcb)):
        return 1 if last_batch >= (_finite_int(trainer.num_training_batches or 0) or 0) else 0
    vcb = int(vcb)
    if every is None:  # counted over the fit's batches
        a, b = total_before + first_batch, total_before + last_batch
    else:
        a, b = first_batch, last_batch
    return b // vcb - a // vcb


def _save_intervals(trainer: Any) -> list[int]:
    """The ``every_n_train_steps`` of each ``ModelCheckpoint`` that saves by optimizer steps."""
    out = []
    for cb in getattr(trainer, "checkpoint_callbacks", []) or []:
        every = int(getattr(cb, "_every_n_train_steps", 0) or 0)
        if every > 0:
            out.append(every)
    return out


def saves(trainer: Any, first_step: int, last_step: int) -> int:
    """Checkpoint saves ``ModelCheckpoint(every_n_train_steps=n)`` makes at optimizer steps
    ``first_step + 1 .. last_step``."""
    if last_step <= first_step:
        return 0
    return sum(last_step // every - first_step // every for every in _save_intervals(trainer))


def save_batches(trainer: Any, first_step: int, last_step: int, done: int, acc: int) -> list[int]:
    """Batches of the epoch (``done`` of them run at optimizer step ``first_step``) during which
    those saves happen (the step after the one that reaches its optimizer step, as the forecast
    marks saves), up to optimizer step ``last_step``."""
    out: list[int] = []
    if last_step > first_step:
        for every in _save_intervals(trainer):
            first = (first_step // every + 1) * every
            last = min(last_step, first + every * 100_000)  # an epoch's worth at most
            out += [done + (g - first_step) * acc for g in range(first, last + 1, every)]
    return sorted(out)


def checkpoint_bytes(trainer: Any) -> int:
    """Bytes of tensors a checkpoint of ``trainer`` writes: the module's state (parameters and
    buffers) and every optimizer's state (moments, step counters). Embedding stores flush their
    own rows to their folder, outside the checkpoint file: not counted."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    module = trainer.lightning_module
    if module is not None:
        for t in module.parameters():
            add(t)
        for t in module.buffers():
            add(t)
    for opt in getattr(trainer, "optimizers", None) or []:
        for state in opt.state.values():
            for v in state.values():
                add(v)
    return total
