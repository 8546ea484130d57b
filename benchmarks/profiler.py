"""`embcache bench profiler`: StepProfiler against Lightning's profilers, interleaved in one run.

For a small model (~1 ms steps) and a larger one (~20-50 ms), with a loader whose per-batch cost
is known (a sleep, measured inside the dataset) and num_workers 0 and 2, each repetition runs the
same short fit once per configuration, in rotated order:
none, SimpleProfiler, AdvancedProfiler, PyTorchProfiler, ThroughputMonitor, StepProfiler.

An independent reference callback (present in every configuration, so its cost cancels) records
the epoch's wall time and each batch's start and end. Reported per (model, workers):
- overhead of each configuration: steady ms/batch (after warm-up) over the same repetition's
  no-profiler run, median and range over repetitions;
- StepProfiler's true average batch time against the reference epoch wall / batches;
- StepProfiler's phases summed against the reference wall;
- StepProfiler's data_wait against the loader's own measured time and against the whole gap
  between batches (what a profiler that calls the gap "data" would report).

``--device cuda`` adds the GPU checks (`benchmarks/profiler_gpu.py`); ``--paired``
interleaves the configurations in blocks of steps inside each fit instead
(`benchmarks/profiler_paired.py`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.profilers import AdvancedProfiler, PyTorchProfiler, SimpleProfiler
from torch.utils.data import DataLoader, Dataset

from lightning_embcache.profiling import PHASES, StepProfiler

CONFIGS = ("none", "simple", "advanced", "pytorch", "throughput", "step")
# name -> (width, depth, batch size, batches per fit, loader ms per batch)
MODELS = {
    "small": (64, 2, 32, 300, 0.3),
    # the shortest step Lightning runs on a CPU: a one-layer MLP, no loader cost (~1.3 ms here)
    "tiny": (16, 1, 16, 1000, 0.0),
    "large": (512, 2, 128, 30, 5.0),
    # GPU, no loader cost: launch-bound small steps; large batches (32 MB made, pinned and copied
    # on the training thread each step: the host sets the step); a step the GPU sets
    "gpu_small": (256, 2, 256, 200, 0.0),
    "gpu_large": (4096, 4, 2048, 40, 0.0),
    "gpu_deep": (4096, 12, 512, 40, 0.0),
}


class SleepyBatches(Dataset):
    """Whole batches (use batch_size=None) that each cost `load_ms` to produce, measured."""

    def __init__(self, n: int, batch: int, width: int, load_ms: float, device: str = "cpu") -> None:
        self.n, self.batch, self.width, self.load_s, self.device = n, batch, width, load_ms / 1e3, device
        self.loaded_s = 0.0
        self.x = torch.randn(batch, width)
        self.y = torch.randn(batch, 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        t0 = time.perf_counter()
        # a CPU-bound cost (decode, augment): a spin is exact where sleep() overshoots on a busy host
        while time.perf_counter() - t0 < self.load_s:
            pass
        out = (self.x.clone(), self.y.clone())
        self.loaded_s += time.perf_counter() - t0
        return out


class MLP(L.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Reference(L.Callback):
    """Independent timestamps: epoch start/end, each batch's start and end."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []  # main-thread CPU time: robust to other processes on the host
        self.epoch: tuple[float, float] = (0.0, 0.0)

    def on_train_epoch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.thread_time())

    def on_train_epoch_end(self, *args: Any) -> None:
        self.epoch = (self._t0, time.perf_counter())


def _profiler_and_callbacks(config: str, tmp: str, warmup: int, batch: int):
    if config == "none":
        return None, []
    if config == "simple":
        return SimpleProfiler(), []
    if config == "advanced":
        return AdvancedProfiler(dirpath=tmp, filename="advanced"), []
    if config == "pytorch":
        return PyTorchProfiler(dirpath=tmp, filename="pytorch"), []
    if config == "throughput":
        return None, [ThroughputMonitor(batch_size_fn=lambda b: batch)]
    if config == "step":
        return None, [StepProfiler(report=False, warmup_steps=warmup)]
    raise ValueError(f"config must be one of {CONFIGS}; got {config!r}")


