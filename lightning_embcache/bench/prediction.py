"""How good StepProfiler's epoch-time prediction is: `embcache bench profiler --prediction`.

Each run is a real fit; the profiler keeps the prediction it made after 5% of each epoch
(``predict_at=0.05``) and its summary compares it with the epoch's actual wall time (training
and the validation inside the epoch, measured by the profiler and checked here against an
independent callback). Runs:

- the CPU benchmark models (``tiny``, ``small``, ``large``), 2 epochs of a few seconds each: with
  no loader worker, plain and with validation twice per epoch plus a checkpoint every quarter
  epoch; and with 2 workers, plain;
- the demo (``embcache demo``) on a fresh, cold store: the default 400-step run and a full epoch;
- on CUDA, the GPU models.

Error = predicted / actual - 1, per epoch; the fit's prediction made in epoch 0 against the
fit's actual training wall time.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_embcache.bench.profiler import MLP, MODELS, SleepyBatches
from lightning_embcache.profiling import StepProfiler

try:
    _getcpu = ctypes.CDLL(None).sched_getcpu
except (AttributeError, OSError):  # not glibc
    _getcpu = None

# model -> batches per epoch for the prediction runs (5% of it is the prediction point): epochs
# of a few seconds, so that 5% of one is more than a blink of the host's scheduler
EPOCH_BATCHES = {"tiny": 8000, "small": 5000, "large": 400, "gpu_small": 4000, "gpu_large": 400}


class _Wall(L.Callback):
    """Independent reference: each training epoch's wall time, validation inside it included."""

    def __init__(self) -> None:
        self.epochs: list[float] = []

    def on_train_epoch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_epoch_end(self, *args: Any) -> None:
        self.epochs.append(time.perf_counter() - self._t0)


class _Probe(L.Callback):
    """Asks the profiler for its prediction after 5, 10, 25, 50 and 75% of each epoch's batches:
    how the prediction converges."""

    FRACTIONS = (0.05, 0.10, 0.25, 0.50, 0.75)

    def __init__(self, sp: StepProfiler, epoch_batches: int) -> None:
        self.sp, self.n = sp, epoch_batches
        self.at = {max(1, round(f * epoch_batches)): f for f in self.FRACTIONS}
        self.seen: dict[int, dict[float, Optional[float]]] = {}
        self.traces: list[dict] = []  # per epoch: each step's wall and store seconds (replayable)
        # per batch: the training thread's CPU time and the CPU it ran on at the batch's start, to
        # tell a host that runs slower (both clocks) from one that preempts (the wall alone)
        self._cpu: list[float] = []
        self._core: list[int] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._cpu, self._core = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._cpu.append(time.thread_time())
        self._core.append(_getcpu() if _getcpu is not None else -1)
        f = self.at.get(batch_idx)  # batch_idx batches have finished (the last one closes at this fetch)
        if f is not None:
            p = self.sp.predict()
            self.seen.setdefault(trainer.current_epoch, {})[f] = None if p is None else p["epoch_s"]

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # after the profiler's own epoch end
        fc = self.sp._predictor.forecast
        if fc is not None:
            self.traces.append({"wall": [round(x, 7) for x in fc.wall], "store": [round(x, 7) for x in fc.store],
                                "saves": list(fc.saves), "val_runs": list(fc.val_runs),
                                "device_index": list(fc.device_index),
                                "device_wall": [round(x, 7) for x in fc.device_wall],
                                "thread_cpu": [round(b - a, 7) for a, b in zip(self._cpu, self._cpu[1:])],
                                "core": self._core})


class _ValMLP(MLP):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


