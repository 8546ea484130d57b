"""The GPU half of `embcache bench profiler --device cuda`: no added synchronization inside
steady steps (``torch.cuda.set_sync_debug_mode("error")``), StepProfiler's CUDA-event phases
against a ``torch.profiler`` trace, and the overhead (whole fits interleaved, or with
``--paired`` configurations interleaved in blocks of steps inside each fit)."""

from __future__ import annotations

import bisect
import itertools
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from benchmarks.profiler import MLP, MODELS, SleepyBatches, _aggregate, run_one
from lightning_embcache.profiling import StepProfiler


class _ListLogger(Logger):
    """Keeps logged metrics in memory (exercises StepProfiler's logging path)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


class _SyncGuard(L.Callback):
    """torch.cuda.set_sync_debug_mode("error") from batch `first` to batch `last` (inclusive),
    boundaries and the fetches between batches included: any synchronization there raises."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.steps_guarded = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.first:
            torch.cuda.set_sync_debug_mode("error")
        if self.first <= batch_idx <= self.last:
            self.steps_guarded += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.last + 1 or batch_idx == trainer.num_training_batches - 1:
            torch.cuda.set_sync_debug_mode(0)

    def on_train_epoch_end(self, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)


def _gpu_fit(model_name: str, callbacks: list, epochs: int = 1, batches: int | None = None,
             logger: Any = False, profiler: Any = None) -> None:
    width, depth, batch, n, load_ms = MODELS[model_name]
    torch.manual_seed(0)
    dl = DataLoader(SleepyBatches(batches or n, batch, width, load_ms), batch_size=None, pin_memory=True)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(accelerator="cuda", devices=1, max_epochs=epochs, logger=logger, profiler=profiler,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=tmp).fit(MLP(width, depth), dl)


def sync_check(batches: int, warmup: int) -> dict:
    """Steady-state steps run under sync-debug "error", with and without StepProfiler."""
    out = {}
    for name in ("none", "step"):
        guard = _SyncGuard(warmup, batches - 5)
        cbs: list = [guard]
        prof = None
        if name == "step":
            prof = StepProfiler(log_every_n_steps=5, report=False, warmup_steps=warmup)
            cbs.append(prof)
        logger = _ListLogger()
        try:
            _gpu_fit("gpu_small", cbs, batches=batches, logger=logger)
            err = None
        except RuntimeError as e:  # what sync-debug "error" raises
            err = str(e).splitlines()[0][:300]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out[name] = {"error": err, "steps_guarded": guard.steps_guarded,
                     "profile_log_calls": sum(1 for _, m in logger.rows if "profile/step_ms" in m)}
        if prof is not None and prof.summary():
            out[name]["summary"] = prof.summary()[0]
            out[name]["events_recorded"] = prof._timeline.events_recorded
            out[name]["events_per_step"] = prof._timeline.events_recorded / batches
    return out


class _Annotate(L.Callback):
    """torch.profiler ranges over the same windows StepProfiler uses for forward/backward/optimizer,
    and the profiler itself running over epoch 1 only (epoch 0 is warm-up)."""

    def __init__(self, prof) -> None:
        self.prof, self.open = prof, None

    def _enter(self, name: str | None) -> None:
        if self.open is not None:
            self.open.__exit__(None, None, None)
            self.open = None
        if name is not None and self.prof is not None:
            self.open = torch.profiler.record_function(name)
            self.open.__enter__()

    def on_train_epoch_start(self, trainer, *args: Any) -> None:
        if trainer.current_epoch == 1:
            self.prof.start()

    def on_train_epoch_end(self, trainer, *args: Any) -> None:
        self._enter(None)
        if trainer.current_epoch == 1:
            self.prof.stop()

    def on_train_batch_start(self, *args: Any) -> None:
        self._enter("sp::forward")

    def on_before_backward(self, *args: Any) -> None:
        self._enter("sp::backward")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._enter("sp::optimizer")

    def on_train_batch_end(self, *args: Any) -> None:
        self._enter(None)