def run_one(model_name: str, workers: int, config: str, warmup: int, device: str = "cpu",
            batches: int | None = None) -> dict:
    width, depth, batch, n, load_ms = MODELS[model_name]
    n = batches or n
    torch.manual_seed(0)
    model = MLP(width, depth)
    ds = SleepyBatches(n, batch, width, load_ms)
    dl = DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=(device == "cuda"))
    ref = Reference()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profiler, callbacks = _profiler_and_callbacks(config, tmp, warmup, batch)
        trainer = L.Trainer(accelerator=device, devices=1, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, profiler=profiler,
                            callbacks=[ref, *callbacks], default_root_dir=tmp)
        t0 = time.perf_counter()
        trainer.fit(model, dl)
        fit_s = time.perf_counter() - t0
    steady = (ref.ends[-1] - ref.ends[warmup - 1]) / (n - warmup) * 1e3
    steady_cpu = (ref.cpu_ends[-1] - ref.cpu_ends[warmup - 1]) / (n - warmup) * 1e3
    gaps = [ref.starts[i + 1] - ref.ends[i] for i in range(warmup, n - 1)]
    out = {
        "model": model_name, "workers": workers, "config": config, "batches": n,
        "fit_seconds": fit_s,
        "ref_epoch_seconds": ref.epoch[1] - ref.epoch[0],
        "ref_avg_batch_ms": 1e3 * (ref.epoch[1] - ref.epoch[0]) / n,
        "ref_steady_batch_ms": steady,
        "ref_steady_batch_cpu_ms": steady_cpu,
        "ref_gap_ms": 1e3 * statistics.fmean(gaps) if gaps else None,
        "loader_own_ms": 1e3 * ds.loaded_s / n if workers == 0 else None,
    }
    if config == "step":
        s = callbacks[0].summary()[0]
        out["step_summary"] = s
    return out


