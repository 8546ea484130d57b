"""Where a training step's time goes: a phase state machine on the host clock, and optionally on
CUDA events recorded on a sample of the steps and read lazily.

The callback calls :meth:`StepTimeline.switch` at each phase boundary. Every moment between the
start of a training epoch and its end belongs to exactly one phase, so the phases of a step add up
to the step's wall time by construction. Validation run inside the epoch goes to a separate bucket
that no step is charged for.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from enum import IntEnum
from typing import NamedTuple

import torch


class Phase(IntEnum):
    """Where a moment of a training epoch goes; the value indexes a step's list of phase seconds
    (the first ``NUM_PHASES`` are a step's; validation is kept apart)."""

    DATA = 0
    FORWARD = 1
    BACKWARD = 2
    OPTIMIZER = 3
    STORE = 4
    OTHER = 5
    VALIDATION = 6


PHASES = ("data_wait", "forward", "backward", "optimizer", "store_io", "other")  # user-facing names, in order
# plain ints for the per-step paths: an IntEnum member costs ~30 ns more as a list index or in a
# comparison, several times a step
DATA, FORWARD, BACKWARD, OPTIMIZER, STORE, OTHER, VALIDATION = (int(p) for p in Phase)
NUM_PHASES = len(PHASES)


class PendingStep(NamedTuple):
    """A step timed on the device whose CUDA events have not all been read back yet."""

    epoch: int
    batches: int  # 1, or 0 for the tail of an epoch after its last step
    host: list  # host-clock seconds per phase
    samples: int
    steady: bool
    events: list  # CUDA events at the step's phase boundaries, in order
    seg_phase: list  # the phase of each segment between two events
    seg_store: list  # store seconds inside each segment
    forced: bool  # timed because it opened the epoch, not drawn at random
    position: int  # the step's index in the epoch (steps closed before it)


class Totals:
    """Sums over a span of steps (an epoch or a log interval), in seconds.

    ``phase_s`` sums the phases of the steps timed on the device (every step on the host clock;
    on GPU the sampled steps, CUDA events); ``sampled_s`` / ``sampled_steps`` the same over the
    randomly sampled ones only (not an epoch's first step, which is always timed and not typical);
    ``untimed_steps`` counts steps timed on the host clock alone. ``host_phase_s`` is always the
    host clock over every step; ``wall_s`` is host wall time. :meth:`phases` gives the estimate
    reported.
    """

    __slots__ = ("batches", "wall_s", "phase_s", "host_phase_s", "val_s", "samples",
                 "steady_batches", "steady_wall_s", "device_steps", "sampled_s", "sampled_steps",
                 "untimed_steps")

    def __init__(self) -> None:
        self.batches = 0
        self.wall_s = 0.0
        self.phase_s = [0.0] * NUM_PHASES
        self.host_phase_s = [0.0] * NUM_PHASES
        self.val_s = 0.0
        self.samples = 0
        self.steady_batches = 0
        self.steady_wall_s = 0.0
        self.device_steps = 0
        self.sampled_s = [0.0] * NUM_PHASES
        self.sampled_steps = 0
        self.untimed_steps = 0

    def add(self, batches: int, host: list[float], device: list[float] | None, samples: int,
            steady: bool, forced: bool = True) -> None:
        """One step (``batches`` 1; 0 for the tail of an epoch after its last step). ``device``:
        its device phases, None when it was timed on the host clock only; ``forced``: timed
        because it opened the epoch, not drawn at random."""
        wall = host[DATA] + host[FORWARD] + host[BACKWARD] + host[OPTIMIZER] + host[STORE] + host[OTHER]
        self.batches += batches
        self.wall_s += wall
        self.val_s += host[VALIDATION]
        self.samples += samples
        self.host_phase_s = [a + b for a, b in zip(self.host_phase_s, host)]
        if device is not None:
            self.phase_s = [a + b for a, b in zip(self.phase_s, device)]
            self.device_steps += 1
            if not forced and batches:
                self.sampled_s = [a + b for a, b in zip(self.sampled_s, device)]
                self.sampled_steps += 1
        elif batches:
            self.untimed_steps += 1
        if steady and batches:
            self.steady_batches += batches
            self.steady_wall_s += wall

    def add_steps(self, steps: list) -> None:
        """Many steps at once: ``(batches, host, device, samples, steady, forced)`` each, as
        :meth:`add` takes them; column sums in C rather than a list per step."""
        if not steps:
            return
        batches, hosts, devices, samples, steadies, forceds = zip(*steps)
        self.batches += sum(batches)
        self.samples += sum(samples)
        host_cols = list(map(sum, zip(*hosts)))
        wall = host_cols[DATA] + host_cols[FORWARD] + host_cols[BACKWARD] + host_cols[OPTIMIZER] + \
            host_cols[STORE] + host_cols[OTHER]
        self.wall_s += wall
        self.val_s += host_cols[VALIDATION]
        self.host_phase_s = [a + b for a, b in zip(self.host_phase_s, host_cols)]
        every_batch = all(batches)  # no epoch tail among them: the usual span
        if devices == hosts:  # the host clock (the same lists: compared by identity first)
            self.phase_s = [a + b for a, b in zip(self.phase_s, host_cols)]
            self.device_steps += len(steps)
            timed = None
        else:
            timed = [d for d in devices if d is not None]
            if timed:
                self.phase_s = [a + b for a, b in zip(self.phase_s, map(sum, zip(*timed)))]
                self.device_steps += len(timed)
        if timed or not all(forceds):  # steps drawn at random (not on the host clock)
            sampled = [d for d, f, b in zip(devices, forceds, batches) if d is not None and not f and b]
            if sampled:
                self.sampled_s = [a + b for a, b in zip(self.sampled_s, map(sum, zip(*sampled)))]
                self.sampled_steps += len(sampled)
        if every_batch:
            self.untimed_steps += devices.count(None)
        else:
            self.untimed_steps += sum(1 for d, b in zip(devices, batches) if d is None and b)
        if every_batch and all(steadies):  # every step steady
            self.steady_batches += len(steps)
            self.steady_wall_s += wall
            return
        for b, h, st in zip(batches, hosts, steadies):
            if st and b:
                self.steady_batches += b
                self.steady_wall_s += h[DATA] + h[FORWARD] + h[BACKWARD] + h[OPTIMIZER] + h[STORE] + h[OTHER]

    def merge(self, other: Totals) -> None:
        """Add ``other``'s sums to these."""
        self.batches += other.batches
        self.wall_s += other.wall_s
        self.val_s += other.val_s
        self.samples += other.samples
        self.host_phase_s = [a + b for a, b in zip(self.host_phase_s, other.host_phase_s)]
        self.phase_s = [a + b for a, b in zip(self.phase_s, other.phase_s)]
        self.steady_batches += other.steady_batches
        self.steady_wall_s += other.steady_wall_s
        self.device_steps += other.device_steps
        self.sampled_s = [a + b for a, b in zip(self.sampled_s, other.sampled_s)]
        self.sampled_steps += other.sampled_steps
        self.untimed_steps += other.untimed_steps

    def phases(self, fallback: Totals | None = None) -> list[float]:
        """Seconds of each phase over the span, adding up to ``wall_s``.

        Every step timed (the host clock; CUDA with ``sample_every_n_steps=1``): the sums
        themselves. Otherwise the timed steps' device phases plus, for each step timed on the
        host clock only, the mean device phases of the randomly sampled steps (of ``fallback``,
        the running epoch, when this span has none); what the wall holds beyond that estimate
        (or lacks) is loop time between the device-timed boundaries and goes to ``other``.
        """
        est = list(self.phase_s)
        if self.untimed_steps:
            src = self if self.sampled_steps else fallback
            if src is not None and src.sampled_steps:
                per = [v / src.sampled_steps for v in src.sampled_s]
            elif src is not None and src.device_steps:
                per = [v / src.device_steps for v in src.phase_s]
            else:
                per = [v / max(1, self.batches) for v in self.host_phase_s[:NUM_PHASES]]
            est = [a + self.untimed_steps * b for a, b in zip(est, per)]
        est = est[:NUM_PHASES]
        timed = sum(est)
        if timed <= 0.0:
            return [0.0] * NUM_PHASES
        rest = self.wall_s - timed
        if est[OTHER] + rest >= 0.0:
            est[OTHER] += rest
            return est
        scale = self.wall_s / timed  # the estimate overshoots the wall by more than "other"
        return [v * scale for v in est]

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, state: dict) -> Totals:
        t = cls()
        for k in cls.__slots__:
            v = state.get(k, getattr(t, k))  # device_steps: absent from older checkpoints
            setattr(t, k, list(v) if isinstance(v, (list, tuple)) else v)
        return t


