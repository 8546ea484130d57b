"""StepProfiler: where every millisecond of a training step goes."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import WarningCache
from typing_extensions import override

from lightning_embcache.profiling import boundaries, report, schedule
from lightning_embcache.profiling.interval_log import IntervalLog
from lightning_embcache.profiling.ledger import EpochLedger
from lightning_embcache.profiling.predictor import EpochPredictor
from lightning_embcache.profiling.stores import StoreReadings, device_tiers, per_step
from lightning_embcache.profiling.tap import ProfilerTap
from lightning_embcache.profiling.timeline import (
    BACKWARD,
    DATA,
    FORWARD,
    OPTIMIZER,
    OTHER,
    VALIDATION,
    StepTimeline,
    Totals,
)

log = logging.getLogger(__name__)
warning_cache = WarningCache()

# Lightning calls every callback's per-step hooks (about a microsecond each: an action name with
# the state_key, a profiler context); the profiler takes its boundaries from profiler actions
# instead (boundaries.loop_actions) and hides these from the Trainer during a fit
_PER_STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_zero_grad",
                   "on_before_optimizer_step", "on_train_batch_end")
# act only during the sanity check, which Lightning runs before on_train_start: hidden from then
# on, validation inside the epoch does not pay for them either
_SANITY_HOOKS = ("on_validation_batch_start", "on_validation_batch_end")
_PROFILER_METHODS = frozenset({"profile", "start", "stop", "describe", "teardown_profiler"})
_NOT_A_PROFILER = ("StepProfiler is a callback, not a Lightning profiler: pass it as "
                   "Trainer(callbacks=[StepProfiler()]), not Trainer(profiler=StepProfiler()). It wraps whatever "
                   "Trainer(profiler=...) you choose, so the two can run together.")


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
        - ``backward``: ``on_before_backward`` to ``on_before_optimizer_step`` (or to the batch's
          end on an accumulation micro-step); includes the DDP gradient all-reduce.
        - ``optimizer``: ``on_before_optimizer_step`` to the return of the optimizer step
          (gradient clipping, ``optimizer.step()``, the AMP scaler update). A phase starts at
          the first callback's hook of that name (the LightningModule's where no other callback
          has one), wherever this profiler sits in the callback list.
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
          profiler still sees every action. The phase boundaries are the profiler actions Lightning
          opens around the batch, the hooks and the optimizer step: during a fit the profiler's
          own per-step callback hooks are hidden from the Trainer, which saves the loop their
          calls.

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

    def __init__(self, log_every_n_steps: int | None = None, warmup_steps: int = 0, report: bool = True,
                 plot: str | Path | None = None, *,
                 batch_size_fn: Callable[[Any], int] | None = None,
                 epoch_batches: int | None = None, sample_every_n_steps: int = 8,
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
        self._state_key: str | None = None
        self._log_every_arg = log_every_n_steps
        self.log_every_n_steps = log_every_n_steps or 50  # replaced by the Trainer's in setup
        self.warmup_steps = warmup_steps
        self.sample_every_n_steps = sample_every_n_steps
        self.predict_at = float(predict_at)
        self.report = report
        self.plot = plot
        self.batch_size_fn = batch_size_fn
        self.epoch_batches = epoch_batches

        self._ledger = EpochLedger()
        self._step_in_epoch = 0
        self._batches_seen = 0
        self._samples_known = True
        self._samples = 0
        self._timeline: StepTimeline | None = None
        self._tap: ProfilerTap | None = None
        self._device: torch.device | None = None
        self._interval_log = IntervalLog()
        self._manual = False
        self._stores: StoreReadings | None = None
        self._tiers_at_start: Any = None  # the GPU tiers' counters when the open epoch began
        self._data_resume = OTHER
        self._batch_ended = False
        self._next_log = self.log_every_n_steps
        self._trainer: Trainer | None = None
        self._predictor = EpochPredictor(self.predict_at, sample_every_n_steps, epoch_batches)
        self._val_t0 = 0.0
        self._val_resume = OTHER
        self._loop_batch: Any = None  # has .batch: the batch being trained (boundaries.loop_batch)

    # ------------------------------------------------------------------ public API

    def summary(self) -> list[dict]:
        """One dict per finished training epoch (see docs/profiler.md for every key)."""
        return [dict(s) for s in self._ledger.summaries]

    def predict(self, epoch_batches: int | None = None) -> dict[str, float | None] | None:
        """The current prediction: ``{"epoch_s", "epoch_low_s", "epoch_high_s", "epoch_std_s",
        "fit_s", "fit_std_s", "at_batch", "epoch_batches", "store_fill_batch", ...}`` (wall
        seconds, validation inside the epoch included; ``epoch_low_s`` .. ``epoch_high_s`` a 90%
        interval that counts the host's drift, ``epoch_std_s`` the estimator's own standard
        deviation; ``fit_s`` None without ``max_epochs``/``max_steps``;
        ``store_fill_batch`` the batch at which the embedding stores' hot tiers will be full, if
        within the epoch), or None before enough steps of the running epoch or after the fit
        (docs/profiler.md: how to read it). Reads the stores' ``stats()``.

        ``epoch_batches``: predict the running epoch at this many batches instead of the length
        it will have: for a run that ``max_steps`` or ``limit_train_batches`` stops early, what a
        full epoch would take (call it in ``on_train_end`` at the latest), with everything the
        prediction charges (validation, checkpoint saves, a store's hot tier filling) over it."""
        if self._trainer is None:
            return None
        return self._predictor.predict(self._trainer, with_store=True, epoch_batches=epoch_batches)

    def report_table(self) -> str:
        """The end-of-fit table (phases, true average batch, predicted vs actual epoch times)."""
        return report.format_table(self._ledger.summaries, self._ledger.fit_rank_rows())

    @property
    @override
    def state_key(self) -> str:
        # two StepProfilers with different settings keep separate checkpoint entries. Lightning
        # reads this for the action name of every hook it calls: built once, again only when a
        # setting in it changes (a repr of the settings cost ~2 us a read)
        key = self._state_key
        if key is None:
            key = self._state_key = self._generate_state_key(
                log_every_n_steps=self._log_every_arg, warmup_steps=self._warmup_steps,
                epoch_batches=self._epoch_batches, plot=None if self._plot is None else str(self._plot))
        return key

    # settings that name the checkpoint entry (state_key)
    @property
    def warmup_steps(self) -> int:
        """Batches at the start of each epoch left out of ``steady_batch_ms``."""
        return self._warmup_steps

    @warmup_steps.setter
    def warmup_steps(self, value: int) -> None:
        self._warmup_steps, self._state_key = value, None

    @property
    def epoch_batches(self) -> int | None:
        """Batches of a whole epoch, for predictions of runs that stop inside one (None: the loader's length)."""
        return self._epoch_batches

    @epoch_batches.setter
    def epoch_batches(self, value: int | None) -> None:
        self._epoch_batches, self._state_key = value, None
        if "_predictor" in self.__dict__:
            self._predictor.epoch_batches = value

    @property
    def plot(self) -> str | Path | None:
        """Where the end-of-fit chart is written (None: no chart)."""
        return self._plot

    @plot.setter
    def plot(self, value: str | Path | None) -> None:
        self._plot, self._state_key = value, None

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._ledger.open is not None:
            if self._batch_ended:  # checkpoint saved in on_train_batch_end: that batch is done
                self._close_step(None, log=False)
            # Lightning asks for this state when it saves a checkpoint: the save's time falls in
            # the step now running, which the prediction keeps out of the rate
            self._predictor.mark_save()
            if self._timeline is not None:
                self._timeline.drain(block=True)  # a checkpoint synchronizes anyway
        return self._ledger.state(self._step_in_epoch, self._batches_seen)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._batches_seen = self._ledger.load(state_dict)
        self._next_log = (self._batches_seen // self.log_every_n_steps + 1) * self.log_every_n_steps

    # ------------------------------------------------------------------ set-up / tear-down

    def __getattr__(self, name: str) -> Any:
        # only reached for missing attributes: Trainer(profiler=StepProfiler()) calls these first
        if name in _PROFILER_METHODS:
            raise MisconfigurationException(_NOT_A_PROFILER)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @override
    def setup(self, trainer: Trainer | None = None, pl_module: LightningModule | None = None,
              stage: str | None = None, **profiler_kwargs: Any) -> None:
        if not isinstance(trainer, Trainer):
            # Trainer(profiler=StepProfiler()): Lightning calls profiler.setup(stage=, local_rank=, log_dir=)
            raise MisconfigurationException(_NOT_A_PROFILER)
        if stage != "fit":
            return
        if self._log_every_arg is None:
            self.log_every_n_steps = max(1, int(trainer.log_every_n_steps))  # type: ignore[attr-defined]
            self._next_log = (self._batches_seen // self.log_every_n_steps + 1) * self.log_every_n_steps
        # Lightning sets Trainer.profiler in its __init__ without a class-level annotation
        if self._tap is not None and trainer.profiler is self._tap:  # type: ignore[attr-defined]
            return
        on_start, on_stop = boundaries.loop_actions(
            trainer, fetch=(self._fetch_start, self._fetch_stop), transfer=(self._transfer_start, self._transfer_stop),
            batch=(self._batch_start, self._batch_stop), backward=self._backward_start,
            after_backward=None if trainer.lightning_module.automatic_optimization else self._after_backward,
            before_optimizer_step=self._optimizer_start,
            auto_step_stop=self._auto_step_stop, manual_step=(self._manual_step_start, self._manual_step_stop))
        self._tap = ProfilerTap(trainer.profiler, on_start, on_stop)  # type: ignore[attr-defined]
        trainer.profiler = self._tap  # type: ignore[attr-defined]

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._tap is not None:
            trainer.profiler = ProfilerTap.remove(trainer.profiler, self._tap)  # type: ignore[attr-defined]
        self._tap = None
        self._trainer = None
        self._skip_hooks(())

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # give the Trainer its own profiler back

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device = trainer.strategy.root_device
        self._trainer = trainer
        self._manual = not pl_module.automatic_optimization
        if self._tap is not None:
            if self._manual:  # the tap leaves this action out under automatic optimization
                self._tap.track(boundaries.after_backward_action(trainer), on_start=self._after_backward)
            # a phase starts at the first callback's hook of its name (the module's own hook and
            # run_training_batch, tracked since setup, find the phase begun and pass)
            starts = {"on_train_batch_start": self._batch_start, "on_before_backward": self._backward_start,
                      "on_before_optimizer_step": self._optimizer_start}
            for hook, action in boundaries.first_callback_actions(trainer, tuple(starts), StepProfiler).items():
                self._tap.track(action, on_start=starts[hook])
        stores = getattr(pl_module, "embedding_stores", None)
        self._stores = StoreReadings(stores) if stores is not None else None
        store_io = self._stores.io_wait_seconds if self._stores is not None else None
        self._timeline = StepTimeline(self._ledger.add_step, self._device, store_io,
                                      sample_every=self.sample_every_n_steps)
        self._timeline.on_device_step = self._predictor.add_device_step
        # the batch (for its size) where the tap's batch start can read it; else the hook gets it
        self._loop_batch = boundaries.loop_batch(trainer)
        if self._loop_batch is not None:
            self._skip_hooks(_PER_STEP_HOOKS + _SANITY_HOOKS)
        else:
            self._skip_hooks(tuple(h for h in _PER_STEP_HOOKS if h != "on_train_batch_start") + _SANITY_HOOKS)

    def _skip_hooks(self, names: tuple[str, ...]) -> None:
        """Per-step hooks this fit does not need are hidden from the Trainer: Lightning calls a
        callback's hook only where ``getattr(callback, name)`` is callable, and each call costs
        the loop about a microsecond (an action name with ``state_key``, a profiler context)."""
        for name in _PER_STEP_HOOKS + _SANITY_HOOKS:
            self.__dict__.pop(name, None)
        for name in names:
            self.__dict__[name] = None

    # ------------------------------------------------------------------ epochs

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_epoch(trainer, pl_module)

    def _start_epoch(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # also reached lazily from the first fetch: Lightning skips on_train_epoch_start when it
        # resumes inside an epoch
        epoch = trainer.current_epoch
        tl = self._timeline
        assert tl is not None  # made in on_train_start
        stores = getattr(pl_module, "embedding_stores", None)
        if self._stores is None and stores is not None:
            self._stores = StoreReadings(stores)  # created after on_train_start
            tl.store_io = self._stores.io_wait_seconds
        self._predictor.store_reader = self._stores.hot_tiers if self._stores and self._stores.stores else None
        self._predictor.save_bytes_reader = functools.partial(schedule.checkpoint_bytes, trainer)
        self._batch_ended = False
        ledger = self._ledger
        self._step_in_epoch, unfinished = ledger.open_epoch_at(epoch)
        self._tiers_at_start = device_tiers(self._stores.stores) if self._stores else None
        if unfinished is not None:
            self._finish_epoch(trainer, *unfinished)
        opened = ledger.open
        assert opened is not None  # open_epoch_at opened it
        self._predictor.begin_epoch(epoch, self._step_in_epoch, opened.wall_s + opened.val_s,
                                    self._batches_seen, ledger.seconds_before(epoch), tl)
        tl.begin(DATA)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tl = self._timeline
        if tl is None or not tl.active:
            return
        # the last batch's step runs to here: everything after its end (validation aside) is its "other"
        last = None
        if self._batch_ended:
            self._batch_ended = False
            last = (self._samples, self._step_in_epoch >= self._warmup_steps)
            self._step_in_epoch += 1
            self._batches_seen += 1
        tl.end_epoch(self._ledger.open_epoch, last)
        if last is not None:
            self._predictor.add_step(tl.last_host, trainer)
        tl.drain(block=True)  # once per epoch, outside any step
        if last is not None and self._batches_seen >= self._next_log:
            self._log_interval(trainer)
        opened = self._ledger.open
        assert opened is not None  # the epoch the timeline is active in
        self._finish_epoch(trainer, self._ledger.open_epoch, opened)

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
            self._predictor.add_validation(time.perf_counter() - self._val_t0)

    @override
    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking:
            self._predictor.sanity_batch_start()

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking:
            self._predictor.sanity_batch_end()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timeline is not None:
            self._timeline.drain(block=True)
        self._interval_log.flush(trainer, self._samples_known, block=True)
        if not trainer.is_global_zero:
            return
        if self.report and self._ledger.summaries:
            report.print_table(self.report_table())
        if self.plot is not None and self._ledger.summaries:
            report.save_plot(self._ledger.summaries, self.plot)

    # ------------------------------------------------------------------ steps (hot path)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # called only where the loop's batch is out of the tap's reach (boundaries.loop_batch)
        if self._batch_ended:  # a step closed here, not at a fetch, keeps its own batch's size
            self._close_step(trainer)
        if self._samples_known:
            self._count_samples(batch)

    def _count_samples(self, batch: Any) -> None:
        try:
            fn = self.batch_size_fn
            self._samples = boundaries.batch_size(batch) if fn is None else int(fn(batch))
        except Exception as err:  # an opaque batch: report no samples/s rather than fail training
            self._samples_known = False
            self._samples = 0
            warning_cache.warn(f"StepProfiler could not infer the batch size ({err}); samples_per_sec "
                               "will be None. Pass StepProfiler(batch_size_fn=...).")

    def _close_step(self, trainer: Trainer | None, log: bool = True, next_phase: int = OTHER) -> None:
        self._batch_ended = False
        step = self._step_in_epoch
        tl = self._timeline
        assert tl is not None
        host = tl.end_step(self._ledger.open_epoch, self._samples, step >= self._warmup_steps, next_phase)
        trainer = trainer if trainer is not None else self._trainer
        self._predictor.add_step(host, trainer)
        self._step_in_epoch = step + 1
        seen = self._batches_seen = self._batches_seen + 1
        if log and seen >= self._next_log and trainer is not None:
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

    def _batch_start(self) -> None:
        # run_training_batch: the callbacks' and the module's on_train_batch_start hooks are done
        tl = self._timeline
        if tl is None:
            return
        if not tl.active:
            if self._trainer is None:
                return
            self._start_epoch(self._trainer, self._trainer.lightning_module)
        if self._batch_ended:  # training_step(dataloader_iter): no fetch closed the step
            self._close_step(self._trainer)
        elif tl.phase == FORWARD:  # begun at a callback's on_train_batch_start
            return
        tl.switch(FORWARD)
        loop_batch = self._loop_batch
        if loop_batch is not None and self._samples_known:
            self._count_samples(loop_batch.batch)

    def _batch_stop(self) -> None:
        # A step runs from its fetch to the next fetch: what Lightning and other callbacks do after
        # this batch (LR schedulers, logging, checkpoints, progress bar) is this step's "other".
        # After an optimizer step the phase is "other" already (its return switched to it)
        tl = self._timeline
        if tl is not None and tl.active:
            if tl.phase != OTHER:
                tl.switch(OTHER)
            self._batch_ended = True

    def _backward_start(self) -> None:
        tl = self._timeline
        if tl is not None and tl.active and tl.phase != BACKWARD:  # begun at a callback's hook
            tl.switch(BACKWARD)

    def _after_backward(self) -> None:
        tl = self._timeline  # manual optimization only: back in the user's training_step code
        if tl is not None and tl.active:
            tl.switch(FORWARD)

    def _optimizer_start(self) -> None:
        tl = self._timeline
        # begun at a callback's hook, or (manual) at opt.step()
        if tl is not None and tl.active and tl.phase != OPTIMIZER:
            tl.switch(OPTIMIZER)

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

    # ------------------------------------------------------------------ logging

    def _log_interval(self, trainer: Trainer) -> None:
        self._next_log = (self._batches_seen // self.log_every_n_steps + 1) * self.log_every_n_steps
        tl = self._timeline
        assert tl is not None
        if tl._cuda:
            tl.drain()
        interval = self._ledger.take_interval()
        pred = self._predictor.logged(trainer) if trainer.is_global_zero and trainer.loggers else None
        self._interval_log.log(trainer, interval, self._ledger.open, self._device, tl._cuda, self._samples_known,
                               pred)

    # ------------------------------------------------------------------ epoch summary

    def _finish_epoch(self, trainer: Trainer, epoch: int, totals: Totals) -> None:
        epoch_batches = self.epoch_batches
        if epoch_batches is None and math.isfinite(trainer.num_training_batches):
            epoch_batches = int(trainer.num_training_batches)
        full = self._predictor.predict_cut(trainer, epoch_batches)
        segments = self._predictor.phase_segments()
        kept = self._predictor.finish_epoch()
        timeline = "cuda-events" if self._timeline is not None and self._timeline._cuda else "host-clock"
        self._ledger.finish(totals, epoch, self._device, self._samples_known, epoch_batches, timeline, kept, full,
                            segments)
        if self._stores is not None and self._ledger.summaries and self._ledger.summaries[-1].get("epoch") == epoch:
            last = self._ledger.summaries[-1]  # what the GPU tiers moved per step (counters: no sync)
            avg_ms = last.get("avg_batch_ms")
            moved = per_step(self._tiers_at_start, device_tiers(self._stores.stores), int(last.get("batches") or 0),
                             avg_ms / 1e3 if avg_ms else None)
            if moved is not None:
                last["device_tier"] = moved
