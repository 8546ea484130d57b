"""`DeferredSync`: flush embedding stores at intervals, in the background, and before every checkpoint."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_embcache.lightning.figures import reduce_figures, several_ranks
from lightning_embcache.lightning.flush_worker import CoalescingWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncResult:
    seconds: float
    synced_rows: int  # rows the flushes made durable
    dirty_rows: int  # rows updated meanwhile, still not durable when the flushes returned


def _flush_stores(pl_module: LightningModule) -> SyncResult:
    """Flush every store of the module. ``stats()`` costs milliseconds on a large table, so this
    (and with ``background=True`` only the worker thread) is the one place that calls it."""
    start = time.perf_counter()
    synced = dirty = 0
    for handle in getattr(pl_module, "embedding_stores", {}).values():
        before = handle.stats().flushed_rows
        handle.flush()
        after = handle.stats()
        synced += after.flushed_rows - before
        dirty += after.dirty_rows
    return SyncResult(time.perf_counter() - start, synced, dirty)


class DeferredSync(Callback):
    """Makes store updates durable every few steps or epochs without making the step wait.

    Example::

        trainer = Trainer(callbacks=[DeferredSync(every_n_steps=200)])

    Notes:
        - Works on the stores of an :class:`EmbeddingStoreMixin` module (``pl_module.embedding_stores``).
        - With ``background=True`` a flush runs in one worker thread while training goes on (the
          store's flush is thread-safe). A flush that falls due while one is still running is
          coalesced: at most one more runs after it, requests never queue up.
        - Before a checkpoint is written (``on_checkpoint=True``) and when ``fit`` ends, it waits
          for a running flush and flushes on the training thread, so the checkpoint names a
          version that holds every update so far. The mixin flushes for checkpoints in any case
          (a checkpoint must name a durable version); ``on_checkpoint=False`` only leaves that
          flush out of this callback's figures and does not wait for a background flush.
        - Disk use: between flushes, dirty rows evicted from a store's hot tier are written to disk
          beside the last flushed version, which stays whole until the next flush commits them.
          A store whose rows all change between two flushes (one flush an epoch over per-sample
          rows) then holds about twice its table right after the flush. ``unflushed_share``
          requests a flush once a store's rows written since its last flush pass that share of
          its table, which keeps disk use near the table plus compaction's share.
        - Logged (to ``trainer.loggers``, rank 0) when flushes complete: ``embcache/sync_seconds``
          (wall time of the last flush), ``embcache/synced_rows`` (rows made durable since the last
          log), ``embcache/dirty_rows`` (rows updated during the last flush, not yet durable: a
          backlog that keeps growing means the flushes cannot keep up).

    Args:
        every_n_steps: flush every N training batches; ``None`` = never.
        every_n_epochs: flush at the end of every N training epochs; ``None`` = never.
        on_checkpoint: flush before each checkpoint is written.
        background: flush in a worker thread (``False``: on the training thread, in the hook).
        unflushed_share: flush once the rows a store wrote to disk since its last flush pass this
            share of its table's bytes (checked every batch, O(1)); ``None`` = never. Each rank
            checks its own shard.

    Raises:
        TypeError: an interval that is not an int (or None), a flag that is not a bool, a share
            that is not a number (or None).
        ValueError: for an interval below 1, a share outside (0, 1].
        MisconfigurationException: at setup, for a module without ``EmbeddingStoreMixin``
            (there would be nothing to flush).
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = 1,
        on_checkpoint: bool = True,
        background: bool = True,
        unflushed_share: float | None = 0.1,
    ) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"Invalid value for {name}={value!r}. Must be an int >= 1 or None, "
                                f"got {type(value).__name__}")
            if value is not None and value < 1:
                raise ValueError(f"Invalid value for {name}={value}. Must be >= 1 or None")
        for name, flag in (("on_checkpoint", on_checkpoint), ("background", background)):
            if not isinstance(flag, bool):
                raise TypeError(f"Invalid value for {name}={flag!r}. Must be True or False")
        if unflushed_share is not None:
            if isinstance(unflushed_share, bool) or not isinstance(unflushed_share, (int, float)):
                raise TypeError(f"Invalid value for unflushed_share={unflushed_share!r}. Must be a number in (0, 1] "
                                f"or None, got {type(unflushed_share).__name__}")
            if not 0.0 < unflushed_share <= 1.0:
                raise ValueError(f"Invalid value for unflushed_share={unflushed_share}. Must be in (0, 1] or None")
        self.every_n_steps = every_n_steps
        self.unflushed_share = None if unflushed_share is None else float(unflushed_share)
        self.every_n_epochs = every_n_epochs
        self.on_checkpoint = on_checkpoint
        self.background = background
        self._worker: CoalescingWorker[SyncResult] | None = None
        self.syncs = 0  # flushes completed (background and foreground)
        self._coalesced_before = 0  # by workers of earlier fits
        self.last_metrics: dict[str, float] = {}
        self._unreported: list[SyncResult] = []  # several processes: logged at the next common point

    @property
    def coalesced(self) -> int:
        """Flush requests merged into a pending one so far."""
        return self._coalesced_before + (self._worker.coalesced if self._worker is not None else 0)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from lightning_embcache.lightning.mixin import EmbeddingStoreMixin

        if not isinstance(pl_module, EmbeddingStoreMixin):
            raise MisconfigurationException(
                f"DeferredSync flushes the embedding stores of a module with EmbeddingStoreMixin; "
                f"{type(pl_module).__name__} does not have it, so there is nothing to flush. Add the mixin "
                f"(class {type(pl_module).__name__}(EmbeddingStoreMixin, L.LightningModule)) or remove the callback"
            )
        stores = pl_module.embedding_stores
        if not any(handle.path is not None for handle in stores.values()):
            rank_zero_warn(
                f"DeferredSync: {type(pl_module).__name__} has no embedding store with a path "
                f"({len(stores)} in memory only), so its flushes make nothing durable"
            )
        if self.background and self._worker is None:
            self._worker = CoalescingWorker(lambda: _flush_stores(pl_module))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # Training batches, not optimizer steps: rows written directly change with every batch,
        # also in a module without optimizer (where global_step never moves). Restored on resume.
        batches = trainer.fit_loop.epoch_loop.total_batch_idx + 1
        every = self.every_n_steps
        due = every is not None and every > 0 and batches % every == 0
        self._report(trainer, self._drain(), collective=due)
        if due:
            self._request(trainer, pl_module)
        elif self.unflushed_share is not None and not self._flushing() and self._over_share(pl_module):
            # this rank's own shard: no collective (the figures wait for a common point)
            self._request(trainer, pl_module, collective=False)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if several_ranks():
            self._report(trainer, self._drain(), collective=True)
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._request(trainer, pl_module)

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.on_checkpoint:
            self._flush_now(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_now(trainer, pl_module)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    # ------------------------------------------------------------------ private
    def _flushing(self) -> bool:
        """A background flush is queued or running (it commits what is over the share)."""
        return self._worker is not None and self._worker.busy

    def _over_share(self, pl_module: LightningModule) -> bool:
        share = self.unflushed_share
        return any(h.unflushed_share > share for h in getattr(pl_module, "embedding_stores", {}).values())

    def _request(self, trainer: Trainer, pl_module: LightningModule, collective: bool = True) -> None:
        if self._worker is not None:
            self._worker.request()
        else:
            self._report(trainer, [_flush_stores(pl_module)], collective=collective)

    def _flush_now(self, trainer: Trainer, pl_module: LightningModule) -> None:
        results = self._drain(wait=True)
        results.append(_flush_stores(pl_module))
        self._report(trainer, results, collective=True)

    def _drain(self, wait: bool = False) -> list[SyncResult]:
        if self._worker is None:
            return []
        if wait:
            self._worker.wait_idle()
        return self._worker.drain()

    def _report(self, trainer: Trainer, results: list[SyncResult], collective: bool = False) -> None:
        # Several processes: each rank flushes its own shard, whenever its worker finishes; the
        # figures are combined (one all-reduce) only at points every rank reaches together.
        self._unreported.extend(results)
        if several_ranks() and not collective:
            return
        results, self._unreported = self._unreported, []
        self.syncs += len(results)
        metrics = {
            "embcache/sync_seconds": results[-1].seconds if results else 0.0,
            "embcache/synced_rows": float(sum(r.synced_rows for r in results)),
            "embcache/dirty_rows": float(results[-1].dirty_rows) if results else 0.0,
        }
        if several_ranks():
            metrics = reduce_figures(metrics, trainer, present=bool(results))  # type: ignore[assignment]
        if metrics is not None and (results or several_ranks()):
            self._log(trainer, metrics)

    @rank_zero_only
    def _log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.last_metrics.update(metrics)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _stop(self) -> None:
        if self._worker is not None:
            worker, self._worker = self._worker, None
            worker.stop()
            self._coalesced_before += worker.coalesced
