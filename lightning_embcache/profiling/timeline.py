"""Where a training step's time goes: a phase state machine on the host clock, and optionally on
CUDA events read lazily.

The callback calls :meth:`StepTimeline.switch` at each phase boundary. Every moment between the
start of a training epoch and its end belongs to exactly one phase, so the phases of a step add up
to the step's wall time by construction. Validation run inside the epoch goes to a separate bucket
that no step is charged for.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

import torch

PHASES = ("data_wait", "forward", "backward", "optimizer", "store_io", "other")
DATA, FORWARD, BACKWARD, OPTIMIZER, STORE, OTHER, VALIDATION = range(7)
NUM_PHASES = len(PHASES)


class Totals:
    """Sums over a span of steps (an epoch or a log interval), in seconds.

    ``phase_s`` is the breakdown reported (CUDA events on GPU, the host clock otherwise);
    ``host_phase_s`` is always the host clock; ``wall_s`` is host wall time.
    """

    __slots__ = ("batches", "wall_s", "phase_s", "host_phase_s", "val_s", "samples",
                 "steady_batches", "steady_wall_s")

    def __init__(self) -> None:
        self.batches = 0
        self.wall_s = 0.0
        self.phase_s = [0.0] * NUM_PHASES
        self.host_phase_s = [0.0] * NUM_PHASES
        self.val_s = 0.0
        self.samples = 0
        self.steady_batches = 0
        self.steady_wall_s = 0.0

    def add(self, batches: int, host: list[float], device: Optional[list[float]], samples: int,
            steady: bool) -> None:
        wall = host[DATA] + host[FORWARD] + host[BACKWARD] + host[OPTIMIZER] + host[STORE] + host[OTHER]
        self.batches += batches
        self.wall_s += wall
        self.val_s += host[VALIDATION]
        self.samples += samples
        self.host_phase_s = [a + b for a, b in zip(self.host_phase_s, host)]
        if device is not None:
            self.phase_s = [a + b for a, b in zip(self.phase_s, device)]
        if steady and batches:
            self.steady_batches += batches
            self.steady_wall_s += wall

    def merge(self, other: "Totals") -> None:
        """Add ``other``'s sums to these."""
        self.batches += other.batches
        self.wall_s += other.wall_s
        self.val_s += other.val_s
        self.samples += other.samples
        self.host_phase_s = [a + b for a, b in zip(self.host_phase_s, other.host_phase_s)]
        self.phase_s = [a + b for a, b in zip(self.phase_s, other.phase_s)]
        self.steady_batches += other.steady_batches
        self.steady_wall_s += other.steady_wall_s

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, state: dict) -> "Totals":
        t = cls()
        for k in cls.__slots__:
            v = state[k]
            setattr(t, k, list(v) if isinstance(v, (list, tuple)) else v)
        return t


