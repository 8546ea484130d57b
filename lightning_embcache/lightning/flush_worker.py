"""One background thread that runs flushes one at a time, coalescing requests that arrive meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CoalescingWorker(Generic[T]):
    """Runs `job` in one daemon thread when asked; at most one run in flight and one pending.

    A request that arrives while a run is pending is merged into it (``coalesced`` counts those),
    so requests never queue up however slow the job is. Results are collected until
    :meth:`drain` takes them; an exception in the job is re-raised by the next
    :meth:`drain`, :meth:`wait_idle` or :meth:`request`.
    """

    def __init__(self, job: Callable[[], T], name: str = "embcache-flush") -> None:
        self._job = job
        self._cond = threading.Condition()
        self._pending = False
        self._running = False
        self._stopping = False
        self._results: list[T] = []
        self._error: BaseException | None = None
        self.requests = 0
        self.runs = 0
        self.coalesced = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def request(self) -> bool:
        """Ask for a run; returns False when merged into a run that has not started yet."""
        with self._cond:
            self._raise_error()
            self.requests += 1
            if self._pending:
                self.coalesced += 1
                return False
            self._pending = True
            self._cond.notify_all()
            return True

    def wait_idle(self) -> None:
        """Block until nothing is running or pending."""
        with self._cond:
            while self._pending or self._running:
                self._cond.wait()
            self._raise_error()

    def drain(self) -> list[T]:
        with self._cond:
            self._raise_error()
            results, self._results = self._results, []
            return results

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._pending or self._running

    def stop(self) -> None:
        """Let a run in flight finish, drop a pending one, end the thread."""
        with self._cond:
            self._stopping = True
            self._pending = False
            self._cond.notify_all()
        self._thread.join()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                self._pending = False
                self._running = True
            try:
                result = self._job()
                error = None
            except BaseException as exc:  # surfaced on the training thread
                result, error = None, exc
            with self._cond:
                self._running = False
                self.runs += 1
                if error is not None:
                    self._error = error
                else:
                    self._results.append(result)  # type: ignore[arg-type]
                self._cond.notify_all()