def _result(label: str, sp: StepProfiler, wall: _Wall, extra: Optional[dict] = None,
            probe: Optional[_Probe] = None) -> dict:
    s = sp.summary()
    epochs = []
    for e, ref in zip(s, wall.epochs):
        later = (probe.seen.get(e["epoch"], {}) if probe is not None else {})
        epochs.append({"epoch": e["epoch"], "batches": e["batches"], "actual_s": e["epoch_wall_seconds"],
                       "reference_s": ref, "predicted_s": e["predicted_epoch_seconds"],
                       "std_s": e["predicted_epoch_std_seconds"], "at_batch": e["predicted_at_batch"],
                       "error_pct": e["prediction_error_pct"],
                       "unmeasured_saves": e.get("predicted_unmeasured_saves"),
                       "store_fill_batch": e.get("predicted_store_fill_batch"),
                       "error_pct_by_fraction": {f: (100 * (v / e["epoch_wall_seconds"] - 1) if v else None)
                                                 for f, v in later.items()}})
    fit_actual = sum(e["epoch_wall_seconds"] for e in s)
    fit_pred = s[0]["predicted_fit_seconds"] if s else None
    out = {"run": label, "epochs": epochs, "fit_actual_s": fit_actual, "fit_predicted_s": fit_pred,
           "fit_error_pct": 100 * (fit_pred / fit_actual - 1) if fit_pred else None,
           "loadavg": os.getloadavg()}
    out.update(extra or {})
    if probe is not None:
        out["traces"] = probe.traces
    return out


