"""Host time StepProfiler adds to one training step, measured the same way for any version of it.

``own_cost_us`` (bench/profiler.py) drives the profiler's current boundaries on a stub trainer;
this drives whatever a version registers, so two versions can be compared interleaved
(``git worktree add --detach /tmp/old REV``, then ``PYTHONPATH=/tmp/old``): a real, unfitted
Trainer with the profiler set up on it (``setup``, ``on_train_start``, an epoch begun), then the
profiler actions of one automatic-optimization step in the order Lightning 2.6 opens them, each
per-step callback hook called where callable, as Lightning's ``_call_callback_hooks`` does (an
action named after ``state_key`` around the call). Best of 5 loops of ``steps`` steps.

    python -m benchmarks.profiler_own_step [--steps 4000] [--plain-callback]

Prints microseconds per step: ``passthrough_us`` (Lightning's default profiler, no
StepProfiler), ``empty_tap_us`` (a tap with no hooks), ``with_sp_us``; ``own_us`` is
``with_sp_us - empty_tap_us`` (StepProfiler's part), ``vs_passthrough_us`` what a user sees
against no profiler. ``--plain-callback`` adds one callback with Lightning's no-op hooks to every
configuration (Lightning's default progress bar and model summary are such callbacks).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.profilers import PassThroughProfiler

from lightning_embcache import StepProfiler
from lightning_embcache.profiling.tap import ProfilerTap


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)


def _trainer(with_profiler: bool, plain_callback: bool) -> tuple[L.Trainer, L.LightningModule, list]:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
                        log_every_n_steps=10**9)
    module = _Module()
    trainer.strategy._lightning_module = module  # attached as fit() would, without fitting
    module._trainer = trainer
    callbacks: list = [L.Callback()] if plain_callback else []
    if with_profiler:
        sp = StepProfiler(report=False, log_every_n_steps=10**9)
        callbacks = [sp, *callbacks]
    trainer.callbacks = list(callbacks)
    if with_profiler:
        sp.setup(trainer, module, "fit")
        sp.on_train_start(trainer, module)
        sp._start_epoch(trainer, module)
    return trainer, module, callbacks


def lightning_step(trainer: Any, module: Any, callbacks: list, profiler: Any = None) -> Callable[[], None]:
    """One automatic-optimization step's profiler actions in Lightning 2.6's order, with
    ``callbacks``' hooks dispatched as Lightning's ``_call_callback_hooks`` does, through
    ``profiler`` (default: ``trainer.profiler``). ``trainer`` needs ``strategy``, ``fit_loop``
    (with ``epoch_loop._results``) and ``lightning_module``."""
    prof = trainer.profiler if profiler is None else profiler
    strategy, name = type(trainer.strategy).__name__, type(module).__name__
    fetch = f"[{type(trainer.fit_loop.epoch_loop).__name__}].train_dataloader_next"
    results = trainer.fit_loop.epoch_loop._results
    batch = (torch.zeros(4, 2), torch.zeros(4, 1))

    def hooks(hook: str, *args: Any) -> None:  # Lightning's _call_callback_hooks
        for cb in callbacks:
            fn = getattr(cb, hook)
            if callable(fn):
                with prof.profile(f"[Callback]{cb.state_key}.{hook}"):
                    fn(trainer, trainer.lightning_module, *args)

    def lm(hook: str) -> Any:
        return prof.profile(f"[LightningModule]{name}.{hook}")

    def st(hook: str) -> Any:
        return prof.profile(f"[Strategy]{strategy}.{hook}")

    def step() -> None:
        p = prof
        p.start(fetch)
        p.stop(fetch)
        with st("batch_to_device"):
            pass
        results.batch = batch
        hooks("on_train_batch_start", batch, 0)
        with lm("on_train_batch_start"), st("on_train_batch_start"):
            pass
        with p.profile("run_training_batch"), lm("optimizer_step"):
            with st("training_step"):
                pass
            hooks("on_before_zero_grad", None)
            with lm("on_before_zero_grad"), lm("optimizer_zero_grad"):
                pass
            with st("backward"):
                hooks("on_before_backward", None)
                with lm("on_before_backward"):
                    pass
                hooks("on_after_backward")
                with lm("on_after_backward"):
                    pass
            hooks("on_before_optimizer_step", None)
            with lm("on_before_optimizer_step"), lm("configure_gradient_clipping"):
                pass
        hooks("on_train_batch_end", None, batch, 0)
        with lm("on_train_batch_end"):
            pass
        results.batch = None
    return step


def best_of_5_us(fn: Callable[[], None], n: int) -> float:
    """Microseconds per call of ``fn``, the best of 5 loops of ``n`` calls: the least disturbed by
    other processes."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return 1e6 * best


def measure(steps: int = 4000, plain_callback: bool = False) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        passthrough = lightning_step(*_trainer(False, plain_callback))
        trainer, module, callbacks = _trainer(False, plain_callback)
        trainer.profiler = ProfilerTap(PassThroughProfiler(), {}, {})
        empty_tap = lightning_step(trainer, module, callbacks)
        trainer, module, callbacks = _trainer(True, plain_callback)
        with_sp = lightning_step(trainer, module, callbacks)
    out = {"passthrough_us": best_of_5_us(passthrough, steps), "empty_tap_us": best_of_5_us(empty_tap, steps),
           "with_sp_us": best_of_5_us(with_sp, steps)}
    sp = callbacks[0]
    assert sp._timeline.steps_closed > 4 * steps  # the profiler saw every step
    sp._ledger.fold()
    assert all(sp._ledger.open.host_phase_s[i] > 0 for i in range(4))  # data, forward, backward, optimizer
    out["own_us"] = out["with_sp_us"] - out["empty_tap_us"]
    out["vs_passthrough_us"] = out["with_sp_us"] - out["passthrough_us"]
    return {k: round(v, 2) for k, v in out.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--plain-callback", action="store_true")
    args = ap.parse_args()
    print(json.dumps(measure(args.steps, args.plain_callback)))
