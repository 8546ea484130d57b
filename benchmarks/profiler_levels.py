"""Where the level shifts of a CPU training loop's step time come from:
``python -m benchmarks.profiler_levels --out L.json``.

On some hosts the typical (median) step time of a CPU-bound loop switches between two levels for
a second or more at a time, which no early epoch-time prediction can foresee. This runs the same
short loop several ways, each recording per step: the wall time, the training thread's CPU time,
the CPU it ran on, its involuntary context switches and the time the garbage collector ran; and
every 200 steps the host's steal time (``/proc/stat``):

- ``plain``: a bare torch loop (forward, backward, SGD), no Lightning, no profiler;
- ``fit``: the same model under ``lightning.Trainer`` with StepProfiler (as the prediction
  benchmark runs it);
- ``fit-pinned``: the same, the process pinned to one CPU (``os.sched_setaffinity``);
- ``fit-pinned-frozen``: pinned, and ``gc.freeze()`` after warm-up with the collector's
  thresholds raised (no collection inside the timed steps);
- ``fit-canary``: the fit, with a fixed workload (20 steps of the bare loop on its own model)
  run every 50 batches and timed on the thread's CPU clock: if the canary slows down together
  with the fit's steps, the CPU itself ran slower (the host: another guest on the same core, a
  lower clock), not the fit's own code.

Per run it reports the block medians of wall and CPU time (40 blocks), their ratio max/min, how
much of the wall's level variation the CPU time carries (a slower CPU, or a thread preempted by
the hypervisor, shows in both; another process on the same CPU only in the wall), migrations
between CPUs and the median step per CPU, GC time and steal time. If ``plain`` shows the same
levels as ``fit``, they are the host's, not Lightning's or the profiler's.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks.profiler import MLP, MODELS, SleepyBatches
from lightning_embcache.profiling import StepProfiler

try:
    _getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
except (AttributeError, OSError):  # not glibc
    _getcpu = None

BLOCKS = 40


def _steal_ticks() -> float:
    """The host's cumulative steal ticks over all CPUs (0 where /proc/stat is missing)."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
        return float(parts[8]) if len(parts) > 8 else 0.0
    except OSError:
        return 0.0


