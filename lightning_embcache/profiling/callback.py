"""StepProfiler: where every millisecond of a training step goes."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info, WarningCache
from typing_extensions import override

from lightning_embcache.profiling import ranks, report, schedule
from lightning_embcache.profiling import summary as summaries
from lightning_embcache.profiling.forecast import Forecast
from lightning_embcache.profiling.tap import ProfilerTap
from lightning_embcache.profiling.timeline import (
    BACKWARD, DATA, FORWARD, OPTIMIZER, OTHER, STORE, VALIDATION, StepTimeline, Totals,
)

log = logging.getLogger(__name__)
warning_cache = WarningCache()

_STATE_VERSION = 1
_PROFILER_METHODS = frozenset({"profile", "start", "stop", "describe", "teardown_profiler"})
_NOT_A_PROFILER = ("StepProfiler is a callback, not a Lightning profiler: pass it as "
                   "Trainer(callbacks=[StepProfiler()]), not Trainer(profiler=StepProfiler()). It wraps whatever "
                   "Trainer(profiler=...) you choose, so the two can run together.")


def _batch_size(batch: Any) -> int:
    """Lightning's ``extract_batch_size`` (about 10 us) with a fast path for the common layouts."""
    if isinstance(batch, torch.Tensor):
        return batch.size(0) if batch.ndim else 1
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].ndim:
        return batch[0].size(0)
    return extract_batch_size(batch)


