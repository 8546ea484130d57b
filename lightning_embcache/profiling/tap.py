"""A pass-through wrapper around the Trainer's profiler that reports chosen actions to a callback.

Lightning brackets the loader's ``next()`` with ``profiler.start/stop("[_TrainingEpochLoop].
train_dataloader_next")``, the host-to-device transfer with ``[Strategy]<name>.batch_to_device``,
the batch with ``run_training_batch``, each LightningModule hook with ``[LightningModule]<name>.
<hook>`` and the optimizer step with ``[LightningModule]<name>.optimizer_step`` (automatic
optimization) or ``optimizer_step`` (manual optimization). Wrapping the profiler is the public way
to see those boundaries (see ``boundaries.loop_actions``); every call still reaches the user's own
profiler unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.profilers import PassThroughProfiler, Profiler


class _NoAction:
    """What ``profile()`` returns for an action nobody records: no generator, no Python frame.

    ``str.format`` ignores arguments its string does not use, so ``"".format`` is a C function
    that takes ``__exit__``'s three arguments and returns ``""``: falsy, so an exception raised in
    the ``with`` block propagates. Lightning opens ~17 such actions a step; two Python methods
    here cost 45-50 ns more per action (``with x as y`` gives ``""``; Lightning never asks).
    """

    __slots__ = ()
    __enter__ = "".format
    __exit__ = "".format


_NO_ACTION = _NoAction()


class _Forwarded:
    """An action's context in front of a profiler that records (``start``/``stop`` of the tap)."""

    __slots__ = ("tap", "name")

    def __init__(self, tap: ProfilerTap, name: str) -> None:
        self.tap, self.name = tap, name

    def __enter__(self) -> str:
        self.tap.start(self.name)
        return self.name

    def __exit__(self, *exc: Any) -> None:
        self.tap.stop(self.name)


class _Action:
    """A tracked action's context behind the default profiler: its hooks, called directly (one
    per action name, reused: Lightning enters a few of these every step)."""

    __slots__ = ("name", "on_start", "on_stop")

    def __init__(self, name: str, on_start: Callable[[], None] | None,
                 on_stop: Callable[[], None] | None) -> None:
        self.name, self.on_start, self.on_stop = name, on_start, on_stop

    def __enter__(self) -> str:
        if self.on_start is not None:
            self.on_start()
        return self.name

    def __exit__(self, *exc: Any) -> None:
        if self.on_stop is not None:
            self.on_stop()


class ProfilerTap(Profiler):
    """Forwards everything to ``inner``; calls ``on_start[action]()`` / ``on_stop[action]()`` first."""

    def __init__(self, inner: Profiler, on_start: dict[str, Callable[[], None]],
                 on_stop: dict[str, Callable[[], None]]) -> None:
        # Profiler.__init__ is deliberately not called: its attributes belong to `inner`, and
        # __getattr__ forwards them there.
        object.__setattr__(self, "_on_start", on_start)
        object.__setattr__(self, "_on_stop", on_stop)
        # action name -> context; a name nobody tracks maps to the shared no-op one on first use
        # (a few dozen names a fit), so a lookup is one dict read in C
        actions: defaultdict = defaultdict(lambda: _NO_ACTION)
        actions.update((name, _Action(name, on_start.get(name), on_stop.get(name)))
                       for name in frozenset(on_start) | frozenset(on_stop))
        object.__setattr__(self, "_actions", actions)
        self._bind(inner)

    def _bind(self, inner: Profiler) -> None:
        object.__setattr__(self, "inner", inner)
        passthrough = type(inner) is PassThroughProfiler
        object.__setattr__(self, "_inner_start", None if passthrough else inner.start)
        object.__setattr__(self, "_inner_stop", None if passthrough else inner.stop)
        object.__setattr__(self, "_custom_profile", type(inner).profile is not Profiler.profile)
        if passthrough and not self._custom_profile:
            # Lightning opens ~23 actions a step: behind PassThroughProfiler, which records
            # nothing, profile(name) is the dict's own lookup, no Python frame at all
            object.__setattr__(self, "profile", self._actions.__getitem__)
            # and start/stop (the loader's next()) only call the hooks
            start_hooks, stop_hooks = self._on_start.get, self._on_stop.get

            def start(action_name: str) -> None:
                hook = start_hooks(action_name)
                if hook is not None:
                    hook()

            def stop(action_name: str) -> None:
                hook = stop_hooks(action_name)
                if hook is not None:
                    hook()

            object.__setattr__(self, "start", start)
            object.__setattr__(self, "stop", stop)
        else:
            for name in ("profile", "start", "stop"):
                self.__dict__.pop(name, None)

    def track(self, action_name: str, on_start: Callable[[], None] | None = None,
              on_stop: Callable[[], None] | None = None) -> None:
        """Call ``on_start`` / ``on_stop`` at ``action_name`` from now on (in place: every bound
        fast path sees it)."""
        for hooks, hook in ((self._on_start, on_start), (self._on_stop, on_stop)):
            if hook is not None:
                hooks[action_name] = hook
        self._actions[action_name] = _Action(action_name, self._on_start.get(action_name),
                                             self._on_stop.get(action_name))

    @staticmethod
    def remove(top: Profiler, tap: ProfilerTap) -> Profiler:
        """``top`` (a chain of taps over the user's profiler) without ``tap``: two StepProfilers
        tear down in any order and leave the Trainer its own profiler."""
        if top is tap:
            return tap.inner
        node = top
        while isinstance(node, ProfilerTap):
            if node.inner is tap:
                node._bind(tap.inner)
                break
            node = node.inner
        return top

    def start(self, action_name: str) -> None:
        hook = self._on_start.get(action_name)
        if hook is not None:
            hook()
        if self._inner_start is not None:
            self._inner_start(action_name)

    def stop(self, action_name: str) -> None:
        if self._inner_stop is not None:
            self._inner_stop(action_name)
        hook = self._on_stop.get(action_name)
        if hook is not None:
            hook()

    def profile(self, action_name: str) -> Any:
        """Lightning wraps every hook call in ``profiler.profile(name)`` (dozens per step).

        Behind the default PassThroughProfiler, actions we do not track get a shared no-op context
        (cheaper than the base class's generator, so wrapping costs the loop nothing there);
        tracked ones call the hooks; a profiler with its own ``profile()`` keeps it.
        """
        if self._custom_profile:
            return self._chained(action_name)
        if self._inner_start is None:  # behind PassThroughProfiler, which records nothing
            return self._actions.get(action_name, _NO_ACTION)
        return _Forwarded(self, action_name)

    @contextmanager
    def _chained(self, action_name: str) -> Iterator[str]:
        hook = self._on_start.get(action_name)
        if hook is not None:
            hook()
        try:
            with self.inner.profile(action_name):
                yield action_name
        finally:
            hook = self._on_stop.get(action_name)
            if hook is not None:
                hook()

    # everything else is the inner profiler's business
    def summary(self) -> str:
        return self.inner.summary()

    def describe(self) -> None:
        self.inner.describe()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank=local_rank, log_dir=log_dir)

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found on the tap itself
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def __del__(self) -> None:
        pass  # the inner profiler tears itself down