def device_spans(launched: list[tuple[float, float]], windows: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Total time each phase's windows (host start, host end) span on the device, as CUDA events
    recorded at their two ends time it: an event completes once the host has recorded it and all
    work launched before it is done. ``launched``: (host launch time, device end) of each device
    op. The kernel time alone leaves out the device's idle gaps inside a window (waiting for the
    host's launches), which the events' span holds."""
    launched = sorted(launched)
    at = [t for t, _ in launched]
    done = list(itertools.accumulate((e for _, e in launched), max))

    def completes(host_t: float) -> float:
        i = bisect.bisect_left(at, host_t)  # work launched before the event, not at it
        return max(host_t, done[i - 1]) if i else host_t

    return {k: sum(completes(b) - completes(a) for a, b in spans) for k, spans in windows.items()}


def trace_check(model_name: str = "gpu_large", batches: int = 480) -> dict:
    """Device time of the kernels launched in each window (torch.profiler trace) against
    StepProfiler's CUDA-event phases, over the same epoch."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    sp = StepProfiler(report=False)
    ann = _Annotate(prof)
    _gpu_fit(model_name, [sp, ann], epochs=2, batches=batches)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    events = trace.get("traceEvents", trace)
    windows = {"forward": [], "backward": [], "optimizer": []}
    launches: dict[Any, float] = {}
    device_ops = []
    for ev in events:
        cat = ev.get("cat", "")
        name = ev.get("name", "")
        if cat == "user_annotation" and name.startswith("sp::"):
            windows[name[4:]].append((ev["ts"], ev["ts"] + ev.get("dur", 0)))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in ev.get("args", {}):
            launches[ev["args"]["correlation"]] = ev["ts"]
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            device_ops.append(ev)
    kernel_ms = {k: 0.0 for k in windows}
    launched = []  # (host launch time, device end) of every device op
    for ev in device_ops:
        t = launches.get(ev.get("args", {}).get("correlation"))
        if t is None:
            continue
        launched.append((t, ev["ts"] + ev.get("dur", 0)))
        for phase, spans in windows.items():
            if any(a <= t <= b for a, b in spans):
                kernel_ms[phase] += ev.get("dur", 0) / 1e3
                break
    span_ms = {k: v / 1e3 for k, v in device_spans(launched, windows).items()}
    summary = sp.summary()[1]
    n = summary["batches"]
    trace_per_step = {k: v / n for k, v in kernel_ms.items()}
    span_per_step = {k: v / n for k, v in span_ms.items()}
    cmp = {}
    for k in windows:
        ev_ms = summary["phases_ms"][k]
        cmp[k] = {"step_profiler_cuda_events_ms": ev_ms, "trace_kernels_ms": trace_per_step[k],
                  "trace_device_span_ms": span_per_step[k],
                  "host_clock_ms": summary["host_phases_ms"][k],
                  "diff_pct": 100 * (ev_ms / trace_per_step[k] - 1) if trace_per_step[k] else None,
                  "diff_span_pct": 100 * (ev_ms / span_per_step[k] - 1) if span_per_step[k] else None}
    return {"model": model_name, "batches_in_epoch": n, "phases": cmp, "summary_epoch1": summary}


def overhead_check(batches: int, warmup: int, reps: int) -> dict:
    runs = []
    configs = ["none", "step", "throughput", "simple"]
    for rep in range(reps):
        for cfg in configs[rep % 4:] + configs[:rep % 4]:  # rotated: no config always runs first
            r = run_one("gpu_small", 0, cfg, warmup, device="cuda", batches=batches)
            r["rep"] = rep
            runs.append(r)
    # where a StepProfiler fit's host time goes (cProfile, one fit; inflates every call alike)
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run_one("gpu_small", 0, "step", warmup, device="cuda", batches=batches)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return {"runs": runs, "aggregate": _aggregate(runs, reps), "cprofile_step_fit": text.getvalue()}


def gpu_checks(out: dict, reps: int = 3, batches: int = 200, paired: bool = False, block: int = 20) -> None:
    """Zero added syncs in steady steps, phases against a torch.profiler trace, and the overhead
    (whole fits interleaved, or with ``paired`` configurations interleaved in blocks of steps
    inside each fit) (CUDA only)."""
    out["gpu"] = {"device_name": torch.cuda.get_device_name(0), "torch": torch.__version__}
    out["gpu"]["sync"] = sync_check(batches=200, warmup=10)
    print("sync check:", {k: v.get("error") for k, v in out["gpu"]["sync"].items()},
          "events/step", out["gpu"]["sync"].get("step", {}).get("events_per_step"), flush=True)
    out["gpu"]["trace"] = trace_check(batches=480)  # ~60 device-timed steps: 60 batches' ~8 moved the mean by 5%
    print("trace check:", {k: round(v["diff_pct"], 2) for k, v in out["gpu"]["trace"]["phases"].items()
                           if v["diff_pct"] is not None},
          "against the device span:", {k: round(v["diff_span_pct"], 2) for k, v in out["gpu"]["trace"]["phases"].items()
                                        if v["diff_span_pct"] is not None}, flush=True)
    if paired:
        from benchmarks.profiler_paired import paired_fit, print_paired

        out["gpu"]["paired"] = []
        for rep in range(reps):
            r = paired_fit("gpu_small", "cuda", batches=batches, block=block, seed=rep)
            print_paired(r)
            out["gpu"]["paired"].append(r)
    else:
        out["gpu"]["overhead"] = overhead_check(batches=batches, warmup=20, reps=reps)