def model_run(model_name: str, workers: int, extras: bool, device: str = "cpu", epochs: int = 2,
              batches: Optional[int] = None) -> dict:
    """One fit of a benchmark model; ``extras``: validation twice an epoch (10 batches, a sanity
    check of 2) and a checkpoint every quarter epoch."""
    width, depth, batch, _, load_ms = MODELS[model_name]
    n = batches or EPOCH_BATCHES[model_name]
    torch.manual_seed(0)
    model = _ValMLP(width, depth) if extras else MLP(width, depth)
    dl = DataLoader(SleepyBatches(n, batch, width, load_ms), batch_size=None, num_workers=workers,
                    persistent_workers=False, pin_memory=(device == "cuda"))
    val = DataLoader(SleepyBatches(10, batch, width, load_ms), batch_size=None) if extras else None
    sp, wall = StepProfiler(report=False), _Wall()
    probe = _Probe(sp, n)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        callbacks: list = [wall, sp, probe]
        if extras:
            callbacks.append(ModelCheckpoint(dirpath=tmp, every_n_train_steps=n // 4, save_top_k=-1))
        trainer = L.Trainer(accelerator=device, devices=1, max_epochs=epochs, logger=False,
                            enable_checkpointing=extras, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=2 if extras else 0, val_check_interval=0.5 if extras else 1.0,
                            callbacks=callbacks, default_root_dir=tmp)
        trainer.fit(model, dl, val)
    label = f"{model_name}/workers={workers}/{'val+ckpt' if extras else 'plain'}"
    return _result(label, sp, wall, {"model": model_name, "workers": workers, "extras": extras}, probe)


def demo_run(max_steps: int, samples: int = 1_000_000) -> dict:
    """``embcache demo`` on a new folder (a cold store: every row created and first written in
    this epoch), with its own StepProfiler replaced by one that keeps the prediction."""
    from lightning_embcache import demo

    sp, wall = StepProfiler(report=False), _Wall()
    batches = -(-samples // 1024)
    probe = _Probe(sp, batches if max_steps < 0 else min(batches, max_steps))
    root = tempfile.mkdtemp(prefix="embcache-demo-")
    shutil.rmtree(root)  # the demo creates its run folder itself
    original = demo._optional_profiler
    demo._optional_profiler = lambda: [wall, sp, probe]
    try:
        demo.main(["--root", root, "--max-steps", str(max_steps), "--samples", str(samples)])
    finally:
        demo._optional_profiler = original
        shutil.rmtree(root, ignore_errors=True)
    return _result(f"demo/max_steps={max_steps}", sp, wall, {"model": "demo", "max_steps": max_steps}, probe)


def run(device: str = "cpu", reps: int = 3, models: Optional[list[str]] = None, demo: bool = True,
        workers: tuple[int, ...] = (0, 2), demo_steps: tuple[int, ...] = (400, -1),
        partial: Optional[str] = None, batches: Optional[int] = None) -> dict:
    """Every run; ``partial``: a JSON-lines file each run is appended to as it ends (a run cut
    short by a time limit keeps what it measured)."""
    runs: list[dict] = []

    def keep(r: dict) -> None:
        runs.append(r)
        _print(r)
        if partial:
            with open(partial, "a") as f:
                f.write(json.dumps(r) + "\n")

    models = models or (["tiny", "small", "large"] if device == "cpu" else ["gpu_small", "gpu_large"])
    configs = [(w, extras) for w in workers for extras in ((False, True) if w == 0 else (False,))]
    for rep in range(reps):
        for model in models:
            for w, extras in configs:
                r = model_run(model, w, extras, device, batches=batches)
                r["rep"] = rep
                keep(r)
        if demo and device == "cpu":
            for steps in demo_steps:
                r = demo_run(steps)
                r["rep"] = rep
                keep(r)
    return {"runs": runs, "aggregate": aggregate(runs)}


def _print(r: dict) -> None:
    errs = " ".join(f"e{e['epoch']} {e['error_pct']:+.2f}% ({e['predicted_s']:.2f}+/-{e['std_s']:.2f} s at "
                    f"batch {e['at_batch']} vs {e['actual_s']:.2f} s)" if e["error_pct"] is not None else
                    f"e{e['epoch']} n/a" for e in r["epochs"])
    fit = f"{r['fit_error_pct']:+.2f}%" if r["fit_error_pct"] is not None else "n/a"
    fills = [f"e{e['epoch']} hot tier full at batch ~{e['store_fill_batch']}" for e in r["epochs"]
             if e.get("store_fill_batch")]
    if fills:
        errs += " (" + ", ".join(fills) + ")"
    for e in r["epochs"]:
        later = " ".join(f"{int(100 * f)}%:{v:+.1f}" for f, v in e["error_pct_by_fraction"].items() if v is not None)
        if later:
            errs += f" [e{e['epoch']} error when predicted after {later}]"
    print(f"prediction {r['run']} rep={r.get('rep')}: {errs}; fit {fit}; load {r['loadavg'][0]:.1f}", flush=True)


def aggregate(runs: list[dict]) -> dict:
    """Per run label: median and worst |error| of the epoch predictions and of the fit's."""
    out: dict[str, Any] = {}
    for label in dict.fromkeys(r["run"] for r in runs):
        mine = [r for r in runs if r["run"] == label]
        epoch_errs = [e["error_pct"] for r in mine for e in r["epochs"] if e["error_pct"] is not None]
        first = [r["epochs"][0]["error_pct"] for r in mine if r["epochs"] and r["epochs"][0]["error_pct"] is not None]
        fit = [r["fit_error_pct"] for r in mine if r["fit_error_pct"] is not None]
        within = [abs(e["predicted_s"] - e["actual_s"]) <= e["std_s"] * 2 for r in mine for e in r["epochs"]
                  if e["error_pct"] is not None]
        out[label] = {
            "epoch_error_pct_median": statistics.median(epoch_errs) if epoch_errs else None,
            "epoch_abs_error_pct_median": statistics.median(abs(x) for x in epoch_errs) if epoch_errs else None,
            "epoch_abs_error_pct_max": max(abs(x) for x in epoch_errs) if epoch_errs else None,
            "first_epoch_error_pct": first,
            "fit_error_pct": fit,
            "within_2_std_share": sum(within) / len(within) if within else None,
            "actual_epoch_s_median": statistics.median(e["actual_s"] for r in mine for e in r["epochs"]),
            "runs": len(mine),
        }
    return out
