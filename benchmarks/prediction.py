"""How good StepProfiler's epoch-time prediction is: `embcache bench profiler --prediction`.

Each run is a real fit; the profiler keeps the prediction it made after 5% of each epoch
(``predict_at=0.05``) and its summary compares it with the epoch's actual wall time (training
and the validation inside the epoch, measured by the profiler and checked here against an
independent callback). Runs:

- the CPU benchmark models (``tiny``, ``small``, ``large``), 2 epochs of a few seconds each: with
  no loader worker, plain and with validation twice per epoch plus a checkpoint every quarter
  epoch; and with 2 workers, plain;
- the demo (``embcache demo``) on a fresh, cold store: the default 400-step run and a full epoch;
- on CUDA, the GPU models: two whose step the host sets (``gpu_small`` launches small kernels,
  ``gpu_large`` makes and pins 32 MB batches on the training thread) and one whose step the GPU
  sets (``gpu_deep``).

Error = predicted / actual - 1, per epoch; the fit's prediction made in epoch 0 against the
fit's actual training wall time.
"""

from __future__ import annotations

import ctypes
import gc
import gzip
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from benchmarks.profiler import MLP, MODELS, SleepyBatches
from lightning_embcache.profiling import StepProfiler
from lightning_embcache.profiling.forecast import (
    EPOCH_DRIFT_BLOCKS,
    Forecast,
    epoch_level,
    level_spread,
    level_variation,
    save_estimate_s,
    slow_share,
)
from lightning_embcache.profiling.store_fill import StoreFill, StoreRates, store_fill_save_s

try:
    _getcpu = ctypes.CDLL(None).sched_getcpu
except (AttributeError, OSError):  # not glibc
    _getcpu = None

