"""The store's background I/O thread: the tiers' write-back, compaction and garbage collection.

`Background` is the part of `Versions` that runs these jobs, one at a time on one thread, a job
of a kind already queued absorbing another of its kind. It sees `Versions` as an `Owner`, held
through a weak reference only: a job holds the store's parts only while it runs (a compaction
pass a round at a time), so a store dropped without close() is closed by its finalizer between
two rounds instead of living on as long as its background work. A job's failure is kept and
raised by the next flush (`raise_error`); a damaged file stops all background work (fail-stop,
`Owner.saw_damage`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from .core import StoreCore, stop_executor
from .errors import CorruptStoreError, StoreError

if TYPE_CHECKING:
    from .compaction import Compaction
    from .garbage import Garbage


class Owner(Protocol):
    """What the background jobs ask of `Versions`."""

    damage: CorruptStoreError | None
    compaction: Compaction
    garbage: Garbage
    bg: Background

    def clean_now(self) -> None: ...

    def saw_damage(self, exc: CorruptStoreError) -> None: ...


def _ended(owner: Owner | None) -> bool:
    """Whether background work of ``owner`` stops: dropped, closed or damaged."""
    return owner is None or owner.bg._c.closed or owner.damage is not None


def _run_weakly(ref: weakref.ReferenceType[Owner], name: str) -> None:
    """A background job of the `Versions` ``ref`` names. The compaction pass goes a round at a
    time, holding the store's parts only during a round."""
    owner = ref()
    if owner is None or _ended(owner):
        return
    if name != "_compact":
        owner.bg._run(owner.bg._job(name))
        return
    try:
        state = owner.compaction.step(None)
        while state is not None:
            del owner
            owner = ref()
            if owner is None or _ended(owner):
                return
            state = owner.compaction.step(state)
    except BaseException as exc:  # surfaced on the next flush()
        if owner is not None:
            owner.bg.error = exc
            if isinstance(exc, CorruptStoreError):
                owner.saw_damage(exc)


class Background:
    """The background I/O thread of one `Versions` (see the module)."""

    def __init__(self, core: StoreCore, owner: Owner) -> None:
        self._c = core
        self._owner = weakref.ref(owner)  # weakly: see the module docstring
        self._pool: ThreadPoolExecutor | None = None
        self.futures: dict[str, Future] = {}
        self.error: BaseException | None = None

    def submit(self, key: str) -> None:
        """Run the job ``key`` names (`_job`) on the background I/O thread; a job of the same kind
        already queued absorbs it."""
        with self._c.lock:
            if self._c.closed:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="embcache-bg")
            owner = self._owner()
            if owner is None or owner.damage is not None:
                return  # fail-stop: a store that met a damaged file writes nothing more in its folder
            fut = self.futures.get(key)
            if fut is not None and not fut.done():
                return
            self.futures[key] = self._pool.submit(_run_weakly, self._owner, key)

    def _job(self, key: str) -> Callable[[], None]:
        """The background job ``key`` names: the tiers' write-back (``"clean"``) or garbage
        collection (``"_collect_garbage"``; ``"_compact"`` runs a round at a time, `_run_weakly`)."""
        owner = self._owner()
        assert owner is not None, "a job runs for a live store"
        return owner.clean_now if key == "clean" else owner.garbage.collect

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # surfaced on the next flush()
            self.error = exc
            owner = self._owner()
            if owner is not None and isinstance(exc, CorruptStoreError):
                owner.saw_damage(exc)

    def raise_error(self) -> None:
        """Raise what a background job failed with since the last call (a flush's first step)."""
        exc, self.error = self.error, None
        if exc is not None:
            raise StoreError(
                f"background store work (write-back, compaction or garbage collection) failed: {exc}"
            ) from exc

    def wait(self) -> None:
        """Wait for the jobs submitted so far; raises what one of them raised."""
        for fut in list(self.futures.values()):
            fut.result()

    def stop(self, wait: bool = True) -> None:
        """Stop the background I/O thread (`EmbeddingStore.close`; its job ends at its next look)."""
        stop_executor(self._pool, wait)

    def after_fork(self) -> None:
        """In a forked child: the parent's thread did not survive the fork."""
        self._pool = None
        self.futures = {}