class StepProfiler(Callback):
    r"""Measures, for every training step, how long it waited for data, ran forward, backward and
    the optimizer, waited on embedding stores, and spent elsewhere; the phases add up to the
    step's wall time.

    Example::

        profiler = StepProfiler(warmup_steps=20, plot="phases.png")
        trainer = Trainer(callbacks=[profiler])   # a callback, not Trainer(profiler=...)
        trainer.fit(model)
        for epoch in profiler.summary():
            print(epoch["avg_batch_ms"], epoch["phases_ms"], epoch["predicted_epoch_seconds"])

    Phases (what each window includes):
        - ``data_wait``: the loader's own ``next()`` (fetch, collate, worker hand-off) and the
          ``batch_to_device`` transfer; for the first batch of an epoch, from the epoch's start
          (iterator creation and worker start-up included).
        - ``forward``: ``on_train_batch_start`` to ``on_before_backward`` (``training_step``, and
          ``zero_grad`` which Lightning runs after it). Under manual optimization, all of your
          ``training_step`` code outside ``manual_backward`` and ``opt.step()``.
        - ``backward``: ``on_before_backward`` to ``on_before_optimizer_step`` (or to batch end on
          an accumulation micro-step); includes the DDP gradient all-reduce.
        - ``optimizer``: ``on_before_optimizer_step`` to the return of the optimizer step
          (gradient clipping, ``optimizer.step()``, the AMP scaler update). Lightning has no
          after-step hook; the return is seen through the profiler action that wraps the step.
        - ``store_io``: seconds the training thread waited in ``EmbeddingStore`` calls, from the
          stores' ``stats().io_wait_seconds`` (``pl_module.embedding_stores``), taken out of the
          phase they happened in.
        - ``other``: everything else in the loop: hooks of other callbacks, logging, progress bar,
          LR schedulers, loop bookkeeping between batches.

    Notes:
        - Validation inside a training epoch is excluded from steps and reported as ``val_seconds``.
        - On CUDA the phases come from CUDA events recorded at the same boundaries on about one
          step in ``sample_every_n_steps`` (the others cost no device work) and read only after
          they completed (never a synchronization inside a step): the epoch's wall time is split
          in the proportions the timed steps show. ``host_phases_ms`` keeps the host-clock view
          of every step. At each epoch's start and end (and at checkpoints) the profiler waits
          for the device, outside any step, so that an epoch's wall time covers its device work.
        - After a few steps of each epoch the profiler predicts the epoch's wall time (and the
          fit's, under ``max_epochs``/``max_steps``), logs it, and keeps the prediction made at
          ``predict_at`` of the epoch for the end-of-fit table (see docs/profiler.md).
        - On several ranks each log interval and each epoch end costs one all-reduce, which every
          rank joins; figures are means over ranks, with the per-rank maximum, the slowest rank and
          the spread beside them.
        - The Trainer's profiler is wrapped (not replaced) from ``setup`` to ``teardown``; your own
          profiler still sees every action.

    Args:
        log_every_n_steps: Log ``profile/*`` metrics every this many training batches (default:
            the Trainer's ``log_every_n_steps``).
        warmup_steps: Batches at the start of each epoch left out of ``steady_batch_ms``.
        report: Print the phase table at the end of training (rank zero).
        plot: Path of a PNG stacked-bar chart of the phases per epoch, saved at the end of training
            (needs matplotlib: ``pip install 'lightning_embcache[plot]'``; skipped with a warning
            without it).
        batch_size_fn: ``batch -> int`` samples in a batch; default: inferred from the batch.
        epoch_batches: Batches in a full epoch, the epoch that is predicted (default: the batches
            this fit runs in the epoch: the Trainer's ``num_training_batches``, fewer where
            ``max_steps`` ends the fit first); set it when a benchmark runs a limited epoch.
        sample_every_n_steps: On CUDA, time about one step in this many on the device (random
            gaps averaging this; 1 = every step). No effect on the host clock.
        predict_at: Fraction of the epoch after which the prediction kept for the summary and
            the table is made (default 0.05: after 5% of the epoch's batches).

    Raises:
        ValueError: If ``log_every_n_steps < 1``, ``warmup_steps < 0``, ``epoch_batches < 1``,
            ``sample_every_n_steps < 1`` or ``predict_at`` is outside ``(0, 1]``.
        TypeError: If ``batch_size_fn`` is given and not callable.
        MisconfigurationException: If passed as ``Trainer(profiler=StepProfiler())``: it is a
            callback. (Two StepProfilers in one Trainer need different settings: Lightning refuses
            two callbacks with one ``state_key``.)
    """

    def __init__(self, log_every_n_steps: Optional[int] = None, warmup_steps: int = 0, report: bool = True,
                 plot: Optional[Union[str, Path]] = None, *,
                 batch_size_fn: Optional[Callable[[Any], int]] = None,
                 epoch_batches: Optional[int] = None, sample_every_n_steps: int = 8,
                 predict_at: float = 0.05) -> None:
        super().__init__()
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"Invalid value for log_every_n_steps={log_every_n_steps!r}. "
                             "Must be None (the Trainer's) or an int >= 1")
        if not isinstance(sample_every_n_steps, int) or sample_every_n_steps < 1:
            raise ValueError(f"Invalid value for sample_every_n_steps={sample_every_n_steps!r}. Must be an int >= 1")
        if not isinstance(predict_at, (int, float)) or not 0.0 < predict_at <= 1.0:
            raise ValueError(f"Invalid value for predict_at={predict_at!r}. Must be a number in (0, 1]")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"Invalid value for warmup_steps={warmup_steps!r}. Must be an int >= 0")
        if epoch_batches is not None and (not isinstance(epoch_batches, int) or epoch_batches < 1):
            raise ValueError(f"Invalid value for epoch_batches={epoch_batches!r}. Must be None or an int >= 1")
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise TypeError(f"batch_size_fn must be callable; got {type(batch_size_fn).__name__}")
        self._log_every_arg = log_every_n_steps
        self.log_every_n_steps = log_every_n_steps or 50  # replaced by the Trainer's in setup
        self.warmup_steps = warmup_steps
        self.sample_every_n_steps = sample_every_n_steps
        self.predict_at = float(predict_at)
        self.report = report
        self.plot = plot
        self.batch_size_fn = batch_size_fn
        self.epoch_batches = epoch_batches

        self._summaries: list[dict] = []
        self._raw: dict[int, Totals] = {}      # totals of finished epochs (for resume)
        self._open: Optional[Totals] = None     # the running epoch
        self._open_epoch = -1
        self._step_in_epoch = 0
        self._interval = Totals()
        # finished steps not yet added to the epoch's and the interval's totals: one add per step,
        # folded into both at each log interval, epoch end and checkpoint
        self._steps = Totals()
        self._steps_epoch = -1
        self._batches_seen = 0
        self._samples_known = True
        self._samples = 0
        self._resume: Optional[dict] = None
        self._timeline: Optional[StepTimeline] = None
        self._tap: Optional[ProfilerTap] = None
        self._device: Optional[torch.device] = None
        self._pending_logs: list = []
        self._manual = False
        self._stores: Optional[dict] = None
        self._data_resume = OTHER
        self._batch_ended = False
        self._next_log = self.log_every_n_steps
        self._trainer: Optional[Trainer] = None
        # epoch-time prediction: this epoch's steps, the prediction kept for the summary, and
        # what earlier epochs and validation runs of the fit measured
        self._forecast: Optional[Forecast] = None
        self._kept_prediction: Optional[dict] = None
        self._last_prediction: Optional[dict] = None
        self._val_run_s: list[float] = []
        self._val_t0 = 0.0
        self._sanity_t0 = 0.0
        self._sanity_batch_s: Optional[float] = None
        self._first_extra_s: Optional[float] = None
        self._save_s: Optional[float] = None
        self._landmark: Optional[int] = None
        # per epoch, per rank: [phase seconds..., batches]; a resumed epoch replaces its entry
        self._rank_rows: dict[int, list[list[float]]] = {}
        self._val_resume = OTHER

    # ------------------------------------------------------------------ public API

    def summary(self) -> list[dict]:
        """One dict per finished training epoch (see docs/profiler.md for every key)."""
        return [dict(s) for s in self._summaries]

    def predict(self) -> Optional[dict[str, Optional[float]]]:
        """The current prediction: ``{"epoch_s", "epoch_std_s", "fit_s", "fit_std_s",
        "at_batch", "epoch_batches"}`` (wall seconds, validation inside the epoch included;
        ``fit_s`` None without ``max_epochs``/``max_steps``), or None before enough steps of the
        running epoch (docs/profiler.md: how to read it)."""
        if self._trainer is None or self._forecast is None:
            return None
        return self._prediction(self._trainer)

    def report_table(self) -> str:
        """The end-of-fit table (phases, true average batch, predicted vs actual epoch times)."""
        return report.format_table(self._summaries, self._fit_rank_rows())

    @property
    @override
    def state_key(self) -> str:
        # two StepProfilers with different settings keep separate checkpoint entries
        return self._generate_state_key(log_every_n_steps=self._log_every_arg, warmup_steps=self.warmup_steps,
                                        epoch_batches=self.epoch_batches,
                                        plot=None if self.plot is None else str(self.plot))

    @override
    def state_dict(self) -> dict[str, Any]:
        open_state = None
        if self._open is not None:
            if self._batch_ended:  # checkpoint saved in on_train_batch_end: that batch is done
                self._close_step(None, log=False)
            if self._forecast is not None:
                # Lightning asks for this state when it saves a checkpoint: the save's time falls
                # in the step now running, which the prediction keeps out of the rate
                self._forecast.mark_save()
            if self._timeline is not None:
                self._timeline.drain(block=True)  # a checkpoint synchronizes anyway
            self._fold_steps()
            open_state = {"epoch": self._open_epoch, "steps": self._step_in_epoch,
                          "totals": self._open.to_dict()}
        return {"version": _STATE_VERSION, "summaries": [dict(s) for s in self._summaries],
                "raw": {e: t.to_dict() for e, t in self._raw.items()}, "open": open_state,
                "batches_seen": self._batches_seen, "rank_rows": self._rank_rows}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(f"StepProfiler state version must be {_STATE_VERSION}; got {state_dict.get('version')!r}")
        self._summaries = [dict(s) for s in state_dict["summaries"]]
        self._raw = {int(e): Totals.from_dict(t) for e, t in state_dict["raw"].items()}
        self._resume = state_dict["open"]
        self._batches_seen = state_dict.get("batches_seen", 0)
        self._next_log = (self._batches_seen // self.log_every_n_steps + 1) * self.log_every_n_steps
        self._rank_rows = {int(e): [list(r) for r in rows] for e, rows in state_dict.get("rank_rows", {}).items()}

    # ------------------------------------------------------------------ set-up / tear-down

    def __getattr__(self, name: str) -> Any:
        # only reached for missing attributes: Trainer(profiler=StepProfiler()) calls these first
        if name in _PROFILER_METHODS:
            raise MisconfigurationException(_NOT_A_PROFILER)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @override
    def setup(self, trainer: Optional[Trainer] = None, pl_module: Optional[LightningModule] = None,
              stage: Optional[str] = None, **profiler_kwargs: Any) -> None:
        if not isinstance(trainer, Trainer):
            # Trainer(profiler=StepProfiler()): Lightning calls profiler.setup(stage=, local_rank=, log_dir=)
            raise MisconfigurationException(_NOT_A_PROFILER)
        if stage != "fit":
            return
        if self._log_every_arg is None:
            self.log_every_n_steps = max(1, int(trainer.log_every_n_steps))
            self._next_log = (self._batches_seen // self.log_every_n_steps + 1) * self.log_every_n_steps
        if self._tap is not None and trainer.profiler is self._tap:
            return
        loop_name = type(trainer.fit_loop.epoch_loop).__name__
        strategy = type(trainer.strategy).__name__
        module = type(trainer.lightning_module).__name__
        on_start = {
            f"[{loop_name}].train_dataloader_next": self._fetch_start,
            f"[Strategy]{strategy}.batch_to_device": self._transfer_start,
            "optimizer_step": self._manual_step_start,
        }
        on_stop = {
            f"[{loop_name}].train_dataloader_next": self._fetch_stop,
            f"[Strategy]{strategy}.batch_to_device": self._transfer_stop,
            f"[LightningModule]{module}.optimizer_step": self._auto_step_stop,
            "optimizer_step": self._manual_step_stop,
        }
        self._tap = ProfilerTap(trainer.profiler, on_start, on_stop)
        trainer.profiler = self._tap

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._tap is not None:
            trainer.profiler = ProfilerTap.remove(trainer.profiler, self._tap)
        self._tap = None
        self._trainer = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # give the Trainer its own profiler back

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device = trainer.strategy.root_device
        self._trainer = trainer
        self._manual = not pl_module.automatic_optimization
        self._stores = getattr(pl_module, "embedding_stores", None)
        store_io = self._store_io if self._stores is not None else None
        self._timeline = StepTimeline(self._on_step_done, self._device, store_io,
                                      sample_every=self.sample_every_n_steps)
        self._timeline.on_device_step = self._on_device_step

    def _fit_rank_rows(self) -> list[list[float]]:
        """Per rank, phase seconds and batches summed over the epochs (ranks as in the last epoch)."""
        out: list[list[float]] = []
        for rows in self._rank_rows.values():
            if len(rows) != len(out):
                out = [list(r) for r in rows]
            else:
                out = [[a + b for a, b in zip(x, y)] for x, y in zip(out, rows)]
        return out

    def _store_io(self) -> float:
        # io_wait_seconds is O(1); stats() scans dirty marks and the store folder (ms on big tables)
        return sum(h.io_wait_seconds if hasattr(h, "io_wait_seconds") else h.stats().io_wait_seconds
                   for h in self._stores.values())

    # ------------------------------------------------------------------ epochs

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_epoch(trainer, pl_module)

    def _start_epoch(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # also reached lazily from the first fetch: Lightning skips on_train_epoch_start when it
        # resumes inside an epoch
        epoch = trainer.current_epoch
        if self._stores is None and getattr(pl_module, "embedding_stores", None) is not None:
            self._stores = pl_module.embedding_stores  # created after on_train_start
            self._timeline.store_io = self._store_io
        self._step_in_epoch = 0
        self._batch_ended = False
        self._open = Totals()
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] == epoch:
            self._open = Totals.from_dict(resume["totals"])
            self._step_in_epoch = resume["steps"]
        elif resume is not None and resume["epoch"] < epoch:
            self._open_epoch = resume["epoch"]
            self._open = Totals.from_dict(resume["totals"])
            self._finish_epoch(trainer)  # an epoch left unfinished by the run we resume from
            self._open = Totals()
        elif self._summaries and self._summaries[-1]["epoch"] == epoch and epoch in self._raw:
            # resumed inside an epoch that the earlier run closed early (max_steps, interruption)
            self._summaries.pop()
            self._open = self._raw.pop(epoch)
            self._step_in_epoch = self._open.batches
        self._open_epoch = epoch
        self._forecast = Forecast(self._step_in_epoch, self._open.wall_s + self._open.val_s)
        self._forecast.needs_device = self._timeline._cuda and self.sample_every_n_steps > 0
        self._kept_prediction = None
        self._landmark: Optional[int] = None
        self._timeline.begin(DATA)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tl = self._timeline
        if tl is None or not tl.active:
            return
        # the last batch's step runs to here: everything after its end (validation aside) is its "other"
        last = None
        if self._batch_ended:
            self._batch_ended = False
            last = (self._samples, self._step_in_epoch >= self.warmup_steps)
            self._step_in_epoch += 1
            self._batches_seen += 1
        tl.end_epoch(self._open_epoch, last)
        if last is not None:
            self._feed(tl.last_host, trainer)
        tl.drain(block=True)  # once per epoch, outside any step
        if last is not None and self._batches_seen >= self._next_log:
            self._log_interval(trainer)
        self._finish_epoch(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tl = self._timeline
        if tl is not None and tl.active and not trainer.sanity_checking:
            self._val_resume = tl.phase
            tl.switch(VALIDATION)
            self._val_t0 = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tl = self._timeline
        if tl is not None and tl.active and tl.phase == VALIDATION:
            tl.switch(self._val_resume)
            seconds = time.perf_counter() - self._val_t0
            self._val_run_s.append(seconds)
            if self._forecast is not None:
                self._forecast.add_validation(seconds)

    @override
    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking:
            self._sanity_t0 = time.perf_counter()

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        # The sanity check's last batch estimates a validation batch until a real run is seen:
        # its first batch also pays one-time set-up (the loader's start, the first eval kernels),
        # which made a whole run's estimate several times too long
        if trainer.sanity_checking:
            self._sanity_batch_s = time.perf_counter() - self._sanity_t0

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timeline is not None:
            self._timeline.drain(block=True)
        self._flush_pending_logs(trainer, block=True)
        if not trainer.is_global_zero:
            return
        if self.report and self._summaries:
            self._print_report()
        if self.plot is not None and self._summaries:
            report.save_plot(self._summaries, self.plot)

    # ------------------------------------------------------------------ steps (hot path)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._timeline.active:
            self._start_epoch(trainer, pl_module)
        if self._batch_ended:
            self._close_step(trainer)
        self._timeline.switch(FORWARD)
        if self._samples_known:
            try:
                self._samples = int(self.batch_size_fn(batch) if self.batch_size_fn is not None
                                    else _batch_size(batch))
            except Exception as err:  # an opaque batch: report no samples/s rather than fail training
                self._samples_known = False
                self._samples = 0
                warning_cache.warn(f"StepProfiler could not infer the batch size ({err}); samples_per_sec "
                                   "will be None. Pass StepProfiler(batch_size_fn=...).")

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._timeline.switch(BACKWARD)

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._manual:  # back in the user's training_step code
            self._timeline.switch(FORWARD)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._timeline.switch(OPTIMIZER)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # A step runs from its fetch to the next fetch: what Lightning and other callbacks do after
        # this batch (logging, checkpoints, progress bar) is this step's "other".
        self._timeline.switch(OTHER)
        self._batch_ended = True

    def _print_report(self) -> None:
        table = self.report_table()
        # Lightning's INFO messages reach the console by default; with logging at WARNING (or a
        # handler-less logger) the table would vanish, so it is printed instead
        from lightning_utilities.core import rank_zero as _rz

        if _rz.log.isEnabledFor(logging.INFO) and _rz.log.hasHandlers():
            rank_zero_info(table)
        else:
            print(table, flush=True)

    def _close_step(self, trainer: Optional[Trainer], log: bool = True, next_phase: int = OTHER) -> None:
        self._batch_ended = False
        host = self._timeline.end_step(self._open_epoch, self._samples, self._step_in_epoch >= self.warmup_steps,
                                       next_phase)
        self._feed(host, trainer if trainer is not None else self._trainer)
        self._step_in_epoch += 1
        self._batches_seen += 1
        if log and self._batches_seen >= self._next_log:
            self._log_interval(trainer)

    # tap callbacks: the trainer's profiler saw one of the actions that bound a phase
    def _fetch_start(self) -> None:
        tl = self._timeline
        if tl is None:
            return
        if not tl.active and self._trainer is not None:
            self._start_epoch(self._trainer, self._trainer.lightning_module)
        if tl.active and tl.phase != VALIDATION:
            if self._batch_ended:  # the step closes where the next one's fetch starts
                self._close_step(self._trainer, next_phase=DATA)
                self._data_resume = OTHER
            else:
                self._data_resume = tl.phase if tl.phase != DATA else OTHER
                tl.switch(DATA)

    def _fetch_stop(self) -> None:
        tl = self._timeline
        if tl is not None and tl.active and tl.phase == DATA:
            # back to loop code: on CUDA the device segment stays data until the transfer's end
            tl.switch(self._data_resume, device=self._data_resume != OTHER)

    def _transfer_start(self) -> None:
        tl = self._timeline
        if tl is not None and tl.active and tl.phase != VALIDATION:  # validation moves batches too
            if self._batch_ended:
                self._close_step(self._trainer)
            # the first fetch of an epoch is already in DATA (since the epoch started)
            self._data_resume = tl.phase if tl.phase != DATA else OTHER
            tl.switch(DATA)

    def _transfer_stop(self) -> None:
        tl = self._timeline
        if tl is not None and tl.active and tl.phase == DATA:
            # back to loop code: on CUDA the device segment stays data until the batch starts
            # (one event per step fewer; the host clock still charges that loop code to other)
            tl.switch(self._data_resume, device=self._data_resume != OTHER)

    def _auto_step_stop(self) -> None:
        tl = self._timeline
        if tl is not None and tl.active:
            tl.switch(OTHER)

    def _manual_step_start(self) -> None:
        tl = self._timeline
        if tl is not None and tl.active:
            tl.switch(OPTIMIZER)

    def _manual_step_stop(self) -> None:
        tl = self._timeline
        if tl is not None and tl.active:
            tl.switch(FORWARD)

    def _on_step_done(self, epoch: int, batches: int, host: list[float], device: Optional[list[float]],
                      samples: int, steady: bool, forced: bool) -> None:
        if epoch != self._steps_epoch:
            self._fold_steps()
            self._steps_epoch = epoch
        self._steps.add(batches, host, device, samples, steady, forced)

    def _fold_steps(self) -> None:
        steps, epoch = self._steps, self._steps_epoch
        if not steps.batches and not steps.wall_s:
            return
        self._steps = Totals()
        totals = self._open if epoch == self._open_epoch else self._raw.get(epoch)
        if totals is not None:
            totals.merge(steps)
        self._interval.merge(steps)

    # ------------------------------------------------------------------ logging

    def _log_interval(self, trainer: Trainer) -> None:
        self._next_log = (self._batches_seen // self.log_every_n_steps + 1) * self.log_every_n_steps
        tl = self._timeline
        if tl._cuda:
            tl.drain()
        self._fold_steps()
        interval, self._interval = self._interval, Totals()
        values = summaries.interval_row(interval, self._open)
        step = trainer.global_step
        pred = self._logged_prediction(trainer) if trainer.is_global_zero and trainer.loggers else None
        if tl._cuda and ranks.world()[1] > 1:
            self._pending_logs.append((step, ranks.PendingRows(values, self._device), pred))
            self._flush_pending_logs(trainer, block=False)
        else:
            self._emit(trainer, step, ranks.gather_rows(values, self._device), pred)

    def _flush_pending_logs(self, trainer: Trainer, block: bool) -> None:
        while self._pending_logs:
            step, pending, pred = self._pending_logs[0]
            if block:
                pending._event.synchronize()
            rows = pending.result()
            if rows is None:
                return
            self._pending_logs.pop(0)
            self._emit(trainer, step, rows, pred)

    def _emit(self, trainer: Trainer, step: int, rows: list[list[float]], pred: Optional[dict] = None) -> None:
        if not trainer.is_global_zero or not trainer.loggers:
            return
        metrics = summaries.interval_metrics(rows, self._samples_known)
        if metrics is None:
            return
        if pred is not None:
            metrics["profile/predicted_epoch_s"] = pred["epoch_s"]
            metrics["profile/predicted_epoch_std_s"] = pred["epoch_std_s"]
            if pred["fit_s"] is not None:
                metrics["profile/predicted_fit_s"] = pred["fit_s"]
                metrics["profile/predicted_fit_std_s"] = pred["fit_std_s"]
        for logger in trainer.loggers:
            logger.log_metrics(metrics=metrics, step=step)

    # ------------------------------------------------------------------ prediction

    def _feed(self, host: list[float], trainer: Optional[Trainer]) -> None:
        fc = self._forecast
        if fc is None:
            return
        fc.add_step(host[DATA] + host[FORWARD] + host[BACKWARD] + host[OPTIMIZER] + host[STORE] + host[OTHER],
                    host[STORE])
        if self._kept_prediction is None and trainer is not None:
            if self._landmark is None:
                target = self._epoch_target(trainer)
                self._landmark = math.ceil(self.predict_at * target) if target else -1
            if 0 < self._landmark <= fc.batches:
                if fc.needs_device and len(fc.device_index) < 3:
                    self._timeline.drain()  # never waits; a GPU far behind defers the prediction
                self._kept_prediction = self._prediction(trainer)
                give_up = self._landmark + 64 + 8 * self.sample_every_n_steps
                if self._kept_prediction is None and fc.batches >= give_up:
                    self._landmark = -1  # the epoch is too short to predict; stop trying

    def _logged_prediction(self, trainer: Trainer) -> Optional[dict]:
        # A prediction costs O(batches so far) (~0.2 ms at 20,000); recomputed once the epoch
        # has grown by 1/32 since the last one, it costs a step well under a microsecond
        fc, last = self._forecast, self._last_prediction
        if fc is None:
            return None
        if last is not None and last["epoch"] == self._open_epoch and fc.batches - last["at_batch"] < fc.batches // 32:
            return last
        pred = self._prediction(trainer)
        if pred is not None:
            pred["epoch"] = self._open_epoch
        self._last_prediction = pred
        return pred

    def _on_device_step(self, index: int, seconds: float) -> None:
        if self._forecast is not None:
            self._forecast.add_device_step(index, seconds)

    def _epoch_target(self, trainer: Trainer) -> Optional[int]:
        """Batches the running epoch will have when it ends (the predicted epoch)."""
        if self.epoch_batches is not None:
            return self.epoch_batches
        n = trainer.num_training_batches
        if not isinstance(n, (int, float)) or not math.isfinite(n):
            return None
        n = int(n)
        budget = schedule.batch_budget(trainer)
        done = self._forecast.batches if self._forecast is not None else 0
        return n if budget is None else min(n, done + budget)

    def _val_run_estimate(self, trainer: Trainer) -> Optional[float]:
        if self._val_run_s:
            return sum(self._val_run_s) / len(self._val_run_s)
        if self._sanity_batch_s is not None:
            val_batches = sum(int(b) for b in trainer.num_val_batches if math.isfinite(b))
            return self._sanity_batch_s * val_batches
        return None

    def _prediction(self, trainer: Trainer) -> Optional[dict]:
        """Predicted wall seconds of the running epoch and of the fit (docs/profiler.md)."""
        fc = self._forecast
        target = self._epoch_target(trainer)
        if fc is None or target is None:
            return None
        tl = self._timeline
        if tl is not None and tl._cuda:
            tl.drain()  # never waits: reads the sampled steps the GPU has finished
            fc.backlog = tl.device_backlog()
        epoch, done = self._open_epoch, fc.batches
        start_total = self._batches_seen - self._step_in_epoch
        acc = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        val_s = self._val_run_estimate(trainer)
        val_left = schedule.val_runs(trainer, epoch, done, target, start_total) or 0
        g_now = int(trainer.global_step)
        g_end = g_now + (target - done) // acc
        p = fc.predict(target, val_left, val_s, schedule.saves(trainer, g_now, g_end), self._save_s)
        if p is None:
            return None
        out = {"epoch_s": p["seconds"], "epoch_std_s": p["std"], "at_batch": done, "epoch_batches": target,
               "fit_s": None, "fit_std_s": None, "unmeasured_saves": p["unmeasured_saves"],
               "validation_measured": p["val_known"]}
        # the fit: the epochs still to come after this one, under max_epochs / max_steps
        budget, epochs = schedule.batch_budget(trainer), schedule.epochs_left(trainer)
        full_n = self.epoch_batches or trainer.num_training_batches
        if (budget is None and epochs is None) or not math.isfinite(full_n) or full_n < 1:
            return out
        full_n = int(full_n)
        after = math.inf if budget is None else max(0, budget - (target - done))
        epochs = math.inf if epochs is None else epochs
        sizes: list[int] = []
        while after > 0 and len(sizes) < epochs and len(sizes) < 100_000:
            b = int(min(full_n, after))
            sizes.append(b)
            after -= b
        r = p["rate"]
        # the rate at the end of this epoch, with the store trend where it levels off
        per_batch = r["mean"] + (fc.trend_seconds(r, target, 1) if r["slope"] else 0.0)
        first = fc.first_step_s
        if first is not None:
            self._first_extra_s = max(0.0, first - r["mean"])
        first_extra = self._first_extra_s or 0.0
        save_s = r["save_s"] or 0.0
        future, total_batches, ge, total = 0.0, 0, g_end, start_total + target
        for k, b in enumerate(sizes):
            runs = schedule.val_runs(trainer, epoch + 1 + k, 0, b, total) or 0
            future += b * per_batch + first_extra + runs * (val_s or 0.0)
            future += schedule.saves(trainer, ge, ge + b // acc) * save_s
            ge += b // acc
            total += b
            total_batches += b
        before = sum(e["epoch_seconds"] + e["val_seconds"] for e in self._summaries if e["epoch"] < epoch)
        left = (target - done) + total_batches
        out["fit_s"] = before + p["seconds"] + future
        out["fit_std_s"] = math.sqrt((left * r["se"]) ** 2 + left * r["std"] ** 2 + (0.5 * p["trend_s"]) ** 2)
        return out

    # ------------------------------------------------------------------ epoch summary

    def _finish_epoch(self, trainer: Trainer) -> None:
        self._fold_steps()
        if self._forecast is not None and self._forecast.saves:
            extra = self._forecast.save_extra()
            if extra is not None:
                self._save_s = extra  # for the next epochs' predictions
        t, epoch = self._open, self._open_epoch
        self._open = None
        self._raw[epoch] = t
        rows = ranks.gather_rows(summaries.epoch_row(t), self._device)  # every rank joins
        self._rank_rows[epoch] = summaries.rank_phase_rows(rows)
        epoch_batches = self.epoch_batches
        if epoch_batches is None and math.isfinite(trainer.num_training_batches):
            epoch_batches = int(trainer.num_training_batches)
        timeline = "cuda-events" if self._timeline is not None and self._timeline._cuda else "host-clock"
        self._summaries.append(summaries.epoch_summary(epoch, rows, self._samples_known, epoch_batches, timeline,
                                                       self._kept_prediction))
        self._kept_prediction = None