# model -> batches per epoch for the prediction runs (5% of it is the prediction point): epochs
# of a few seconds (gpu_deep ~30 s), so that 5% of one is more than a blink of the host's scheduler
EPOCH_BATCHES = {"tiny": 8000, "small": 5000, "large": 400, "gpu_small": 4000, "gpu_large": 400,
                 "gpu_deep": 2000}


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
        self.seen: dict[int, dict[float, float | None]] = {}
        self._fills: dict[float, Any] = {}  # per fraction: the fill projection (and measured rates) it used
        self.own_s: dict[int, float] = {}  # per epoch: seconds of the probe's own predict() calls
        self.traces: list[dict] = []  # per epoch: each step's wall and store seconds (replayable)
        # per batch: the training thread's CPU time and the CPU it ran on at the batch's start, to
        # tell a host that runs slower (both clocks) from one that preempts (the wall alone)
        self._cpu: list[float] = []
        self._core: list[int] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._cpu, self._core = [], []
        self._fills = {}
        # Python's garbage collections during the epoch: (batch, generation, seconds) of each
        self._gc: list[tuple[int, int, float]] = []
        self._gc_t0 = 0.0
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self._gc.append((len(self._cpu), info["generation"], round(time.perf_counter() - self._gc_t0, 7)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._cpu.append(time.thread_time())
        self._core.append(_getcpu() if _getcpu is not None else -1)
        f = self.at.get(batch_idx)  # batch_idx batches have finished (the last one closes at this fetch)
        if f is not None:
            t0 = time.perf_counter()
            p = self.sp.predict()
            self.seen.setdefault(trainer.current_epoch, {})[f] = None if p is None else p["epoch_s"]
            self._fills[f] = self.sp._predictor._fill
            # the benchmark's own work inside the epoch, not the workload's: left out of the actual
            self.own_s[trainer.current_epoch] = self.own_s.get(trainer.current_epoch, 0.0) + time.perf_counter() - t0

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # after the profiler's own epoch end
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        fc = self.sp._predictor.forecast
        if fc is not None:
            self.traces.append({"wall": [round(x, 7) for x in fc.wall], "store": [round(x, 7) for x in fc.store],
                                "saves": list(fc.saves), "val_runs": list(fc.val_runs),
                                "device_index": list(fc.device_index),
                                "device_wall": [round(x, 7) for x in fc.device_wall],
                                "thread_cpu": [round(b - a, 7) for a, b in zip(self._cpu, self._cpu[1:])],
                                "core": self._core,
                                # (batch, bytes per batch) of the hot tiers' fill, as last projected
                                "store_fill": self.sp._predictor._fill,
                                "store_fill_by_fraction": dict(self._fills),
                                "probe_s": self.own_s.get(trainer.current_epoch, 0.0),
                                "gc": self._gc})


class _ValMLP(MLP):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


def _result(label: str, sp: StepProfiler, wall: _Wall, extra: dict | None = None,
            probe: _Probe | None = None) -> dict:
    s = sp.summary()
    epochs = []
    own = probe.own_s if probe is not None else {}
    for e, ref in zip(s, wall.epochs):
        later = (probe.seen.get(e["epoch"], {}) if probe is not None else {})
        # the actual time less the probe's own predict() calls inside the epoch (a few ms)
        probe_s = own.get(e["epoch"], 0.0)
        actual = e["epoch_wall_seconds"] - probe_s
        pred = e["predicted_epoch_seconds"]
        epochs.append({"epoch": e["epoch"], "batches": e["batches"], "actual_s": actual,
                       "reference_s": ref - probe_s, "probe_s": probe_s, "predicted_s": pred,
                       "std_s": e["predicted_epoch_std_seconds"], "at_batch": e["predicted_at_batch"],
                       "low_s": e.get("predicted_epoch_low_seconds"), "high_s": e.get("predicted_epoch_high_seconds"),
                       "error_pct": 100 * (pred / actual - 1) if pred else None,
                       "unmeasured_saves": e.get("predicted_unmeasured_saves"),
                       "store_fill_batch": e.get("predicted_store_fill_batch"),
                       "store_fill_s": e.get("predicted_store_fill_seconds"),
                       "error_pct_by_fraction": {f: (100 * (v / actual - 1) if v else None)
                                                 for f, v in later.items()}})
    fit_actual = sum(e["actual_s"] for e in epochs)
    fit_pred = s[0]["predicted_fit_seconds"] if s else None
    out = {"run": label, "epochs": epochs, "fit_actual_s": fit_actual, "fit_predicted_s": fit_pred,
           "fit_error_pct": 100 * (fit_pred / fit_actual - 1) if fit_pred else None,
           "loadavg": os.getloadavg()}
    out.update(extra or {})
    if probe is not None:
        out["traces"] = probe.traces
    return out


def model_run(model_name: str, workers: int, extras: bool, device: str = "cpu", epochs: int = 2,
              batches: int | None = None) -> dict:
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


def demo_run(max_steps: int, samples: int = 1_000_000, device: str = "cpu") -> dict:
    """``embcache demo`` on a new folder (a cold store: every row created and first written in
    this epoch), with its own StepProfiler replaced by one that keeps the prediction. On
    ``cuda`` the codes fill a device tier in the first epoch (rows read ahead from disk, then
    copied up as first touched)."""
    from lightning_embcache import demo

    sp, wall = StepProfiler(report=False), _Wall()
    batches = -(-samples // 1024)
    probe = _Probe(sp, batches if max_steps < 0 else min(batches, max_steps))
    root = tempfile.mkdtemp(prefix="embcache-demo-")
    shutil.rmtree(root)  # the demo creates its run folder itself
    original = demo._optional_profiler
    demo._optional_profiler = lambda: [wall, sp, probe]
    try:
        demo.main(["--root", root, "--max-steps", str(max_steps), "--samples", str(samples),
                   "--accelerator", device])
    finally:
        demo._optional_profiler = original
        shutil.rmtree(root, ignore_errors=True)
    label = f"demo/max_steps={max_steps}" + ("/cuda" if device == "cuda" else "")
    return _result(label, sp, wall, {"model": "demo", "max_steps": max_steps, "device": device}, probe)


def run(device: str = "cpu", reps: int = 3, models: list[str] | None = None, demo: bool = True,
        workers: tuple[int, ...] = (0, 2), demo_steps: tuple[int, ...] = (400, -1),
        partial: str | None = None, batches: int | None = None) -> dict:
    """Every run; ``partial``: a JSON-lines file each run is appended to as it ends (a run cut
    short by a time limit keeps what it measured)."""
    runs: list[dict] = []

    def keep(r: dict) -> None:
        runs.append(r)
        _print(r)
        if partial:
            with open(partial, "a") as f:
                f.write(json.dumps(r) + "\n")

    if models == ["demo"]:  # the demo alone
        models = []
    elif not models:
        models = ["tiny", "small", "large"] if device == "cpu" else ["gpu_small", "gpu_large", "gpu_deep"]
    configs = [(w, extras) for w in workers for extras in ((False, True) if w == 0 else (False,))]
    for rep in range(reps):
        for model in models:
            for w, extras in configs:
                r = model_run(model, w, extras, device, batches=batches)
                r["rep"] = rep
                keep(r)
        if demo:
            for steps in demo_steps:
                r = demo_run(steps, device=device)
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
        inside = [e["low_s"] <= e["actual_s"] <= e["high_s"] for r in mine for e in r["epochs"]
                  if e["error_pct"] is not None and e.get("low_s") is not None]
        out[label] = {
            "epoch_error_pct_median": statistics.median(epoch_errs) if epoch_errs else None,
            "epoch_abs_error_pct_median": statistics.median(abs(x) for x in epoch_errs) if epoch_errs else None,
            "epoch_abs_error_pct_max": max(abs(x) for x in epoch_errs) if epoch_errs else None,
            "first_epoch_error_pct": first,
            "fit_error_pct": fit,
            "within_2_std_share": sum(within) / len(within) if within else None,
            "within_90_interval_share": sum(inside) / len(inside) if inside else None,
            "interval_half_width_pct_median": statistics.median(
                50 * (e["high_s"] - e["low_s"]) / e["predicted_s"] for r in mine for e in r["epochs"]
                if e["error_pct"] is not None and e.get("low_s") is not None) if inside else None,
            "actual_epoch_s_median": statistics.median(e["actual_s"] for r in mine for e in r["epochs"]),
            "runs": len(mine),
        }
    return out


# -- replay: the current estimator on the batches of a saved run --------------------------------

def model_bytes(model_name: str) -> int:
    """Bytes of a benchmark MLP's float32 parameters (SGD keeps no state): what a checkpoint of it writes."""
    width, depth, _, _, _ = MODELS[model_name]
    return 4 * (depth * (width * width + width) + width + 1)


class _KnownRate(Forecast):
    """A :class:`Forecast` told the rate (seconds per step) the rest of the epoch will run at: what
    the estimator would predict if it knew that, all else (validation, saves, the stores' extra
    cost of a save after their hot tiers fill) as it is. The rate holds what the batches after a
    fill cost, so they are not charged again."""

    rate_s = 0.0

    def rate(self) -> dict | None:
        r = super().rate()
        return None if r is None else dict(r, mean=self.rate_s, slope=0.0)

    def estimate(self, *args: Any, store_fill: StoreFill | None = None, save_batches: Any = (),
                **kwargs: Any) -> dict | None:
        p = super().estimate(*args, **kwargs)
        if p is not None and store_fill is not None:
            extra = math.fsum(store_fill_save_s(store_fill, b) for b in save_batches if b >= self.batches)
            p["seconds"] += extra
            p["store_fill_s"] = extra
        return p


def replay_epoch(trace: dict, actual_s: float, fraction: float = 0.05, every_n: int = 0, epoch: int = 0,
                 save_guess_s: float | None = None, earlier_save_s: float | None = None,
                 device: bool = False, rate_s: float | None = None,
                 store_fill: StoreFill | None = None, slow: float | None = None, level_cv: float = 0.0,
                 previous: tuple[float, float] | None = None, drift: float | None = None,
                 drift_epochs: int = 1) -> dict | None:
    """The prediction the current :class:`Forecast` makes after ``fraction`` of a saved epoch's
    batches (``trace`` as kept by the benchmark), against ``actual_s``. Validation still to come is
    charged at the mean of the epoch's own runs (the benchmark's sanity check is not in the trace);
    checkpoint saves (every ``every_n`` steps) at the measured cost once one was seen, else at
    ``earlier_save_s`` (a save measured in an earlier epoch), else at ``save_guess_s``. ``rate_s``:
    the rate is this instead of the estimator's (an oracle); ``store_fill``: a hot tier's fill, as
    the profiler projected it; ``slow``: the previous epoch's share of slow steps; ``level_cv``:
    the largest level variation of the earlier epochs; ``previous``: the previous epoch's
    :func:`~lightning_embcache.profiling.forecast.epoch_level`; ``drift``: the largest
    :func:`~lightning_embcache.profiling.forecast.level_spread` of the earlier epochs (``drift_epochs`` of them), None in a
    fit's first (each as the profiler carries them over)."""
    wall, store = trace["wall"], trace["store"]
    n = len(wall)
    k = max(9, math.ceil(fraction * n))
    runs = trace["val_runs"]
    val_s = sum(runs) / len(runs) if runs else None
    saves = set(trace["saves"])
    dev = [(i, s) for i, s in zip(trace.get("device_index", []), trace.get("device_wall", []))]
    p = None
    while p is None and k < n:  # on a GPU the prediction waits for 3 sampled steps, as the profiler does
        fc = Forecast() if rate_s is None else _KnownRate()
        if rate_s is not None:
            fc.rate_s = rate_s
        fc.needs_device = device
        for i in range(k):
            if i in saves:
                fc.mark_save()
            fc.add_step(wall[i], store[i])
        for i, s in dev:
            if i < k:
                fc.add_device_step(i, s)
        # validation twice an epoch in the val+ckpt runs (at half and at the end): none before 5%
        g0 = epoch * n
        saves_left = ((g0 + n) // every_n - (g0 + k) // every_n) if every_n else 0
        at = [b for b in range(k, n) if every_n and (g0 + b) % every_n == 0] if store_fill is not None else []
        p = fc.estimate(n, len(runs), val_s, saves_left, earlier_save_s, level_cv, save_guess_s,
                        store_fill=store_fill, save_batches=at, previous=previous, drift=drift, drift_epochs=drift_epochs,
                        **({"slow_share": slow} if slow is not None else {}))
        if p is None:
            k += 1
    if p is None:
        return None
    return {"predicted_s": p["seconds"], "std_s": p["std"], "low_s": p["low"], "high_s": p["high"],
            "at_batch": k, "actual_s": actual_s,
            "error_pct": 100 * (p["seconds"] / actual_s - 1), "unmeasured_saves": p["unmeasured_saves"]}


# the demo's hot tier (a quarter of its 1M x 64 float32 table): the budget (and the bytes per
# batch) of runs saved before the benchmark kept the profiler's whole fill projection
DEMO_HOT_BYTES = 1_000_000 * 64 * 4 // 4


def _carried_drift(earlier: list[dict]) -> float | None:
    """The largest level spread of the earlier epochs' traces, as the profiler carries it over
    (None before a whole epoch)."""
    return max((level_spread(t["wall"], EPOCH_DRIFT_BLOCKS) for t in earlier), default=None)


def _steps_mean(wall: list[float], saves: set[int], lo: int, hi: int) -> float | None:
    x = [wall[i] for i in range(max(1, lo), hi) if i not in saves]
    return sum(x) / len(x) if x else None


def load_runs(paths: list[str]) -> list[dict]:
    """The runs saved in ``paths`` (a benchmark JSON or its .jsonl, either gzipped) that kept
    their per-batch traces."""
    runs: list[dict] = []
    for path in paths:
        # large raw results are kept gzipped (``.json.gz``, ``.jsonl.gz``)
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            text = f.read()
        name = path.removesuffix(".gz")
        mine = ([json.loads(line) for line in text.splitlines() if line.strip()] if name.endswith(".jsonl")
                else json.loads(text)["prediction"]["runs"])
        for r in mine:
            if (r.get("model") in MODELS or r.get("model") == "demo") and "traces" in r:
                r["path"] = os.path.basename(path)
                runs.append(r)
    return runs


def _epoch_setup(r: dict, e: dict, trace: dict) -> tuple[int, dict]:
    """What the profiler would have carried into this epoch of a saved run and how the run was
    set up: ``(every_n checkpoint steps, replay_epoch's keyword arguments)``."""
    model = r.get("model")
    n = len(trace["wall"])
    every = n // 4 if r.get("extras", False) else 0
    earlier = None
    if e["epoch"] > 0 and r.get("extras", False):  # the saves of epoch 0, as the profiler carries them over
        t0 = r["traces"][0]
        med = statistics.median(t0["wall"][1:])
        extra = [t0["wall"][i] - med for i in t0["saves"] if i > 0]
        earlier = max(0.0, sum(extra) / len(extra)) if extra else None
    guess = save_estimate_s(model_bytes(model)) if model in MODELS else None
    fill = trace.get("store_fill")
    if model == "demo":
        every = 250  # the demo's ModelCheckpoint(every_n_train_steps=250)
        if fill is None and e.get("store_fill_batch"):
            fill = (e["store_fill_batch"], DEMO_HOT_BYTES / e["store_fill_batch"])
    if fill is not None:  # runs saved before the projection kept the budget: the demo's
        fill = StoreFill(int(fill[0]), float(fill[1]), float(fill[2]) if len(fill) > 2 else DEMO_HOT_BYTES)
    # the previous epoch's share of slow steps, level and drift, as the profiler carries them over
    prev = r["traces"][e["epoch"] - 1] if 0 < e["epoch"] <= len(r["traces"]) - 1 else None
    kw = {"save_guess_s": guess, "earlier_save_s": earlier, "device": bool(trace.get("device_index")),
          "store_fill": fill, "slow": slow_share(prev["wall"], prev["saves"]) if prev is not None else None,
          "previous": epoch_level(prev["wall"], prev["saves"]) if prev is not None else None,
          "level_cv": max((level_variation(t["wall"]) for t in r["traces"][:e["epoch"]]), default=0.0),
          "drift": _carried_drift(r["traces"][:e["epoch"]]), "drift_epochs": e["epoch"]}
    return every, kw


def replay(paths: list[str], fraction: float = 0.05) -> list[dict]:
    """Every epoch of every run saved in ``paths`` (a benchmark JSON or its .jsonl), replayed with
    the current estimator (``estimate``; ``free``: checkpoint saves not yet measured counted as
    free) and with two oracles that separate the estimator's error from the host's:
    ``rest_rate`` knows the mean step time of the rest of the epoch (what is left is the
    validation and save charges' error), ``first_rate`` knows the first ``fraction`` perfectly and
    takes its mean step time as the rest's (what it misses, no estimator that sees only those
    steps can foresee: the host's and the workload's change after them)."""
    runs = load_runs(paths)
    out = []
    for r in runs:
        for e, trace in zip(r["epochs"], r["traces"]):
            n = len(trace["wall"])
            k = max(9, math.ceil(fraction * n))
            saves = set(trace["saves"])
            every, kw = _epoch_setup(r, e, trace)
            guess, earlier, device, fill = kw["save_guess_s"], kw["earlier_save_s"], kw["device"], kw["store_fill"]
            carried = {x: kw[x] for x in ("slow", "previous", "level_cv", "drift", "drift_epochs")}
            row = {"run": r["run"], "epoch": e["epoch"], "recorded_error_pct": e["error_pct"], "tail": tail(trace, k)}
            args = (e["actual_s"], fraction, every, e["epoch"])
            row["free"] = replay_epoch(trace, *args, None, earlier, device, **carried)
            row["estimate"] = replay_epoch(trace, *args, guess, earlier, device, store_fill=fill, **carried)
            # the same without the previous epoch's level in a device-timed rate
            row["window_only"] = replay_epoch(trace, *args, guess, earlier, device, store_fill=fill,
                                              **dict(carried, previous=None))
            rest = _steps_mean(trace["wall"], saves, k, n)
            first = _steps_mean(trace["wall"], saves, 1, k)
            # the oracles know the rate; saves and validation are charged as the estimator does
            row["rest_rate"] = replay_epoch(trace, *args, guess, earlier, device, rate_s=rest, store_fill=fill)
            row["first_rate"] = replay_epoch(trace, *args, guess, earlier, device, rate_s=first, store_fill=fill)
            out.append(row)

            def pct(name: str) -> float:
                return row[name]["error_pct"] if row[name] else float("nan")

            print(f"{r['run']:<28} e{e['epoch']} recorded {e['error_pct']:+7.1f}%  replayed {pct('estimate'):+7.1f}% "
                  f"(saves free {pct('free'):+7.1f}%, no previous epoch {pct('window_only'):+7.1f}%); "
                  f"oracles: rest's rate {pct('rest_rate'):+6.1f}%, "
                  f"first {100 * fraction:g}%'s rate {pct('first_rate'):+7.1f}%", flush=True)
    for group, pick in (("CPU models", lambda x: not x["run"].startswith(("gpu", "demo"))),
                        ("demo", lambda x: x["run"].startswith("demo")),
                        ("demo, full epochs", lambda x: x["run"] == "demo/max_steps=-1"),
                        ("demo, 400 steps", lambda x: x["run"] == "demo/max_steps=400"),
                        ("GPU models", lambda x: x["run"].startswith("gpu")),
                        ("GPU models, first epochs", lambda x: x["run"].startswith("gpu") and x["epoch"] == 0),
                        ("GPU models, later epochs", lambda x: x["run"].startswith("gpu") and x["epoch"] > 0)):
        mine = [x for x in out if pick(x)]
        if not mine:
            continue
        print(f"{group}, {len(mine)} epochs: |error| median, within 2%, within 5%:")
        for name in ("estimate", "window_only", "rest_rate", "first_rate"):
            errs = [abs(x[name]["error_pct"]) for x in mine if x[name]]
            print(f"  {name:<11} {statistics.median(errs):5.1f}%  {sum(v <= 2 for v in errs):3d}  "
                  f"{sum(v <= 5 for v in errs):3d}  of {len(errs)}")
        est = [x["estimate"] for x in mine if x["estimate"]]
        inside = sum(abs(p["predicted_s"] - p["actual_s"]) <= 2 * p["std_s"] for p in est)
        print(f"  the actual time within 2 standard deviations of the estimate: {inside} of {len(est)}")
        tails = [x["tail"] for x in mine if x.get("tail")]
        if tails:
            def med(key: str) -> float:
                xs = [t[key] for t in tails if t[key] is not None]
                return statistics.median(xs) if xs else float("nan")

            print(f"  slow steps (> 3x the window's median): their extra time, as a share of the time, "
                  f"{med('window_pct'):.2f}% in the window, {med('rest_pct'):.2f}% in the rest (medians); "
                  f"the training thread ran on the CPU for {med('slow_cpu_share'):.0%} of it; garbage "
                  f"collection {med('gc_pct'):.3f}% of the epoch (nan: not recorded)", flush=True)
    store_rates(runs)
    return out


def host_kind(run: dict) -> str:
    """The kind of host a saved run ran on, from its model and file name: ``gpu`` (an H100 or
    H200 and its host), ``cpu-16`` (the CPU of a GPU host, 16 cores), ``devbox`` (the shared
    2-vCPU development host)."""
    if str(run.get("model", "")).startswith("gpu") or run.get("device") == "cuda":
        return "gpu"
    return "cpu-16" if ("h100host" in run.get("path", "") or "h200host" in run.get("path", "")) else "devbox"


def coverage(paths: list[str], fractions: tuple[float, ...] = (0.05, 0.10)) -> list[dict]:
    """How often the prediction's 90% interval holds the actual epoch, per host kind, in a fit's
    first epoch and in later ones, after each of ``fractions`` of the epoch: every saved epoch
    replayed with the current estimator (as :func:`replay`). Prints per group the epochs, the
    share inside ``low .. high``, the median half-width (% of the prediction), the median |error|
    and the share within two standard deviations (the interval before it counted drift); the
    demo's epochs (a cold store, its hot tier filling) again on their own."""
    runs = load_runs(paths)
    rows = []
    for r in runs:
        for e, trace in zip(r["epochs"], r["traces"]):
            every, kw = _epoch_setup(r, e, trace)
            for f in fractions:
                p = replay_epoch(trace, e["actual_s"], f, every, e["epoch"], **kw)
                if p is None:
                    continue
                rows.append({"kind": host_kind(r), "run": r["run"], "path": r["path"], "epoch": e["epoch"],
                             "fraction": f, **p,
                             "inside": p["low_s"] <= e["actual_s"] <= p["high_s"],
                             "inside_2std": abs(p["predicted_s"] - e["actual_s"]) <= 2 * p["std_s"],
                             "half_width_pct": 50 * (p["high_s"] - p["low_s"]) / p["predicted_s"]})
    print(f"{'host':<8}{'after':>6} {'epochs':<7}{'n':>5}{'in 90%':>9}{'width':>8}{'|error|':>9}{'in 2 sd':>9}")
    # the demo's epochs again on their own: a cold store's hot tier filling in the epoch
    shown = rows + [dict(r, kind="demo") for r in rows if r["run"].startswith("demo")]
    for kind in ("devbox", "cpu-16", "gpu", "demo"):
        for f in fractions:
            for label, pick in (("first", lambda x: x["epoch"] == 0), ("later", lambda x: x["epoch"] > 0),
                                ("all", lambda x: True)):
                mine = [x for x in shown if x["kind"] == kind and x["fraction"] == f and pick(x)]
                if not mine:
                    continue
                inside = sum(x["inside"] for x in mine)
                print(f"{kind:<8}{100 * f:>5.0f}% {label:<7}{len(mine):>5}{100 * inside / len(mine):>8.0f}%"
                      f"{statistics.median(x['half_width_pct'] for x in mine):>7.1f}%"
                      f"{statistics.median(abs(x['error_pct']) for x in mine):>8.1f}%"
                      f"{100 * sum(x['inside_2std'] for x in mine) / len(mine):>8.0f}%", flush=True)
    return rows


def store_rates(runs: list[dict]) -> list[dict]:
    """The store charge with the rates the stores measured in the run against the constants, on
    the same batches: for each probe of a demo epoch whose fill projection had measured rates
    (``store_fill_by_fraction``), the prediction the current :class:`Forecast` makes from the
    batches before the probe with that projection, and with it less the measured rates."""
    out = []
    for r in runs:
        if r.get("model") != "demo" or "traces" not in r:
            continue
        for e, trace in zip(r["epochs"], r["traces"]):
            n, saves, actual = len(trace["wall"]), set(trace["saves"]), e["actual_s"]
            for f, fill in sorted((trace.get("store_fill_by_fraction") or {}).items(), key=lambda x: float(x[0])):
                if not fill or len(fill) < 4 or not fill[3]:
                    continue
                k = max(1, round(float(f) * n))
                base = StoreFill(int(fill[0]), float(fill[1]), float(fill[2]))
                row = {"run": r["run"], "fraction": float(f), "rates": fill[3]}
                for name, sf in (("constants", base), ("measured", base._replace(rates=StoreRates(*fill[3])))):
                    fc = Forecast()
                    for i in range(k):
                        if i in saves:
                            fc.mark_save()
                        fc.add_step(trace["wall"][i], trace["store"][i])
                    at = [b for b in range(k, n) if b % 250 == 0]  # the demo's checkpoint every 250 steps
                    p = fc.estimate(n, 0, None, len(at), None, 0.0, None, store_fill=sf, save_batches=at)
                    row[name] = None if p is None else 100 * (p["seconds"] / actual - 1)
                out.append(row)
    if out:
        print("demo: the store charge with the rates measured in the run vs the constants, same batches "
              "(error after the fraction; rates MB/s filling, eviction):")
        for row in out:
            rates = "/".join("-" if x is None else f"{x / 1e6:.0f}" for x in row["rates"])
            print(f"  {row['run']:<22} {100 * row['fraction']:3.0f}%: constants {row['constants']:+6.1f}%  "
                  f"measured {row['measured']:+6.1f}%  ({rates})")
        for label in sorted({row["run"] for row in out}):
            for f in sorted({row["fraction"] for row in out if row["run"] == label}):
                mine = [row for row in out if row["fraction"] == f and row["run"] == label]
                print(f"  {label}, after {100 * f:.0f}%, {len(mine)} epochs: median |error| constants "
                      f"{statistics.median(abs(x['constants']) for x in mine):.1f}%, measured "
                      f"{statistics.median(abs(x['measured']) for x in mine):.1f}%", flush=True)
    return out


def tail(trace: dict, k: int) -> dict:
    """Where the rest of an epoch's extra time came from: steps slower than 3x the median of the
    rate's window (the later half of the first ``k`` steps), as a share of the window's and the
    rest's time; the share of those steps' extra time the training thread spent on the CPU (the rest
    is time it waited: another process on its core, a loader); garbage collection's share."""
    wall, saves, cpu = trace["wall"], set(trace["saves"]), trace.get("thread_cpu") or []
    window = [wall[i] for i in range(max(1, k // 2), k) if i not in saves]
    rest = [i for i in range(k, len(wall)) if i not in saves]
    med = statistics.median(window)
    cmed = statistics.median(cpu[max(1, k // 2):k]) if len(cpu) >= k else None

    def slow_pct(xs: list[float]) -> float:
        return 100 * sum(x - med for x in xs if x > 3 * med) / (med * len(xs)) if xs else 0.0

    slow = [i for i in rest if wall[i] > 3 * med and i < len(cpu)]
    extra = sum(wall[i] - med for i in slow)
    share = sum(cpu[i] - cmed for i in slow) / extra if slow and extra > 0 and cmed is not None else None
    gcs = trace.get("gc")
    return {"window_pct": slow_pct(window), "rest_pct": slow_pct([wall[i] for i in rest]),
            "slow_cpu_share": share,
            "gc_pct": 100 * sum(g[2] for g in gcs) / sum(wall) if gcs is not None else None}


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--coverage"]:
        coverage(sys.argv[2:])
    else:
        replay(sys.argv[1:])
