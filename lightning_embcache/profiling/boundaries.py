"""What a step's boundaries look like from outside Lightning's loop: the profiler actions that
bracket the loader's ``next()``, the host-to-device transfer, the batch, backward and the
optimizer step, and the batch size of a batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size

Hook = Callable[[], None]


def loop_actions(trainer: Any, *, fetch: tuple[Hook, Hook], transfer: tuple[Hook, Hook], batch: tuple[Hook, Hook],
                 backward: Hook, after_backward: Hook | None, before_optimizer_step: Hook, auto_step_stop: Hook,
                 manual_step: tuple[Hook, Hook]) -> tuple[dict[str, Hook], dict[str, Hook]]:
    """``(on_start, on_stop)``: action name -> hook, for a
    :class:`~lightning_embcache.profiling.tap.ProfilerTap` on ``trainer``'s profiler. Pairs are
    (called at the action's start, called at its stop); ``after_backward`` (manual optimization:
    back to the user's code) may be None.

    Every phase boundary of a step is an action Lightning opens anyway, so the profiler needs no
    per-step callback hook (each costs the loop about a microsecond): the batch's
    ``run_training_batch`` (forward starts; its end is the batch's end), the LightningModule's own
    ``on_before_backward`` / ``on_after_backward`` / ``on_before_optimizer_step`` hooks (Lightning
    calls them on every module, under automatic and manual optimization, on every strategy and
    precision plugin, right after the callbacks' hooks of the same name), and the optimizer step's
    action (its return)."""
    loop_name = type(trainer.fit_loop.epoch_loop).__name__
    strategy = type(trainer.strategy).__name__
    module = f"[LightningModule]{type(trainer.lightning_module).__name__}."
    fetch_action = f"[{loop_name}].train_dataloader_next"
    transfer_action = f"[Strategy]{strategy}.batch_to_device"
    on_start = {fetch_action: fetch[0], transfer_action: transfer[0], "run_training_batch": batch[0],
                module + "on_before_backward": backward, module + "on_before_optimizer_step": before_optimizer_step,
                "optimizer_step": manual_step[0]}
    if after_backward is not None:
        on_start[after_backward_action(trainer)] = after_backward
    on_stop = {fetch_action: fetch[1], transfer_action: transfer[1], "run_training_batch": batch[1],
               module + "optimizer_step": auto_step_stop, "optimizer_step": manual_step[1]}
    return on_start, on_stop


def first_callback_actions(trainer: Any, hooks: tuple[str, ...], skip: type) -> dict[str, str]:
    """hook -> the action of the first callback (none of type ``skip``) Lightning calls that hook
    on, in ``trainer.callbacks`` order: where the callbacks' part of a boundary begins. A phase
    that starts there holds every callback's hook of that name, wherever the profiler sits in
    the list (as when it sat first and used hooks of its own)."""
    out = {}
    for hook in hooks:
        for cb in trainer.callbacks:
            if not isinstance(cb, skip) and callable(getattr(cb, hook, None)):
                out[hook] = f"[Callback]{cb.state_key}.{hook}"
                break
    return out


def after_backward_action(trainer: Any) -> str:
    """The action of the LightningModule's ``on_after_backward`` hook."""
    return f"[LightningModule]{type(trainer.lightning_module).__name__}.on_after_backward"


def loop_batch(trainer: Any) -> Any:
    """The object whose ``batch`` attribute holds the training batch from Lightning's transfer to
    the batch's end (the training loop's result collection; Lightning points it at each batch for
    ``self.log``), or None where this Lightning has none: then the batch size needs the
    ``on_train_batch_start`` hook."""
    results = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_results", None)
    return results if results is not None and hasattr(results, "batch") else None


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