class StepTimeline:
    """Phase state machine for one rank.

    Host time is charged at every :meth:`switch`, on every step. With ``device`` a CUDA device,
    about one step in ``sample_every`` (random gaps of 1 to ``2 * sample_every - 1`` steps, so
    that no periodic work such as logging every n steps is always in or always out of the
    sample; the first step of each epoch always) is also timed on the device: an event at each of
    its phase boundaries on the current stream. Its events are read only in :meth:`drain`, and
    only once the step's last event has completed (``Event.query()``), so no step ever waits for
    the GPU; events are reused from a pool. Steps in between cost no device work at all: they are
    handed to the sink at once with their host-clock phases and no device phases.

    ``store_io`` is a callable returning the cumulative seconds the training thread spent waiting
    in embedding stores; the increase over a segment is moved out of that segment's phase into
    ``store_io`` (never more than the segment lasted).
    """

    def __init__(self, sink: Callable[[int, int, list[float], list[float] | None, int, bool, bool], None],
                 device: torch.device | None = None,
                 store_io: Callable[[], float] | None = None, sample_every: int = 1,
                 seed: int = 0) -> None:
        self._sink = sink  # sink(epoch, batches, host_phases, device_phases or None, samples, steady, forced)
        self._cuda = device is not None and device.type == "cuda"
        self._device = device
        self.store_io = store_io
        self.phase = OTHER
        self.active = False
        self._t = 0.0
        self._io = 0.0
        self._acc = [0.0] * 7
        self.last_host: list[float] = self._acc  # host phases of the step closed last
        # CUDA bookkeeping: events of the sampled step being recorded, the phase of each segment
        # between them, the store seconds of each segment; finished steps wait in _pending until
        # their events complete
        self._sample_every = sample_every
        self._rng = random.Random(seed)
        self._countdown = 0  # steps to go before the next sampled one (0: this one)
        self._recording = False
        self._forced = False  # the step being recorded opened the epoch
        self._stream: torch.cuda.Stream | None = None
        self._dev_phase = OTHER
        self._seg_store_acc = 0.0
        self._events: list = []
        self._seg_phase: list[int] = []
        self._seg_store: list[float] = []
        self._pending: deque = deque()
        self._pool: list = []
        self.events_recorded = 0  # over the timeline's life: for tests and the benchmark
        self.steps_closed = 0  # steps of this epoch closed so far
        # told (step index in the epoch, seconds) of each randomly sampled step once its events
        # are read: the device's own time per step, which the prediction prefers on a GPU
        self.on_device_step: Callable[[int, float], None] | None = None

    # -- recording (called from hooks; keep cheap) -------------------------------------------

    def begin(self, phase: int) -> None:
        """Start the chain at the start of an epoch, in ``phase``."""
        self._acc = [0.0] * 7
        self._io = self.store_io() if self.store_io is not None else 0.0
        self.phase = phase
        self.active = True
        self.steps_closed = 0
        if self._cuda:
            # one Stream object per epoch: torch.cuda.current_stream() builds a new one per call
            self._stream = torch.cuda.current_stream(self._device)
            # Anchor the device to the host clock: with the stream idle, the first event completes
            # when it is recorded. Otherwise work queued before the epoch (the last epoch's tail,
            # a collective waiting for a slower rank) would be timed as this epoch's first phase.
            # Once per epoch, outside any step.
            self._stream.synchronize()
            self._start_recording(phase)  # the first step of an epoch is always timed
            self._forced = True
            k = self._sample_every
            self._countdown = self._rng.randrange(2 * k - 1) if k > 1 else 0
        self._t = time.perf_counter()

    def _start_recording(self, phase: int) -> None:
        self._recording = True
        self._dev_phase = phase
        self._seg_store_acc = 0.0
        self._events = [self._record()]
        self._seg_phase = []
        self._seg_store = []

    def switch(self, phase: int, device: bool = True) -> None:
        """Charge the time since the last boundary to the current phase; enter ``phase``.

        On a sampled CUDA step an event is recorded only where the device-side phase changes;
        ``device=False`` keeps the device segment going (the few microseconds of loop code
        between the loader's return and the transfer stay with data_wait there, saving an event).
        """
        now = time.perf_counter()
        dt = now - self._t
        self._t = now
        if self.store_io is None:  # the usual case, kept short: it runs about 9 times a step
            self._acc[self.phase] += dt
            self.phase = phase
            if self._recording and device and phase != self._dev_phase:
                self._mark(phase)
            return
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
        self.phase = phase
        if self._recording:
            self._seg_store_acc += moved
            if device and phase != self._dev_phase:
                self._mark(phase)

    def _mark(self, phase: int) -> None:
        self._events.append(self._record())
        self._seg_phase.append(self._dev_phase)
        self._seg_store.append(self._seg_store_acc)
        self._seg_store_acc = 0.0
        self._dev_phase = phase

    def end_step(self, epoch: int, samples: int, steady: bool, next_phase: int = OTHER) -> list[float]:
        """Close the current step (its phases were charged by earlier switches) and enter
        ``next_phase``; returns the closed step's host phases. On CUDA one event marks the
        boundary when this step or the next one is timed on the device, none otherwise."""
        host = self._acc
        if self.store_io is None:  # switch(next_phase, device=False), inlined: once per step
            now = time.perf_counter()
            host[self.phase] += now - self._t
            self._t = now
            self.phase = next_phase
        else:
            self.switch(next_phase, device=False)
        # _close inlined too; the epoch's tail goes through _close
        self._acc = [0.0] * 7
        self.last_host = host
        index = self.steps_closed
        self.steps_closed = index + 1
        if not self._cuda:
            self._sink(epoch, 1, host, host, samples, steady, True)
            return host
        if not self._recording:
            self._sink(epoch, 1, host, None, samples, steady, False)
            # is the next step timed? gaps of 1..2k-1 steps (mean k), never periodic
            if self._countdown > 0:
                self._countdown -= 1
            else:
                k = self._sample_every
                self._countdown = self._rng.randrange(2 * k - 1) if k > 1 else 0
                self._start_recording(next_phase)
            return host
        self._mark(next_phase)
        forced, self._forced = self._forced, False
        self._pending.append(PendingStep(epoch, 1, host, samples, steady, self._events, self._seg_phase,
                                         self._seg_store, forced, index))
        if self._countdown > 0:
            self._countdown -= 1
            self._recording = False
            self._events = []
        else:
            k = self._sample_every
            self._countdown = self._rng.randrange(2 * k - 1) if k > 1 else 0
            # the boundary event starts the next step's chain
            self._events = [self._events[-1]]
            self._seg_phase = []
            self._seg_store = []
            self._dev_phase = next_phase
        return host

    def end_epoch(self, epoch: int, last_step: tuple[int, bool] | None = None) -> None:
        """Stop the chain at the epoch's end. ``last_step=(samples, steady)`` closes a still-open
        step with the time up to here; otherwise that time is kept as a 0-batch tail."""
        self.switch(OTHER, device=False)
        if self._cuda:
            # The epoch ends when its device work does: wait for the device (once per epoch,
            # outside any step) and charge the wait to the host clock's "other", so that an epoch's
            # wall time covers its device work. Without it a GPU running behind the host (a rank
            # that waits in a collective for a straggler) reported device phases summing to more
            # than the epoch's wall time.
            if self._recording:
                self._mark(OTHER)
                self._events[-1].synchronize()
            elif self._stream is not None:
                self._stream.synchronize()
            self.switch(OTHER, device=False)
        if last_step is not None:
            self._close(epoch, 1, last_step[0], last_step[1])
        else:
            self._close(epoch, 0, 0, False)
        self.active = False
        self._recording = False
        self._events = []
        self._countdown = 0

    def _close(self, epoch: int, batches: int, samples: int, steady: bool) -> None:
        host, self._acc = self._acc, [0.0] * 7
        self.last_host = host
        index = self.steps_closed
        self.steps_closed += batches
        if not self._cuda:
            self._sink(epoch, batches, host, host, samples, steady, True)
            return
        if not self._recording:
            self._sink(epoch, batches, host, None, samples, steady, False)
            return
        forced, self._forced = self._forced, False
        self._pending.append(PendingStep(epoch, batches, host, samples, steady, self._events, self._seg_phase,
                                         self._seg_store, forced, index))

    def _record(self):
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record(self._stream)
        self.events_recorded += 1
        return ev

    # -- reading ------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    def device_backlog(self) -> int:
        """Steps of this epoch the host has closed whose device work may not have run yet: from
        the oldest sampled step still in flight to now (0 when none is)."""
        if not self._pending:
            return 0
        return max(0, self.steps_closed - self._pending[0].position)

    def drain(self, block: bool = False) -> int:
        """Hand finished sampled steps to the sink, oldest first; returns how many.

        Without ``block`` it stops at the first step whose last event has not completed, so it never
        waits for the device. ``block=True`` waits for the last pending event (fit end, checkpoints).
        """
        n = 0
        pending = self._pending
        if block and pending:
            pending[-1].events[-1].synchronize()
        while pending:
            step = pending[0]
            events = step.events
            if not events[-1].query():
                break
            pending.popleft()
            dev = [0.0] * 7
            for j, ph in enumerate(step.seg_phase):
                d = events[j].elapsed_time(events[j + 1]) * 1e-3
                s = step.seg_store[j]
                if s > 0.0:
                    s = min(s, d)
                    dev[STORE] += s
                    d -= s
                dev[ph] += d
            # the last event may open the next sampled step's chain; the others can be recorded again
            self._pool.extend(events[:-1])
            last = events[-1]
            if not (pending and pending[0].events[0] is last) and not (self._events and self._events[0] is last):
                self._pool.append(last)
            self._sink(step.epoch, step.batches, step.host, dev, step.samples, step.steady, step.forced)
            if self.on_device_step is not None and step.batches and not step.forced:
                self.on_device_step(step.position, sum(dev[:NUM_PHASES]))  # validation inside it left out
            n += 1
        return n
