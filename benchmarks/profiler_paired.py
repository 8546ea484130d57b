"""Overhead of a profiler resolved to a fraction of a percent: configurations interleaved in
short blocks of steps inside one fit (`embcache bench profiler --paired`).

Whole fits of the same model, one after another, differ by far more than 1% on a busy host (and
on the GPU host: -23% to +46% between identical fits), so a 1% cost cannot be read from their
medians. Here one fit runs every configuration: the steps are cut into blocks of ``block`` steps,
and each cycle of blocks runs each configuration once, in an order rotated from cycle to cycle
(a Latin square: no configuration always follows another or comes first). Per cycle, each
configuration's time per step is compared with the no-profiler block of the same cycle, a few
hundred milliseconds away: slow drifts of the host (clock, other processes, allocator) cancel.
Reported per configuration: the median of those per-cycle ratios with a bootstrap 95% confidence
interval, for the wall time and for the training thread's CPU time (its own work, which other
processes on the host do not inflate).

How one fit switches between configurations:

- a profiler switch as the Trainer's profiler routes each action to the active configuration's
  profiler: ``SimpleProfiler``, StepProfiler's pass-through tap, or a plain
  ``PassThroughProfiler`` (no profiler, ``ThroughputMonitor``); an action ends in the profiler
  it started in;
- a gate callback forwards fit- and epoch-level hooks to every callback, and the per-batch hooks
  only to the active configuration's (``ThroughputMonitor``, ``StepProfiler``);
- the block changes where a step starts (the loader's ``next()``), where the block's wall and
  thread CPU clocks are read.

The switch and the gate cost every configuration the same (one more call per action and hook),
which cancels in the ratios. A StepProfiler switched off for a block sees one long step (its
statistics are not the point here; its per-step work is).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ThroughputMonitor
from lightning.pytorch.profilers import PassThroughProfiler, Profiler, SimpleProfiler
from torch.utils.data import DataLoader

from benchmarks.profiler import MLP, MODELS, SleepyBatches
from lightning_embcache.profiling import StepProfiler

PAIRED_CONFIGS = ("none", "simple", "throughput", "step")
_BATCH_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_zero_grad",
                "on_before_optimizer_step", "on_train_batch_end")
_FIT_HOOKS = ("setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
              "on_train_epoch_start", "on_train_epoch_end", "on_exception")


class _Switch(Profiler):
    """The Trainer's profiler: forwards each action to the active configuration's profiler and
    starts a new block of steps every ``block`` loader fetches."""

    def __init__(self, block: int, order: list[list[str]], warmup_steps: int) -> None:
        super().__init__()
        self.block, self.order, self.warmup = block, order, warmup_steps
        self.targets: dict[str, Profiler] = {c: PassThroughProfiler() for c in PAIRED_CONFIGS}
        self.active = "none"
        self._started: dict[str, Profiler] = {}
        self.fetch_action = ""
        self.steps = 0
        self.blocks: list[tuple[str, int, float, float]] = []  # (config, cycle, wall at start, CPU at start)

    def _next_block(self) -> None:
        k = (self.steps - self.warmup) // self.block
        cycle, pos = divmod(k, len(PAIRED_CONFIGS))
        self.active = self.order[cycle % len(self.order)][pos]
        self.blocks.append((self.active, cycle, time.perf_counter(), time.thread_time()))

    def start(self, action_name: str) -> None:
        if action_name == self.fetch_action:
            if self.steps >= self.warmup and (self.steps - self.warmup) % self.block == 0:
                self._next_block()
            self.steps += 1
        target = self.targets[self.active]
        self._started[action_name] = target
        target.start(action_name)

    def stop(self, action_name: str) -> None:
        target = self._started.pop(action_name, None) or self.targets[self.active]
        target.stop(action_name)

    def profile(self, action_name: str) -> Any:
        return self.targets[self.active].profile(action_name)

    def summary(self) -> str:
        return ""

    def describe(self) -> None:
        pass

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        pass

    def teardown(self, stage: str | None) -> None:
        pass


class _Gate(Callback):
    """Forwards fit-level hooks to every callback and per-batch hooks to the active one."""

    def __init__(self, switch: _Switch, callbacks: dict[str, Callback]) -> None:
        self.switch, self.callbacks = switch, callbacks
        for name in _BATCH_HOOKS:
            setattr(self, name, self._batch_hook(name))
        for name in _FIT_HOOKS:
            if name not in ("setup", "teardown"):
                setattr(self, name, self._fit_hook(name))

    def _batch_hook(self, name: str) -> Any:
        def hook(trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
            cb = self.callbacks.get(self.switch.active)
            fn = getattr(cb, name, None)
            if callable(fn):
                # what Lightning's _call_callback_hooks costs a callback per hook: the action's
                # name (with the callback's state_key) and its profiler context
                with trainer.profiler.profile(f"[Callback]{cb.state_key}.{name}"):
                    fn(trainer, *args, **kwargs)
        return hook

    def _fit_hook(self, name: str) -> Any:
        def hook(*args: Any, **kwargs: Any) -> None:
            for cb in self.callbacks.values():
                fn = getattr(cb, name)
                if callable(fn):
                    fn(*args, **kwargs)
        return hook

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        sw = self.switch
        sw.fetch_action = f"[{type(trainer.fit_loop.epoch_loop).__name__}].train_dataloader_next"
        for name, cb in self.callbacks.items():
            # StepProfiler wraps the Trainer's profiler: give it the plain one, keep its tap
            trainer.profiler = sw.targets[name]
            cb.setup(trainer, pl_module, stage)
            sw.targets[name] = trainer.profiler
        trainer.profiler = sw

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for name, cb in self.callbacks.items():
            trainer.profiler = self.switch.targets[name]
            cb.teardown(trainer, pl_module, stage)
        trainer.profiler = self.switch


def _order(cycles: int, seed: int = 0) -> list[list[str]]:
    """A rotated order per cycle, shuffled rows of a Latin square."""
    n = len(PAIRED_CONFIGS)
    rows = [list(PAIRED_CONFIGS[i:] + PAIRED_CONFIGS[:i]) for i in range(n)]
    rng = random.Random(seed)
    out = []
    for c in range(cycles):
        if c % n == 0:
            rng.shuffle(rows)
        out.append(rows[c % n])
    return out


def _ci(values: list[float], stat: Any, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of ``stat`` over ``values``."""
    rng = random.Random(seed)
    n = len(values)
    boots = sorted(stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(reps))
    return boots[int(0.025 * reps)], boots[int(0.975 * reps) - 1]


