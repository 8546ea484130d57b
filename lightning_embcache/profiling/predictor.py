"""The epoch-time and fit-time prediction of a running fit: what the steps so far say
(:class:`~lightning_embcache.profiling.forecast.Forecast`) combined with what the Trainer will still
run (:mod:`~lightning_embcache.profiling.schedule`): batches, validation runs, checkpoint saves, and
the epochs after this one.

The callback feeds it each finished step and each validation run; it keeps the prediction made at
``predict_at`` of each epoch for the end-of-fit comparison."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from itertools import chain
from typing import Any

import numpy as np

from lightning_embcache.profiling import schedule
from lightning_embcache.profiling.forecast import (
    EPOCH_DRIFT_BLOCKS,
    INTERVAL_Z,
    Forecast,
    epoch_level,
    level_spread,
    level_variation,
    save_estimate_s,
    slow_share,
)
from lightning_embcache.profiling.schedule import save_batches
from lightning_embcache.profiling.slow_steps import PhaseBlocks
from lightning_embcache.profiling.store_fill import StoreFill, measured_rates
from lightning_embcache.profiling.stores import HotTiers
from lightning_embcache.profiling.timeline import BACKWARD, DATA, FORWARD, OPTIMIZER, OTHER, STORE

SYNC_EVERY = 256  # steps at most between handing the pending steps to the forecast
FULL = 0.99  # a hot tier this close to its budget is full (eviction keeps it a few rows under)


class EpochPredictor:
    """One fit's predictions; :meth:`begin_epoch` opens each epoch's."""

    def __init__(self, predict_at: float, sample_every: int, epoch_batches: int | None) -> None:
        self.predict_at = predict_at
        self.sample_every = sample_every
        self.epoch_batches = epoch_batches
        self.forecast: Forecast | None = None
        self.kept: dict | None = None        # the prediction made at predict_at of the epoch
        self._last_logged: dict | None = None
        self._timeline: Any = None
        self._epoch = -1
        self._start_total = 0        # batches of the fit before this epoch
        self._before_s = 0.0         # wall seconds of the fit's earlier epochs (validation included)
        self._landmark: int | None = None
        # what earlier epochs and validation runs of the fit measured
        self._val_run_s: list[float] = []
        self._sanity_t0 = 0.0
        self._sanity_batch_s: float | None = None
        self._first_extra_s: float | None = None
        self._save_s: float | None = None
        self._level_cv = 0.0  # the largest level variation of a finished epoch of this fit
        self._slow_share: float | None = None  # the latest whole epoch's share of slow steps
        self._previous: tuple[float, float] | None = None  # the latest whole epoch's epoch_level
        self._drift: float | None = None  # the largest level_spread of a whole epoch of this fit
        self._drift_epochs = 0  # ... over this many whole epochs
        # the embedding stores' hot tiers: () -> HotTiers (hot bytes, hot budget bytes and the
        # write work measured, summed over the stores with a budget; a plain (hot, budget) pair
        # is taken too) or None. Read twice an epoch (half-way to the kept prediction, and at it)
        # and by predict(): a stats() call can take milliseconds
        self.store_reader: Callable[[], tuple[float, ...] | None] | None = None
        self._store_mark = -1
        self._store_first: tuple[int, HotTiers] | None = None
        # the latest projection of the fill (batch of this epoch at which the hot tiers will be
        # full, bytes they take in per batch, their budget, the rates measured so far); kept for
        # the predictions that do not read stats()
        self._fill: StoreFill | None = None
        # () -> bytes a checkpoint save writes (the module's and optimizers' tensors): a save's
        # cost until one has been measured. Read only when a prediction has saves to charge
        self.save_bytes_reader: Callable[[], int] | None = None
        # finished steps' host phases not yet handed to the forecast (one append per step; the
        # forecast takes them whenever it is read), and the batch count at which add_step has
        # something to do (the store reading, the kept prediction)
        self._hosts: list[list[float]] = []
        self._phases = PhaseBlocks()  # the epoch's phases in blocks of steps: which phase moved
        self._fed = 0
        self._next_check: float = 0
        self._hosts_due = math.inf  # pending steps at which add_step has something to do

    # -- feeding ------------------------------------------------------------------------------

    def begin_epoch(self, epoch: int, step_in_epoch: int, start_seconds: float, batches_seen: int,
                    before_s: float, timeline: Any) -> None:
        """A training epoch (re)starts at ``step_in_epoch`` with ``start_seconds`` already run."""
        self.forecast = Forecast(step_in_epoch, start_seconds)
        self.forecast.needs_device = bool(timeline._cuda) and self.sample_every > 0
        self._timeline = timeline
        self._epoch = epoch
        self._start_total = batches_seen - step_in_epoch
        self._before_s = before_s
        self.kept = None
        self._landmark = None
        self._store_mark = -1
        self._store_first = None
        self._fill = None
        self._hosts = []
        self._phases = PhaseBlocks(skip_first=step_in_epoch == 0)
        self._fed = step_in_epoch
        self._next_check = 0
        self._hosts_due = -step_in_epoch  # the first step checks

    def add_step(self, host: list[float], trainer: Any) -> None:
        """A finished step's host phases; makes the kept prediction once the epoch reaches
        ``predict_at``."""
        hosts = self._hosts
        hosts.append(host)
        if len(hosts) >= self._hosts_due:  # _next_check - _fed; inf until an epoch begins
            self._check(trainer)

    def _sync(self) -> None:
        """Hand the pending steps to the forecast."""
        hosts, fc = self._hosts, self.forecast
        if not hosts or fc is None:
            return
        # one array of the steps' phases (the timeline's order, validation last) for the forecast and
        # the phase blocks; the wall sums the phases left to right, the same float as Totals.add
        width = len(hosts[0])
        a = np.fromiter(chain.from_iterable(hosts), dtype=np.float64, count=width * len(hosts)).reshape(-1, width)
        wall = a[:, DATA] + a[:, FORWARD] + a[:, BACKWARD] + a[:, OPTIMIZER] + a[:, STORE] + a[:, OTHER]
        fc.add_steps(wall.tolist(), a[:, STORE].tolist())
        self._phases.add(a)
        self._fed += len(hosts)
        self._hosts_due = self._next_check - self._fed
        hosts.clear()

    def _check(self, trainer: Any) -> None:
        self._sync()
        # the pending steps are handed over at least every SYNC_EVERY steps: a list per step
        # would otherwise pile up over an epoch where nothing reads the forecast
        fc = self.forecast
        assert fc is not None  # called only inside an epoch
        self._next_check = min(self._due(trainer), fc.batches + SYNC_EVERY)
        self._hosts_due = self._next_check - self._fed

    def _due(self, trainer: Any) -> float:
        """Does what is due at this batch count; returns the count at which something is next."""
        fc = self.forecast
        assert fc is not None
        if self.kept is not None:
            return math.inf
        if trainer is None:
            return fc.batches + 1
        if self._landmark is None:
            target = self.epoch_target(trainer)
            self._landmark = math.ceil(self.predict_at * target) if target else -1
            self._store_mark = max(fc.start_batches + 1, self._landmark // 2) if self.store_reader else -1
        if fc.batches == self._store_mark:
            reading = self._read_store()
            self._store_first = None if reading is None else (fc.batches, reading)
        if 0 < self._landmark <= fc.batches:
            if fc.needs_device and len(fc.device_index) < 3:
                self._timeline.drain()  # never waits; a GPU far behind defers the prediction
            self.kept = self.predict(trainer, with_store=True)
            give_up = self._landmark + 64 + 8 * self.sample_every
            if self.kept is None and fc.batches >= give_up:
                self._landmark = -1  # the epoch is too short to predict; stop trying
            elif self.kept is None:
                return fc.batches + 1  # the device has not timed enough steps yet
            return math.inf
        if self._landmark > 0:
            return min(self._landmark, self._store_mark if self._store_mark > fc.batches else math.inf)
        return math.inf

    def add_device_step(self, index: int, seconds: float) -> None:
        if self.forecast is not None:
            self.forecast.add_device_step(index, seconds)

    def mark_save(self) -> None:
        """A checkpoint is being saved in the step now running."""
        self._sync()
        if self.forecast is not None:
            self.forecast.mark_save()

    def add_validation(self, seconds: float) -> None:
        self._val_run_s.append(seconds)
        if self.forecast is not None:
            self.forecast.add_validation(seconds)

    def sanity_batch_start(self) -> None:
        self._sanity_t0 = time.perf_counter()

    def sanity_batch_end(self) -> None:
        # The sanity check's last batch estimates a validation batch until a real run is seen:
        # its first batch also pays one-time set-up (the loader's start, the first eval kernels),
        # which made a whole run's estimate several times too long
        self._sanity_batch_s = time.perf_counter() - self._sanity_t0

    def phase_segments(self) -> list[list[float]]:
        """The running epoch's mean ms per step of each phase over its twentieths (host clock)."""
        self._sync()
        return self._phases.segments()

    def finish_epoch(self) -> dict | None:
        """The epoch ended: returns its kept prediction; a save's measured cost carries over."""
        self._sync()
        if self.forecast is not None and not self.forecast.start_batches:  # a whole epoch seen
            self._level_cv = max(self._level_cv, level_variation(self.forecast.wall))
            self._slow_share = slow_share(self.forecast.wall, self.forecast.saves)
            self._previous = epoch_level(self.forecast.wall, self.forecast.saves)
            self._drift = max(self._drift or 0.0, level_spread(self.forecast.wall, EPOCH_DRIFT_BLOCKS))
            self._drift_epochs += 1
        if self.forecast is not None and self.forecast.saves:
            extra = self.forecast.save_extra()
            if extra is not None:
                self._save_s = extra  # for the next epochs' predictions
        kept, self.kept = self.kept, None
        return kept

    # -- reading ------------------------------------------------------------------------------

    def logged(self, trainer: Any) -> dict | None:
        """The prediction for a log interval. One costs O(batches so far) (~0.5 ms at 20,000);
        recomputed once the epoch has grown by 1/32 since the last one, it costs a step well
        under a microsecond."""
        self._sync()
        fc, last = self.forecast, self._last_logged
        if fc is None:
            return None
        if last is not None and last["epoch"] == self._epoch and fc.batches - last["at_batch"] < fc.batches // 32:
            return last
        pred = self.predict(trainer)
        if pred is not None:
            pred["epoch"] = self._epoch
        self._last_logged = pred
        return pred

    def predict_cut(self, trainer: Any, epoch_batches: int | None) -> dict | None:
        """At the end of an epoch cut short (``max_steps``, or a trial run against
        ``epoch_batches=``): the prediction of a whole one of ``epoch_batches``, with the saves,
        validation and store fill its rest would have had; None for an epoch that ran whole."""
        self._sync()
        fc = self.forecast
        if epoch_batches is None or fc is None or not 0 < fc.batches < epoch_batches:
            return None
        return self.predict(trainer, with_store=True, epoch_batches=epoch_batches)

    def epoch_target(self, trainer: Any) -> int | None:
        """Batches the running epoch will have when it ends (the predicted epoch)."""
        if self.epoch_batches is not None:
            return self.epoch_batches
        n = trainer.num_training_batches
        if not isinstance(n, (int, float)) or not math.isfinite(n):
            return None
        n = int(n)
        budget = schedule.batch_budget(trainer)
        done = self.forecast.batches if self.forecast is not None else 0
        return n if budget is None else min(n, done + budget)

    def _val_run_estimate(self, trainer: Any) -> float | None:
        if self._val_run_s:
            return sum(self._val_run_s) / len(self._val_run_s)
        if self._sanity_batch_s is not None:
            val_batches = sum(int(b) for b in trainer.num_val_batches if math.isfinite(b))
            return self._sanity_batch_s * val_batches
        return None

    def _save_guess(self, trainer: Any) -> float | None:
        """A checkpoint save's estimated seconds from the bytes it writes; None if unknown."""
        try:
            nbytes = self.save_bytes_reader() if self.save_bytes_reader is not None else None
        except Exception:  # a module or optimizer the reader does not understand: no estimate
            return None
        return None if nbytes is None else save_estimate_s(nbytes)

    def _read_store(self) -> HotTiers | None:
        try:
            reading = self.store_reader() if self.store_reader is not None else None
        except Exception:  # a store closed or failing: no fill projection, never a failed step
            return None
        return None if reading is None else HotTiers(*reading)

    def store_fill_batch(self, done: int, target: int) -> int | None:
        """The batch of this epoch at which the stores' hot tiers will be full, at the rate they
        filled since the first reading, if that comes before ``target``; else None (None too once
        they are full). After it every row brought in evicts one, and batches are slower."""
        fill = self._project_fill(done, target)
        return fill[0] if fill is not None and fill[0] > done else None

    def _project_fill(self, done: int, target: int) -> StoreFill | None:
        """Reads the stores and updates the projection of the fill if the hot tiers fill before
        ``target`` (or have filled as projected), else None; past the projected fill the reading
        only updates the rates measured so far."""
        first = self._store_first
        if first is None or done <= first[0]:
            return self._fill
        now = self._read_store()
        if now is None:
            return self._fill
        if self._fill is not None and done >= self._fill.batch:
            # past the projected fill the rate since the first reading is no fill rate
            self._fill = self._fill._replace(rates=measured_rates(now, self._fill, done))
            return self._fill
        b0, then = first[0], HotTiers(*first[1])
        rate = (now.hot_bytes - then.hot_bytes) / (done - b0)
        budget = min(then.budget_bytes, now.budget_bytes)
        if budget > 0.0 and now.hot_bytes >= FULL * budget:
            # full already: at the projected rate, and no later than now
            if self._fill is not None and self._fill.batch > done:
                full = self._fill._replace(batch=done)
                self._fill = full._replace(rates=measured_rates(now, full, done))
            return self._fill
        if rate <= 0.0 or budget <= 0.0:
            self._fill = None
            return None
        fill = done + math.ceil((budget - now.hot_bytes) / rate)
        if fill >= target:
            self._fill = None
            return None
        projected = StoreFill(fill, rate, budget)
        self._fill = projected._replace(rates=measured_rates(now, projected, done))
        return self._fill

    def predict(self, trainer: Any, with_store: bool = False, epoch_batches: int | None = None) -> dict | None:
        """Predicted wall seconds of the running epoch and of the fit (docs/profiler.md);
        ``with_store``: also when the stores' hot tiers will fill up (reads their stats);
        ``epoch_batches``: the epoch predicted at this many batches instead of its own length."""
        self._sync()
        fc = self.forecast
        if fc is None:
            return None
        target = self.epoch_target(trainer) if epoch_batches is None else max(int(epoch_batches), fc.batches)
        if target is None:
            return None
        tl = self._timeline
        if tl is not None and tl._cuda:
            tl.drain()  # never waits: reads the sampled steps the GPU has finished
            fc.backlog = tl.device_backlog()
        epoch, done, start_total = self._epoch, fc.batches, self._start_total
        acc = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        val_s = self._val_run_estimate(trainer)
        val_left = schedule.val_runs(trainer, epoch, done, target, start_total) or 0
        g_now = int(trainer.global_step)
        g_end = g_now + (target - done) // acc
        saves = schedule.saves(trainer, g_now, g_end)
        guess = self._save_guess(trainer) if saves and self._save_s is None and not fc.saves else None
        fill_batch = self.store_fill_batch(done, target) if with_store else None
        # hot tiers filling in this epoch: the saves to come cost more after the fill
        at = save_batches(trainer, g_now, g_end, done, acc) if self._fill is not None else ()
        p = fc.estimate(target, val_left, val_s, saves, self._save_s, self._level_cv, guess, self._fill, at,
                        self._slow_share, self._previous, self._drift, self._drift_epochs)
        if p is None:
            return None
        out = {"epoch_s": p["seconds"], "epoch_std_s": p["std"], "epoch_low_s": p["low"], "epoch_high_s": p["high"],
               "at_batch": done, "epoch_batches": target,
               "fit_s": None, "fit_std_s": None, "fit_low_s": None, "fit_high_s": None,
               "unmeasured_saves": p["unmeasured_saves"],
               "validation_measured": p["val_known"], "store_fill_batch": fill_batch,
               "store_fill_s": p["store_fill_s"]}
        # the fit: the epochs still to come after this one, under max_epochs / max_steps
        budget, epochs = schedule.batch_budget(trainer), schedule.epochs_left(trainer)
        full_n = self.epoch_batches or trainer.num_training_batches
        if (budget is None and epochs is None) or not math.isfinite(full_n) or full_n < 1:
            return out
        full_n = int(full_n)
        after = math.inf if budget is None else max(0, budget - (target - done))
        most_epochs = math.inf if epochs is None else epochs
        sizes: list[int] = []
        while after > 0 and len(sizes) < most_epochs and len(sizes) < 100_000:
            b = int(min(full_n, after))
            sizes.append(b)
            after -= b
        r = p["rate"]
        # later epochs run at the rate this epoch ends with
        per_batch = p["end_rate_s"]
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
        left = (target - done) + total_batches
        out["fit_s"] = self._before_s + p["seconds"] + future
        out["fit_std_s"] = math.sqrt((left * r["se"]) ** 2 + left * r["std"] ** 2 + (0.5 * p["trend_s"]) ** 2)
        # the fit's 90% interval, as the epoch's: the estimator's spread, and every step still to
        # come (this epoch's and the later epochs') off the rate by as much as the host's speed has
        # drifted so far; a drift is systematic, so it does not average out over more epochs
        steps_left_s = (target - done) * r["mean"] + total_batches * per_batch
        half = math.hypot(INTERVAL_Z * out["fit_std_s"], steps_left_s * (p.get("drift") or 0.0))
        run = self._before_s + fc.start_seconds + fc.elapsed + math.fsum(fc.val_runs)
        out["fit_low_s"] = max(run, out["fit_s"] - half)
        out["fit_high_s"] = out["fit_s"] + half
        return out