class StepTimeline:
    """Phase state machine for one rank.

    Host time is charged at every :meth:`switch`. With ``device`` a CUDA device, an event is also
    recorded at each boundary on the current stream; a finished step's events are read only in
    :meth:`drain`, and only once the step's last event has completed (``Event.query()``), so no
    step ever waits for the GPU. ``store_io`` is a callable returning the cumulative seconds the
    training thread spent waiting in embedding stores; the increase over a segment is moved out of
    that segment's phase into ``store_io`` (never more than the segment lasted).
    """

    def __init__(self, sink: Callable[[int, int, list[float], Optional[list[float]], int, bool], None],
                 device: Optional[torch.device] = None,
                 store_io: Optional[Callable[[], float]] = None) -> None:
        self._sink = sink  # sink(epoch, batches, host_phases, device_phases, samples, steady)
        self._cuda = device is not None and device.type == "cuda"
        self._device = device
        self.store_io = store_io
        self.phase = OTHER
        self.active = False
        self._t = 0.0
        self._io = 0.0
        self._acc = [0.0] * 7
        # CUDA bookkeeping: events of the open step, the phase of each segment between them, the
        # store seconds of each segment; finished steps wait in _pending until their events complete
        self._stream = None
        self._dev_phase = OTHER
        self._seg_store_acc = 0.0
        self._events: list = []
        self._seg_phase: list[int] = []
        self._seg_store: list[float] = []
        self._pending: deque = deque()
        self._pool: list = []

    # -- recording (called from hooks; keep cheap) -------------------------------------------

    def begin(self, phase: int) -> None:
        """Start the chain at the start of an epoch, in ``phase``."""
        self._acc = [0.0] * 7
        self._io = self.store_io() if self.store_io is not None else 0.0
        self.phase = phase
        self.active = True
        if self._cuda:
            # one Stream object per epoch: torch.cuda.current_stream() builds a new one per call
            self._stream = torch.cuda.current_stream(self._device)
            # Anchor the device chain to the host clock: with the stream idle, the first event
            # completes when it is recorded. Otherwise work queued before the epoch (the last
            # epoch's tail, a collective waiting for a slower rank) would be timed as this epoch's
            # first phase. Once per epoch, outside any step.
            self._stream.synchronize()
            self._dev_phase = phase
            self._seg_store_acc = 0.0
            self._events = [self._record()]
            self._seg_phase = []
            self._seg_store = []
        self._t = time.perf_counter()

    def switch(self, phase: int, device: bool = True) -> None:
        """Charge the time since the last boundary to the current phase; enter ``phase``.

        On CUDA an event is recorded only where the device-side phase changes; ``device=False``
        keeps the device segment going (the few microseconds of loop code between the loader's
        return and the transfer stay with data_wait there, saving an event per step).
        """
        now = time.perf_counter()
        dt = now - self._t
        moved = 0.0
        if self.store_io is not None:
            io = self.store_io()
            moved = io - self._io
            self._io = io
            if moved > 0.0:
                moved = min(moved, dt)
                self._acc[STORE] += moved
                dt -= moved
            else:
                moved = 0.0
        self._acc[self.phase] += dt
        self._t = now
        self.phase = phase
        if self._cuda:
            self._seg_store_acc += moved
            if device and phase != self._dev_phase:
                self._mark(phase)

    def _mark(self, phase: int) -> None:
        self._events.append(self._record())
        self._seg_phase.append(self._dev_phase)
        self._seg_store.append(self._seg_store_acc)
        self._seg_store_acc = 0.0
        self._dev_phase = phase

    def end_step(self, epoch: int, samples: int, steady: bool, next_phase: int = OTHER) -> None:
        """Close the current step (its phases were charged by earlier switches) and enter
        ``next_phase`` (one event on CUDA for both)."""
        self.switch(next_phase, device=False)
        if self._cuda:
            self._mark(next_phase)
        self._close(epoch, 1, samples, steady)

    def end_epoch(self, epoch: int, last_step: Optional[tuple[int, bool]] = None) -> None:
        """Stop the chain at the epoch's end. ``last_step=(samples, steady)`` closes a still-open
        step with the time up to here; otherwise that time is kept as a 0-batch tail."""
        self.switch(OTHER, device=False)
        if self._cuda:
            self._mark(OTHER)
            # The epoch ends when its device work does: wait for the last event (once per epoch,
            # outside any step) and charge the wait to the host clock's "other", so that the host
            # and device views of the epoch span the same interval. Without it a GPU running
            # behind the host (a rank that waits in a collective for a straggler) reported device
            # phases summing to more than the epoch's wall time.
            self._events[-1].synchronize()
            self.switch(OTHER, device=False)
        if last_step is not None:
            self._close(epoch, 1, last_step[0], last_step[1])
        else:
            self._close(epoch, 0, 0, False)
        self.active = False
        if self._cuda:
            self._events = []

    def _close(self, epoch: int, batches: int, samples: int, steady: bool) -> None:
        host, self._acc = self._acc, [0.0] * 7
        if not self._cuda:
            self._sink(epoch, batches, host, host, samples, steady)
            return
        events = self._events
        self._pending.append((epoch, batches, host, samples, steady, events, self._seg_phase, self._seg_store))
        self._events = [events[-1]]
        self._seg_phase = []
        self._seg_store = []

    def _record(self):
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record(self._stream)
        return ev

    # -- reading ------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    def drain(self, block: bool = False) -> int:
        """Hand finished steps to the sink, oldest first; returns how many.

        Without ``block`` it stops at the first step whose last event has not completed, so it never
        waits for the device. ``block=True`` waits for the last pending event (fit end, checkpoints).
        """
        n = 0
        pending = self._pending
        if block and pending:
            pending[-1][5][-1].synchronize()
        while pending:
            epoch, batches, host, samples, steady, events, seg_phase, seg_store = pending[0]
            if not events[-1].query():
                break
            pending.popleft()
            dev = [0.0] * 7
            for j, ph in enumerate(seg_phase):
                d = events[j].elapsed_time(events[j + 1]) * 1e-3
                s = seg_store[j]
                if s > 0.0:
                    s = min(s, d)
                    dev[STORE] += s
                    d -= s
                dev[ph] += d
            # the last event opens the next step's chain; the others can be recorded again
            self._pool.extend(events[:-1])
            self._sink(epoch, batches, host, dev, samples, steady)
            n += 1
        return n
