"""StepProfiler: where every millisecond of a training step goes."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info, WarningCache
from typing_extensions import override

from lightning_embcache.profiling import ranks, report
from lightning_embcache.profiling import summary as summaries
from lightning_embcache.profiling.tap import ProfilerTap
from lightning_embcache.profiling.timeline import (
    BACKWARD, DATA, FORWARD, OPTIMIZER, OTHER, VALIDATION, StepTimeline, Totals,
)

log = logging.getLogger(__name__)
warning_cache = WarningCache()

_STATE_VERSION = 1


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

        profiler = StepProfiler(log_every_n_steps=50, warmup_steps=20, plot="phases.png")
        trainer = Trainer(callbacks=[profiler])
        trainer.fit(model)
        for epoch in profiler.summary():
            print(epoch["avg_batch_ms"], epoch["phases_ms"])

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
        - On CUDA the phases come from CUDA events recorded at the same boundaries and read only
          after they completed (never a synchronization inside a step); ``host_phases_ms`` keeps
          the host-clock view. At each epoch's start and end (and at checkpoints) the profiler
          waits for the device, outside any step, so that an epoch's device phases and its wall
          time span the same interval (a GPU running behind the host finishes the epoch late).
        - On several ranks each log interval and each epoch end costs one all-reduce, which every
          rank joins; figures are means over ranks, with the per-rank maximum, the slowest rank and
          the spread beside them.
        - The Trainer's profiler is wrapped (not replaced) from ``setup`` to ``teardown``; your own
          profiler still sees every action.

    Args:
        log_every_n_steps: Log ``profile/*`` metrics every this many training batches.
        warmup_steps: Batches at the start of each epoch left out of ``steady_batch_ms``.
        report: Print the phase table at the end of training (rank zero).
        plot: Path of a PNG stacked-bar chart of the phases per epoch, saved at the end of training
            (needs matplotlib: ``pip install 'lightning_embcache[plot]'``; skipped with a warning
            without it).
        batch_size_fn: ``batch -> int`` samples in a batch; default: inferred from the batch.
        epoch_batches: Batches in a full epoch, for ``predicted_epoch_seconds`` (default: the
            Trainer's ``num_training_batches``); useful when a benchmark runs a limited epoch.

    Raises:
        ValueError: If ``log_every_n_steps < 1``, ``warmup_steps < 0`` or ``epoch_batches < 1``.
        TypeError: If ``batch_size_fn`` is given and not callable.
    """

    def __init__(self, log_every_n_steps: int = 50, warmup_steps: int = 0, report: bool = True,
                 plot: Optional[Union[str, Path]] = None, *,
                 batch_size_fn: Optional[Callable[[Any], int]] = None,
                 epoch_batches: Optional[int] = None) -> None:
        super().__init__()
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"Invalid value for log_every_n_steps={log_every_n_steps!r}. Must be an int >= 1")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"Invalid value for warmup_steps={warmup_steps!r}. Must be an int >= 0")
        if epoch_batches is not None and (not isinstance(epoch_batches, int) or epoch_batches < 1):
            raise ValueError(f"Invalid value for epoch_batches={epoch_batches!r}. Must be None or an int >= 1")
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise TypeError(f"batch_size_fn must be callable; got {type(batch_size_fn).__name__}")
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
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
        self._next_log = log_every_n_steps
        self._trainer: Optional[Trainer] = None
        # per epoch, per rank: [phase seconds..., batches]; a resumed epoch replaces its entry
        self._rank_rows: dict[int, list[list[float]]] = {}
        self._val_resume = OTHER

    # ------------------------------------------------------------------ public API

    def summary(self) -> list[dict]:
        """One dict per finished training epoch (see docs/profiler.md for every key)."""
        return [dict(s) for s in self._summaries]

    @override
    def state_dict(self) -> dict[str, Any]:
        open_state = None
        if self._open is not None:
            if self._batch_ended:  # checkpoint saved in on_train_batch_end: that batch is done
                self._close_step(None, log=False)
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

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or isinstance(trainer.profiler, ProfilerTap):
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
        if self._tap is not None and trainer.profiler is self._tap:
            trainer.profiler = self._tap.inner
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
        self._timeline = StepTimeline(self._on_step_done, self._device, store_io)

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

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tl = self._timeline
        if tl is not None and tl.active and tl.phase == VALIDATION:
            tl.switch(self._val_resume)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timeline is not None:
            self._timeline.drain(block=True)
        self._flush_pending_logs(trainer, block=True)
        if not trainer.is_global_zero:
            return
        if self.report and self._summaries:
            rank_zero_info(report.format_table(self._summaries, self._fit_rank_rows()))
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

    def _close_step(self, trainer: Optional[Trainer], log: bool = True, next_phase: int = OTHER) -> None:
        self._batch_ended = False
        self._timeline.end_step(self._open_epoch, self._samples, self._step_in_epoch >= self.warmup_steps,
                                next_phase)
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

    def _on_step_done(self, epoch: int, batches: int, host: list[float], device: list[float], samples: int,
                      steady: bool) -> None:
        if epoch != self._steps_epoch:
            self._fold_steps()
            self._steps_epoch = epoch
        self._steps.add(batches, host, device, samples, steady)

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
        values = summaries.interval_row(interval)
        step = trainer.global_step
        if tl._cuda and ranks.world()[1] > 1:
            self._pending_logs.append((step, ranks.PendingRows(values, self._device)))
            self._flush_pending_logs(trainer, block=False)
        else:
            self._emit(trainer, step, ranks.gather_rows(values, self._device))

    def _flush_pending_logs(self, trainer: Trainer, block: bool) -> None:
        while self._pending_logs:
            step, pending = self._pending_logs[0]
            if block:
                pending._event.synchronize()
            rows = pending.result()
            if rows is None:
                return
            self._pending_logs.pop(0)
            self._emit(trainer, step, rows)

    def _emit(self, trainer: Trainer, step: int, rows: list[list[float]]) -> None:
        if not trainer.is_global_zero or not trainer.loggers:
            return
        metrics = summaries.interval_metrics(rows, self._samples_known)
        if metrics is None:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics=metrics, step=step)

    # ------------------------------------------------------------------ epoch summary

    def _finish_epoch(self, trainer: Trainer) -> None:
        self._fold_steps()
        t, epoch = self._open, self._open_epoch
        self._open = None
        self._raw[epoch] = t
        rows = ranks.gather_rows(summaries.epoch_row(t), self._device)  # every rank joins
        self._rank_rows[epoch] = summaries.rank_phase_rows(rows)
        epoch_batches = self.epoch_batches
        if epoch_batches is None and math.isfinite(trainer.num_training_batches):
            epoch_batches = int(trainer.num_training_batches)
        timeline = "cuda-events" if self._timeline is not None and self._timeline._cuda else "host-clock"
        self._summaries.append(summaries.epoch_summary(epoch, rows, self._samples_known, epoch_batches, timeline))
