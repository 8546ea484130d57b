"""The sums a fit's profile is made of: the running epoch's, the finished epochs' (kept for a
resume), the running log interval's, and one summary per finished epoch; and what of them a
checkpoint keeps."""

from __future__ import annotations

from typing import Any

import torch

from lightning_embcache.profiling import ranks
from lightning_embcache.profiling import summary as summaries
from lightning_embcache.profiling.timeline import Totals

STATE_VERSION = 1
FOLD_EVERY = 1024  # finished steps at most kept before they are summed


class EpochLedger:
    """Per-epoch and per-interval :class:`Totals`. Finished steps arrive one at a time
    (:meth:`add_step`: one list append per step) and are summed into the epoch's and the
    interval's totals at each log interval, epoch end and checkpoint (:meth:`fold`)."""

    def __init__(self) -> None:
        self.summaries: list[dict] = []
        self.raw: dict[int, Totals] = {}        # totals of finished epochs (for resume)
        self.open: Totals | None = None      # the running epoch
        self.open_epoch = -1
        self.interval = Totals()
        self._steps: list[tuple] = []           # finished steps not yet folded
        self._steps_epoch = -1
        self._resume: dict | None = None     # the open epoch of the checkpoint resumed from
        # per epoch, per rank: [phase seconds..., batches]; a resumed epoch replaces its entry
        self.rank_rows: dict[int, list[list[float]]] = {}

    def add_step(self, epoch: int, batches: int, host: list[float], device: list[float] | None,
                 samples: int, steady: bool, forced: bool) -> None:
        """The timeline's sink: one finished step (or an epoch's tail, ``batches`` 0)."""
        if epoch != self._steps_epoch:
            self.fold()
            self._steps_epoch = epoch
        steps = self._steps
        steps.append((batches, host, device, samples, steady, forced))
        if len(steps) >= FOLD_EVERY:  # bounded however rarely the callback logs
            self.fold()

    def fold(self) -> None:
        if not self._steps:
            return
        steps, epoch = Totals(), self._steps_epoch
        steps.add_steps(self._steps)
        self._steps = []
        totals = self.open if epoch == self.open_epoch else self.raw.get(epoch)
        if totals is not None:
            totals.merge(steps)
        self.interval.merge(steps)

    def take_interval(self) -> Totals:
        """The log interval's sums so far; a new interval starts."""
        self.fold()
        interval, self.interval = self.interval, Totals()
        return interval

    def open_epoch_at(self, epoch: int) -> tuple[int, tuple[int, Totals] | None]:
        """Opens ``epoch``: ``(steps already run in it, (epoch, sums) of an unfinished earlier
        epoch to close first)``. A resumed epoch continues the sums of the run it resumes from."""
        self.open = Totals()
        steps = 0
        unfinished = None
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] == epoch:
            self.open = Totals.from_dict(resume["totals"])
            steps = resume["steps"]
        elif resume is not None and resume["epoch"] < epoch:
            # an epoch left unfinished by the run we resume from
            unfinished = (resume["epoch"], Totals.from_dict(resume["totals"]))
        elif self.summaries and self.summaries[-1]["epoch"] == epoch and epoch in self.raw:
            # resumed inside an epoch that the earlier run closed early (max_steps, interruption)
            self.summaries.pop()
            self.open = self.raw.pop(epoch)
            steps = self.open.batches
        self.open_epoch = epoch
        return steps, unfinished

    def seconds_before(self, epoch: int) -> float:
        """Wall seconds (validation included) of the fit's epochs before ``epoch``."""
        return sum(e["epoch_seconds"] + e["val_seconds"] for e in self.summaries if e["epoch"] < epoch)

    def finish(self, totals: Totals, epoch: int, device: torch.device | None, samples_known: bool,
               epoch_batches: int | None, timeline: str, prediction: dict | None,
               full_prediction: dict | None = None, segments: list[list[float]] | None = None) -> None:
        """Closes ``epoch``: its sums gathered over ranks (every rank joins) into a summary."""
        self.fold()
        if totals is self.open:
            self.open = None
        self.raw[epoch] = totals
        rows = ranks.gather_rows(summaries.epoch_row(totals), device)
        self.rank_rows[epoch] = summaries.rank_phase_rows(rows)
        self.summaries.append(summaries.epoch_summary(epoch, rows, samples_known, epoch_batches, timeline,
                                                      prediction, full_prediction, segments))

    def fit_rank_rows(self) -> list[list[float]]:
        """Per rank, phase seconds and batches summed over the epochs (ranks as in the last epoch)."""
        out: list[list[float]] = []
        for rows in self.rank_rows.values():
            if len(rows) != len(out):
                out = [list(r) for r in rows]
            else:
                out = [[a + b for a, b in zip(x, y)] for x, y in zip(out, rows)]
        return out

    # -- checkpoint ---------------------------------------------------------------------------

    def state(self, step_in_epoch: int, batches_seen: int) -> dict[str, Any]:
        self.fold()
        open_state = None
        if self.open is not None:
            open_state = {"epoch": self.open_epoch, "steps": step_in_epoch, "totals": self.open.to_dict()}
        return {"version": STATE_VERSION, "summaries": [dict(s) for s in self.summaries],
                "raw": {e: t.to_dict() for e, t in self.raw.items()}, "open": open_state,
                "batches_seen": batches_seen, "rank_rows": self.rank_rows}

    def load(self, state: dict[str, Any]) -> int:
        """Restores the sums; returns the fit's batches seen."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"StepProfiler state version must be {STATE_VERSION}; got {state.get('version')!r}")
        self.summaries = [dict(s) for s in state["summaries"]]
        self.raw = {int(e): Totals.from_dict(t) for e, t in state["raw"].items()}
        self._resume = state["open"]
        self.rank_rows = {int(e): [list(r) for r in rows] for e, rows in state.get("rank_rows", {}).items()}
        return state.get("batches_seen", 0)