def paired_fit(model_name: str, device: str = "cpu", batches: int = 8000, block: int = 20,
               warmup: int = 200, seed: int = 0) -> dict:
    """One fit with the configurations interleaved in blocks; per-cycle ratios to ``none``."""
    width, depth, batch, _, load_ms = MODELS[model_name]
    torch.manual_seed(0)
    cycles = (batches - warmup) // (block * len(PAIRED_CONFIGS))
    n = warmup + cycles * block * len(PAIRED_CONFIGS) + 1  # one more fetch closes the last block
    switch = _Switch(block, _order(cycles, seed), warmup)
    sp = StepProfiler(report=False)
    callbacks = {"throughput": ThroughputMonitor(batch_size_fn=lambda b: batch), "step": sp}
    simple = SimpleProfiler()
    switch.targets["simple"] = simple
    gate = _Gate(switch, callbacks)
    dl = DataLoader(SleepyBatches(n, batch, width, load_ms), batch_size=None, num_workers=0,
                    pin_memory=(device == "cuda"))
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator=device, devices=1, max_epochs=1, logger=False, profiler=switch,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, callbacks=[gate], default_root_dir=tmp)
        t0 = time.perf_counter()
        trainer.fit(MLP(width, depth), dl)
        fit_s = time.perf_counter() - t0
    blocks = switch.blocks
    # per cycle and configuration: (wall, CPU) seconds per step of the block
    per: dict[int, dict[str, tuple[float, float]]] = {}
    for (cfg, cycle, w0, c0), (_, _, w1, c1) in zip(blocks, blocks[1:]):
        per.setdefault(cycle, {})[cfg] = ((w1 - w0) / block, (c1 - c0) / block)
    full = [c for c, d in per.items() if len(d) == len(PAIRED_CONFIGS)]
    out: dict[str, Any] = {"model": model_name, "device": device, "block_steps": block, "cycles": len(full),
                           "warmup_steps": warmup, "batches": n, "fit_seconds": fit_s,
                           "none_step_ms_median": 1e3 * statistics.median(per[c]["none"][0] for c in full),
                           "none_step_cpu_ms_median": 1e3 * statistics.median(per[c]["none"][1] for c in full),
                           "configs": {}}
    for cfg in PAIRED_CONFIGS[1:]:
        entry = {}
        for tag, i in (("wall", 0), ("cpu", 1)):
            ratios = [100 * (per[c][cfg][i] / per[c]["none"][i] - 1) for c in full if per[c]["none"][i] > 0]
            diffs_us = [1e6 * (per[c][cfg][i] - per[c]["none"][i]) for c in full]
            lo, hi = _ci(ratios, statistics.median)
            entry[tag] = {"median_pct": statistics.median(ratios), "ci95_pct": [lo, hi],
                          "mean_pct": statistics.fmean(ratios),
                          "median_us_per_step": statistics.median(diffs_us),
                          "ci95_us_per_step": list(_ci(diffs_us, statistics.median))}
        out["configs"][cfg] = entry
    out["step_profiler_events_per_step"] = (sp._timeline.events_recorded / max(1, switch.steps)
                                            if device == "cuda" and sp._timeline is not None else None)
    return out


def print_paired(r: dict) -> None:
    print(f"\n== paired blocks, {r['model']} on {r['device']}: {r['cycles']} cycles of {len(PAIRED_CONFIGS)} x "
          f"{r['block_steps']} steps; no profiler {r['none_step_ms_median']:.3f} ms/step wall, "
          f"{r['none_step_cpu_ms_median']:.3f} ms training-thread CPU")
    for cfg, e in r["configs"].items():
        w, c = e["wall"], e["cpu"]
        print(f"  {cfg:<11} wall {w['median_pct']:+6.2f}% [95% CI {w['ci95_pct'][0]:+.2f} .. {w['ci95_pct'][1]:+.2f}]"
              f" ({w['median_us_per_step']:+.1f} us/step); CPU {c['median_pct']:+6.2f}% "
              f"[{c['ci95_pct'][0]:+.2f} .. {c['ci95_pct'][1]:+.2f}] ({c['median_us_per_step']:+.1f} us/step)",
              flush=True)
