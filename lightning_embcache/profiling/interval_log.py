"""The ``profile/*`` metrics of each log interval: gathered over ranks and handed to the
Trainer's loggers (rank zero). On several CUDA ranks the gather is started without waiting and
its result logged once it has arrived, so that logging never synchronizes inside a step."""

from __future__ import annotations

from typing import Any

import torch

from lightning_embcache.profiling import ranks
from lightning_embcache.profiling import summary as summaries
from lightning_embcache.profiling.timeline import Totals


class IntervalLog:
    """Turns one interval's :class:`Totals` into logged metrics."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, ranks.PendingRows, dict | None]] = []

    def log(self, trainer: Any, interval: Totals, epoch_so_far: Totals | None, device: torch.device | None,
            cuda: bool, samples_known: bool, prediction: dict | None) -> None:
        """Every rank calls this at the same step (it joins a collective on several ranks)."""
        values = summaries.interval_row(interval, epoch_so_far)
        step = trainer.global_step
        if cuda and device is not None and ranks.world()[1] > 1:
            self._pending.append((step, ranks.PendingRows(values, device), prediction))
            self.flush(trainer, samples_known, block=False)
        else:
            self._emit(trainer, step, ranks.gather_rows(values, device), samples_known, prediction)

    def flush(self, trainer: Any, samples_known: bool, block: bool) -> None:
        """Log the gathered intervals that have arrived (all of them with ``block``)."""
        while self._pending:
            step, pending, pred = self._pending[0]
            if block:
                pending._event.synchronize()
            rows = pending.result()
            if rows is None:
                return
            self._pending.pop(0)
            self._emit(trainer, step, rows, samples_known, pred)

    @staticmethod
    def _emit(trainer: Any, step: int, rows: list[list[float]], samples_known: bool,
              pred: dict | None = None) -> None:
        if not trainer.is_global_zero or not trainer.loggers:
            return
        metrics = summaries.interval_metrics(rows, samples_known)
        if metrics is None:
            return
        if pred is not None:
            metrics["profile/predicted_epoch_s"] = pred["epoch_s"]
            metrics["profile/predicted_epoch_std_s"] = pred["epoch_std_s"]
            metrics["profile/predicted_epoch_low_s"] = pred["epoch_low_s"]
            metrics["profile/predicted_epoch_high_s"] = pred["epoch_high_s"]
            if pred["fit_s"] is not None:
                metrics["profile/predicted_fit_s"] = pred["fit_s"]
                metrics["profile/predicted_fit_std_s"] = pred["fit_std_s"]
                metrics["profile/predicted_fit_low_s"] = pred["fit_low_s"]
                metrics["profile/predicted_fit_high_s"] = pred["fit_high_s"]
        for logger in trainer.loggers:
            logger.log_metrics(metrics=metrics, step=step)