def actions_per_step(batches: int = 200) -> dict:
    """How many ``profiler.profile(...)`` actions Lightning opens per training step (small model,
    no StepProfiler): each costs Lightning's PassThroughProfiler a generator-based context, and
    StepProfiler's tap a shared no-op one, so this count times the difference is what the tap
    saves the loop per step."""
    from lightning.pytorch.profilers import PassThroughProfiler

    class Counting(PassThroughProfiler):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def profile(self, action_name: str) -> Any:
            self.calls += 1
            return super().profile(action_name)

    width, depth, batch, _, _ = MODELS["small"]
    counting = Counting()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, profiler=counting,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, default_root_dir=tmp)
        before = None

        class Mark(L.Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                nonlocal before
                if before is None:
                    before = counting.calls

        trainer.callbacks.append(Mark())
        trainer.fit(MLP(width, depth), DataLoader(SleepyBatches(batches, batch, width, 0.0), batch_size=None))
    return {"batches": batches, "actions_per_step": (counting.calls - before) / batches}


def own_cost_us(steps: int = 20000, device: str = "cpu") -> dict:
    """Microseconds per step StepProfiler adds to the loop, outside Lightning: the profiler
    actions of one automatic-optimization step in the order Lightning 2.6 opens them, through
    StepProfiler's tap, and each per-step callback hook the profiler leaves visible called as
    Lightning's ``_call_callback_hooks`` calls it (an action named after ``state_key`` around
    the call); minus the same sequence through a tap with no hooks (on ``device="cuda"`` with its
    CUDA events, read at log intervals as in a fit)."""
    from lightning.pytorch.profilers import PassThroughProfiler

    from benchmarks.profiler_own_step import best_of_5_us as per_call_us
    from benchmarks.profiler_own_step import lightning_step
    from lightning_embcache.profiling import boundaries
    from lightning_embcache.profiling.callback import _PER_STEP_HOOKS
    from lightning_embcache.profiling.tap import ProfilerTap
    from lightning_embcache.profiling.timeline import StepTimeline

    class _TrainingEpochLoop:
        _results = types.SimpleNamespace(batch=None)

    class _Stub:  # what the hooks read from the trainer
        current_epoch = 0
        global_step = 0
        is_global_zero = True
        loggers: list = []
        num_training_batches = steps
        fit_loop = types.SimpleNamespace(epoch_loop=_TrainingEpochLoop())
        strategy = types.SimpleNamespace()
        lightning_module = types.SimpleNamespace()

    sp = StepProfiler(report=False, log_every_n_steps=50)
    trainer = _Stub()
    sp._trainer = trainer
    sp._timeline = StepTimeline(sp._ledger.add_step, torch.device(device), None, sample_every=sp.sample_every_n_steps)
    sp._device = torch.device(device)
    sp._loop_batch = boundaries.loop_batch(trainer)
    sp._skip_hooks(_PER_STEP_HOOKS if sp._loop_batch is not None else _PER_STEP_HOOKS[1:])
    on_start, on_stop = boundaries.loop_actions(
        trainer, fetch=(sp._fetch_start, sp._fetch_stop), transfer=(sp._transfer_start, sp._transfer_stop),
        batch=(sp._batch_start, sp._batch_stop), backward=sp._backward_start, after_backward=None,
        before_optimizer_step=sp._optimizer_start, auto_step_stop=sp._auto_step_stop,
        manual_step=(sp._manual_step_start, sp._manual_step_stop))
    tap = ProfilerTap(PassThroughProfiler(), on_start, on_stop)
    sp._start_epoch(trainer, None)

    step = lightning_step(trainer, trainer.lightning_module, [sp], tap)
    # the same actions, no profiler
    bare = lightning_step(trainer, trainer.lightning_module, [], ProfilerTap(PassThroughProfiler(), {}, {}))

    pt = PassThroughProfiler()

    def action(profiler: Any) -> Any:
        def fn() -> None:
            with profiler.profile("[Callback]X.on_train_batch_start"):
                pass
        return fn

    out = {"stepprofiler": per_call_us(step, steps // 5), "empty_loop": per_call_us(bare, steps // 5)}
    out["own_us_per_step"] = out["stepprofiler"] - out["empty_loop"]
    out["callback_hooks_per_step"] = sum(callable(getattr(sp, h)) for h in _PER_STEP_HOOKS)
    # what Lightning's default profiler costs per profiled action, against the tap's no-op context
    out["passthrough_profile_us_per_action"] = per_call_us(action(pt), steps)
    out["tap_profile_us_per_action"] = per_call_us(action(tap), steps)
    return out


def _aggregate(runs: list[dict], reps: int) -> dict:
    agg: dict[str, Any] = {}
    keys = sorted({(r["model"], r["workers"]) for r in runs})
    for model, workers in keys:
        mine = [r for r in runs if r["model"] == model and r["workers"] == workers]
        base = {r["rep"]: r["ref_steady_batch_ms"] for r in mine if r["config"] == "none"}
        base_cpu = {r["rep"]: r["ref_steady_batch_cpu_ms"] for r in mine if r["config"] == "none"}
        entry: dict[str, Any] = {"no_profiler_steady_batch_ms": statistics.median(base.values()),
                                 "no_profiler_steady_batch_cpu_ms": statistics.median(base_cpu.values())}
        for cfg in CONFIGS:
            for tag, col, ref in (("", "ref_steady_batch_ms", base), ("cpu_", "ref_steady_batch_cpu_ms", base_cpu)):
                ratios = [r[col] / ref[r["rep"]] - 1 for r in mine if r["config"] == cfg and r["rep"] in ref]
                if ratios:
                    entry[f"overhead_{tag}{cfg}_pct"] = {"median": 100 * statistics.median(ratios),
                                                         "min": 100 * min(ratios), "max": 100 * max(ratios)}
        steps = [r for r in mine if r["config"] == "step"]
        if steps:
            avg_err = [abs(r["step_summary"]["avg_batch_ms"] / r["ref_avg_batch_ms"] - 1) for r in steps]
            sum_err = [abs(sum(r["step_summary"]["phases_ms"].values()) / r["ref_avg_batch_ms"] - 1)
                       for r in steps]
            entry["true_avg_vs_ref_wall_err_pct_max"] = 100 * max(avg_err)
            entry["phase_sum_vs_ref_wall_err_pct_max"] = 100 * max(sum_err)
            entry["phases_ms_median"] = {p: statistics.median(r["step_summary"]["phases_ms"][p] for r in steps)
                                         for p in PHASES}
            entry["avg_batch_ms_median"] = statistics.median(r["step_summary"]["avg_batch_ms"] for r in steps)
            entry["steady_batch_ms_median"] = statistics.median(r["step_summary"]["steady_batch_ms"] for r in steps)
            entry["gap_between_batches_ms_median"] = statistics.median(r["ref_gap_ms"] for r in steps)
            own = [r["loader_own_ms"] for r in steps if r["loader_own_ms"] is not None]
            if own:
                entry["loader_own_ms_median"] = statistics.median(own)
        agg[f"{model}/workers={workers}"] = entry
    return agg


def _print_table(agg: dict) -> None:
    for key, e in agg.items():
        print(f"\n== {key}: no-profiler steady batch {e['no_profiler_steady_batch_ms']:.3f} ms wall, "
              f"{e['no_profiler_steady_batch_cpu_ms']:.3f} ms main-thread CPU")
        for cfg in CONFIGS[1:]:
            o, c = e.get(f"overhead_{cfg}_pct"), e.get(f"overhead_cpu_{cfg}_pct")
            if o:
                print(f"  {cfg:<11} overhead wall {o['median']:+7.2f}% (range {o['min']:+.2f} .. {o['max']:+.2f}); "
                      f"CPU {c['median']:+7.2f}% (range {c['min']:+.2f} .. {c['max']:+.2f})")
        if "phases_ms_median" in e:
            ph = " ".join(f"{p}={v:.3f}" for p, v in e["phases_ms_median"].items())
            print(f"  StepProfiler phases (ms): {ph}")
            print(f"  true avg {e['avg_batch_ms_median']:.3f} ms, steady {e['steady_batch_ms_median']:.3f} ms; "
                  f"vs ref wall: avg err <= {e['true_avg_vs_ref_wall_err_pct_max']:.3f}%, "
                  f"phase sum err <= {e['phase_sum_vs_ref_wall_err_pct_max']:.3f}%")
            own = e.get("loader_own_ms_median")
            print(f"  data_wait {e['phases_ms_median']['data_wait']:.3f} ms; loader's own time "
                  f"{'n/a (workers)' if own is None else f'{own:.3f} ms'}; whole gap between batches "
                  f"{e['gap_between_batches_ms_median']:.3f} ms")


def _print_prediction(agg: dict) -> None:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}%"

    print("\nprediction after 5% of each epoch vs the actual epoch:")
    for label, a in agg.items():
        fit = ", ".join(f"{x:+.2f}%" for x in a["fit_error_pct"]) or "n/a"
        inside = a.get("within_90_interval_share")
        interval = "" if inside is None else (f"; in the 90% interval {100 * inside:.0f}% "
                                              f"(half-width {a['interval_half_width_pct_median']:.1f}%)")
        print(f"  {label:<28} |error| median {pct(a['epoch_abs_error_pct_median'])}, "
              f"max {pct(a['epoch_abs_error_pct_max'])}; fit {fit}; epoch ~{a['actual_epoch_s_median']:.1f} s{interval}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="embcache bench profiler", description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    ap.add_argument("--models", default="small,large", help="comma list of: " + ",".join(MODELS))
    ap.add_argument("--workers", default="0,2", help="comma list of num_workers values")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of: " + ",".join(CONFIGS))
    ap.add_argument("--batches", type=int, default=None, help="batches per fit (default: per model)")
    ap.add_argument("--warmup", type=int, default=10, help="batches left out of steady figures")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--prediction", action="store_true",
                    help="measure the epoch-time prediction instead (after 5%% of each epoch, against the actual "
                         "epoch; CPU models and the demo, or with --device cuda the GPU models and the demo on the GPU, "
                         "its codes filling a device tier)")
    ap.add_argument("--no-demo", action="store_true", help="with --prediction: leave the demo out")
    ap.add_argument("--demo-steps", default="400,-1",
                    help="with --prediction: the demo's --max-steps values (default 400,-1: its default run and "
                         "a full epoch)")
    ap.add_argument("--paired", action="store_true",
                    help="overhead from configurations interleaved in blocks of steps inside each fit (none, simple, "
                         "throughput, step; --reps fits of --batches steps): resolves a fraction of a percent")
    ap.add_argument("--block", type=int, default=20, help="with --paired: steps per block (default 20)")
    ap.add_argument("--pin", type=int, default=None,
                    help="run on this CPU only (os.sched_setaffinity; loader workers inherit it)")
    ap.add_argument("--out", default=None, help="write the JSON results here (default: print only)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    configs = args.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"--configs: {c!r} is not one of {CONFIGS}")
    if "none" not in configs:
        configs.insert(0, "none")
    models = args.models.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    result: dict[str, Any] = {
        "command": "embcache bench profiler " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                 "lightning": L.__version__, "threads": args.threads,
                 "loadavg_start": os.getloadavg()},
        "models": {m: dict(zip(("width", "depth", "batch", "batches", "load_ms"), MODELS[m])) for m in models if m in MODELS},
        "runs": [],
    }
    t_start = time.perf_counter()
    if args.prediction:
        from benchmarks import prediction

        # --models and --workers as given; by default every CPU model (or both GPU models);
        # --models demo: the demo alone
        chosen = args.models.split(",") if args.models != ap.get_default("models") else None
        result["prediction"] = prediction.run(
            args.device, args.reps, chosen, demo=not args.no_demo, workers=tuple(workers),
            demo_steps=tuple(int(x) for x in args.demo_steps.split(",")),
            partial=f"{args.out}.partial.jsonl" if args.out else None, batches=args.batches)
        _print_prediction(result["prediction"]["aggregate"])
    elif args.paired and args.device == "cpu":
        from benchmarks.profiler_paired import paired_fit, print_paired

        result["paired"] = []
        for model in models:
            for rep in range(args.reps):
                r = paired_fit(model, "cpu", batches=args.batches or 8000, block=args.block, seed=rep)
                print_paired(r)
                result["paired"].append(r)
    elif args.device == "cpu":
        for model in models:
            for w in workers:
                for rep in range(args.reps):
                    order = configs[rep % len(configs):] + configs[:rep % len(configs)]
                    for cfg in order:
                        r = run_one(model, w, cfg, args.warmup, batches=args.batches)
                        r["rep"] = rep
                        result["runs"].append(r)
                        print(f"{model} workers={w} rep={rep} {cfg:<10} steady {r['ref_steady_batch_ms']:.3f} ms/batch",
                              flush=True)
        result["aggregate"] = _aggregate(result["runs"], args.reps)
        _print_table(result["aggregate"])
        result["own_cost"] = own_cost_us()
        result["own_cost"].update(actions_per_step())
        oc = result["own_cost"]
        saved = oc["actions_per_step"] * (oc["passthrough_profile_us_per_action"] - oc["tap_profile_us_per_action"])
        oc["net_us_per_step"] = oc["own_us_per_step"] - saved
        print("\nStepProfiler's own work, outside Lightning: "
              f"{oc['own_us_per_step']:.2f} us/step; per profiled action: Lightning's "
              f"PassThroughProfiler {oc['passthrough_profile_us_per_action']:.3f} us, "
              f"the tap's no-op context {oc['tap_profile_us_per_action']:.3f} us; Lightning opens "
              f"{oc['actions_per_step']:.1f} actions per step, so the tap saves {saved:.2f} us/step: "
              f"net {oc['net_us_per_step']:+.2f} us/step")
    else:
        from benchmarks.profiler_gpu import gpu_checks

        gpu_checks(result, reps=args.reps, batches=args.batches or 200, paired=args.paired, block=args.block)
        result["gpu"]["own_cost"] = own_cost_us(steps=5000, device="cuda")
        print(json.dumps(result["gpu"], indent=1))
    result["host"]["loadavg_end"] = os.getloadavg()
    result["elapsed_seconds"] = time.perf_counter() - t_start
    if args.out:  # written only where the user says
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