class _Recorder:
    """Per-step wall, thread CPU, CPU id, involuntary switches, GC seconds; steal every 200 steps."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, int, int, float]] = []
        self.steal: list[tuple[int, float]] = []
        self.gc_s = 0.0
        self._gc_t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0

    def mark(self) -> None:
        if len(self.rows) % 200 == 0:
            self.steal.append((len(self.rows), _steal_ticks()))
        self.rows.append((time.perf_counter(), time.thread_time(), _getcpu() if _getcpu else -1,
                          resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw, self.gc_s))

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


class _Canary(L.Callback):
    """Every 50 batches, 20 bare steps of a private copy of the model, timed on the thread CPU clock."""

    def __init__(self, model_name: str) -> None:
        width, depth, batch, _, _ = MODELS[model_name]
        self.model = MLP(width, depth)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = torch.randn(batch, width), torch.randn(batch, 1)
        self.times: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % 50:
            return
        t0 = time.thread_time()
        for _ in range(20):
            loss = torch.nn.functional.mse_loss(self.model.net(self.x), self.y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.times.append((batch_idx, (time.thread_time() - t0) / 20))


class _Mark(L.Callback):
    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec

    def on_train_batch_start(self, *args: Any) -> None:
        self.rec.mark()


def _summary(name: str, rec: _Recorder, warmup: int, skip_every: int = 0) -> dict:
    a = np.asarray(rec.rows[warmup:], dtype=np.float64)
    wall = np.diff(a[:, 0]) * 1e3
    cpu = np.diff(a[:, 1]) * 1e3
    ids = a[1:, 2].astype(int)
    if skip_every:  # steps that ran the canary
        keep = (np.arange(warmup, warmup + wall.size) + 1) % skip_every != 0
        wall, cpu, ids = wall[keep], cpu[keep], ids[keep]
    size = wall.size // BLOCKS
    wm = np.median(wall[:BLOCKS * size].reshape(BLOCKS, size), axis=1)
    cm = np.median(cpu[:BLOCKS * size].reshape(BLOCKS, size), axis=1)
    # how much of the wall's block-to-block variation the CPU time follows (slope of cpu on wall)
    dw, dc = wm - wm.mean(), cm - cm.mean()
    follow = float((dw * dc).sum() / (dw * dw).sum()) if (dw * dw).sum() > 0 else 0.0
    per_cpu = {int(c): round(float(np.median(wall[ids == c])), 4) for c in np.unique(ids)
               if (ids == c).sum() >= 50}
    steal = rec.steal
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    steal_s = (steal[-1][1] - steal[0][1]) / hz if len(steal) > 1 else 0.0
    out = {"run": name, "steps": int(wall.size), "wall_ms_median": float(np.median(wall)),
           "wall_block_medians_ms": [round(float(x), 4) for x in wm],
           "cpu_block_medians_ms": [round(float(x), 4) for x in cm],
           "wall_level_ratio": float(wm.max() / wm.min()), "cpu_level_ratio": float(cm.max() / cm.min()),
           "wall_level_cv": float(wm.std(ddof=1) / wm.mean()), "cpu_follows_wall": follow,
           "migrations": int((np.diff(ids) != 0).sum()), "median_wall_ms_by_cpu": per_cpu,
           "involuntary_switches": int(a[-1, 3] - a[0, 3]), "gc_seconds": float(a[-1, 4] - a[0, 4]),
           "steal_seconds_all_cpus": steal_s, "wall_seconds": float(a[-1, 0] - a[0, 0])}
    print(f"{name:<18} median {out['wall_ms_median']:.3f} ms; wall levels max/min {out['wall_level_ratio']:.2f} "
          f"(cv {out['wall_level_cv']:.3f}), cpu {out['cpu_level_ratio']:.2f}, cpu follows wall {follow:.2f}; "
          f"migrations {out['migrations']}, by cpu {per_cpu}; invol. switches {out['involuntary_switches']}; "
          f"gc {out['gc_seconds'] * 1e3:.1f} ms; steal {steal_s:.2f} s", flush=True)
    print("   wall blocks", " ".join(f"{x:.2f}" for x in wm), flush=True)
    print("   cpu  blocks", " ".join(f"{x:.2f}" for x in cm), flush=True)
    return out


def plain_loop(model_name: str, steps: int, warmup: int) -> dict:
    """The model's steps in a bare loop: what the host alone does to the step time."""
    width, depth, batch, _, _ = MODELS[model_name]
    torch.manual_seed(0)
    model = MLP(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randn(batch, 1)
    rec = _Recorder()
    for _ in range(steps + warmup + 1):
        rec.mark()
        loss = torch.nn.functional.mse_loss(model.net(x.clone()), y.clone())
        opt.zero_grad()
        loss.backward()
        opt.step()
    rec.close()
    return _summary("plain", rec, warmup)


def lightning_fit(model_name: str, steps: int, warmup: int, pin: int | None, freeze: bool,
                  canary: bool = False) -> dict:
    width, depth, batch, _, load_ms = MODELS[model_name]
    torch.manual_seed(0)
    old = os.sched_getaffinity(0)
    if pin is not None:
        os.sched_setaffinity(0, {pin})
    rec = _Recorder()

    class _Freeze(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == warmup - 1:
                gc.collect()
                gc.freeze()
                gc.set_threshold(100_000, 50, 1000)

    can = _Canary(model_name) if canary else None
    callbacks: list = [StepProfiler(report=False), _Mark(rec)] + ([_Freeze()] if freeze else []) + ([can] if can else [])
    dl = DataLoader(SleepyBatches(steps + warmup + 1, batch, width, load_ms), batch_size=None, num_workers=0)
    thresholds = gc.get_threshold()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                callbacks=callbacks)
            trainer.fit(MLP(width, depth), dl)
    finally:
        rec.close()
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        os.sched_setaffinity(0, old)
    name = "fit" + ("-pinned" if pin is not None else "") + ("-frozen" if freeze else "") + ("-canary" if can else "")
    out = _summary(name, rec, warmup, skip_every=50 if can else 0)
    if can is not None:
        out.update(_canary_summary(can, rec, warmup))
    return out


def _canary_summary(can: _Canary, rec: _Recorder, warmup: int) -> dict:
    """The canary's CPU time per bare step against the fit's median step around it."""
    a = np.asarray(rec.rows, dtype=np.float64)
    step = np.diff(a[:, 1]) * 1e3  # thread CPU per step (canary steps included: left out below)
    pairs = []
    for idx, t in can.times:
        if idx < warmup or idx + 50 > step.size:
            continue
        pairs.append((float(np.median(step[idx + 1:idx + 50])), t * 1e3))
    if len(pairs) < 4:
        return {}
    f, c = np.asarray(pairs).T
    df, dc = f - f.mean(), c - c.mean()
    slope = float((df * dc).sum() / (df * df).sum() * f.mean() / c.mean()) if (df * df).sum() > 0 else 0.0
    corr = float(np.corrcoef(f, c)[0, 1])
    print(f"   canary: bare step {np.median(c):.3f} ms (max/min {c.max() / c.min():.2f}) against the fit's "
          f"{np.median(f):.3f} ms (max/min {f.max() / f.min():.2f}); correlation {corr:.2f}, relative slope {slope:.2f}",
          flush=True)
    print("   canary ms", " ".join(f"{x:.2f}" for x in c), flush=True)
    print("   fit ms   ", " ".join(f"{x:.2f}" for x in f), flush=True)
    return {"canary_ms": c.tolist(), "fit_ms_around_canary": f.tolist(), "canary_fit_correlation": corr,
            "canary_relative_slope": slope}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profiler_levels",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--plain-steps", type=int, default=None,
                    help="steps of the bare loop (default 3x --steps: about as long as a fit's, its steps being shorter)")
    ap.add_argument("--runs", default="plain,fit-canary,fit-pinned-canary,fit-pinned-frozen-canary,fit-canary")
    ap.add_argument("--pin", type=int, default=None, help="CPU to pin to (default: the last one allowed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pin = args.pin if args.pin is not None else max(os.sched_getaffinity(0))
    results = []
    for run in args.runs.split(","):
        if run == "plain":
            results.append(plain_loop(args.model, args.plain_steps or 3 * args.steps, args.warmup))
        else:
            results.append(lightning_fit(args.model, args.steps, args.warmup,
                                         pin if "pinned" in run else None, "frozen" in run, "canary" in run))
    out = {"command": " ".join(sys.argv), "platform": platform.platform(), "cpus": os.cpu_count(),
           "loadavg": os.getloadavg(), "model": args.model, "runs": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
