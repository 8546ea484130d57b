"""`MemoryPressure`: shrink the embedding stores' RAM when the machine or the cgroup runs short."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_embcache.lightning.figures import reduce_figures, several_ranks
from lightning_embcache.lightning.memory_reading import MemoryReader, MemoryReading
from lightning_embcache.store.errors import StoreError

log = logging.getLogger(__name__)

MiB = 1 << 20


def _mib(n: float) -> str:
    return f"{n / MiB:.0f} MiB"


class MemoryPressure(Callback):
    """Evicts cached store rows when memory use passes `high`, down to `target`.

    Example::

        trainer = Trainer(callbacks=[MemoryPressure(high=0.85, target=0.75, check_every_n_steps=50)])

    Notes:
        - Every `check_every_n_steps` training batches it reads: machine memory (psutil), the RSS of
          this process plus its DataLoader worker children, and the cgroup v2/v1 limit and working
          set (``/proc/self/cgroup`` + ``/sys/fs/cgroup``), which is what the OOM killer enforces
          in a container or a Slurm/Kubernetes job. The used fraction is the tighter of machine and
          cgroup. A check costs well under 1 ms (see ``MemoryReader``), ~0.01 ms per step at the default.
        - Above `high` it asks each store (in proportion to its resident hot+warm bytes) to evict
          ``(used_fraction - target) x limit`` bytes: the further over, the more it frees. If the
          stores cannot free that much, it lowers their hot budgets by the rest (``set_budget``,
          not below `min_hot_bytes`) and warns once with the figures.
        - Stores with ``path=None`` live only in memory and are left alone.
        - Logged (to ``trainer.loggers``, rank 0) at each check: ``embcache/mem_used_fraction``,
          ``embcache/rss_bytes``, ``embcache/evicted_bytes`` (bytes freed by this check).

    Args:
        high: used fraction that triggers eviction, in (0, 1].
        target: used fraction to get back to, in (0, high).
        check_every_n_steps: training batches between checks, >= 1.
        include_workers: add the RSS of child processes (DataLoader workers) to ``rss_bytes``.
        reader: returns a :class:`MemoryReading`; defaults to a ``MemoryReader`` (inject one in tests).
        cgroup_root: where the cgroup file system is mounted.
        proc_cgroup: the file naming this process's cgroups.
        min_hot_bytes: lowest hot budget set under pressure.

    Raises:
        ValueError: for thresholds out of range or an interval below 1.
    """

    def __init__(
        self,
        high: float = 0.85,
        target: float = 0.75,
        check_every_n_steps: int = 50,
        include_workers: bool = True,
        *,
        reader: Callable[[], MemoryReading] | None = None,
        cgroup_root: str = "/sys/fs/cgroup",
        proc_cgroup: str = "/proc/self/cgroup",
        min_hot_bytes: int = 16 * MiB,
    ) -> None:
        if not 0.0 < high <= 1.0:
            raise ValueError(f"Invalid value for high={high}. Must be in (0, 1]")
        if not 0.0 < target < high:
            raise ValueError(f"Invalid value for target={target}. Must be in (0, high={high})")
        if check_every_n_steps < 1:
            raise ValueError(f"Invalid value for check_every_n_steps={check_every_n_steps}. Must be >= 1")
        if min_hot_bytes < 0:
            raise ValueError(f"Invalid value for min_hot_bytes={min_hot_bytes}. Must be >= 0")
        self.high = high
        self.target = target
        self.check_every_n_steps = check_every_n_steps
        self.include_workers = include_workers
        self.min_hot_bytes = min_hot_bytes
        self._reader = reader or MemoryReader(include_workers, os.fspath(cgroup_root), os.fspath(proc_cgroup))
        self._batches = 0
        self.evicted_bytes_total = 0
        self.budget_cuts = 0
        self._warned = False
        self.last_reading: MemoryReading | None = None
        self.last_metrics: dict[str, float] = {}
        self.deferred = 0  # checks whose relief a store refused (busy, closed, I/O): retried next check

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._batches += 1
        if self._batches % self.check_every_n_steps == 0:
            self.check(trainer, pl_module)

    def check(self, trainer: Trainer, pl_module: LightningModule) -> int:
        """Read memory, relieve pressure if over `high`, log; returns the bytes evicted."""
        reading = self._reader()
        self.last_reading = reading
        evicted = 0
        fraction = reading.used_fraction
        if fraction > self.high:
            try:
                evicted = self._relieve(pl_module, reading)
            except StoreError as exc:
                # Never raise into the fit it protects: a store busy with a flush, closing, or
                # failing a write-back is asked again at the next check.
                self.deferred += 1
                log.debug("MemoryPressure: relief deferred to the next check: %s", exc)
        self.evicted_bytes_total += evicted
        metrics = {
            "embcache/mem_used_fraction": fraction,
            "embcache/rss_bytes": float(reading.rss_bytes),
            "embcache/evicted_bytes": float(evicted),
        }
        if several_ranks():  # each rank relieved its own shard; log the job's figures (one all-reduce)
            metrics = reduce_figures(metrics, trainer) or metrics
        self._log(trainer, metrics)
        return evicted

    def _relieve(self, pl_module: LightningModule, reading: MemoryReading) -> int:
        need = int((reading.used_fraction - self.target) * reading.limit_bytes)
        stores = getattr(pl_module, "embedding_stores", {}).values()
        handles = [h for h in stores if h.path is not None and h._is_open()]
        if not handles or need <= 0:
            return 0
        resident = {h.name: max(self._resident(h), 0) for h in handles}
        total = sum(resident.values())
        freed = 0
        shares = {}
        for h in handles:
            share = need * resident[h.name] // total if total else need // len(handles)
            shares[h.name] = share
            if share > 0:
                done, out = self._ask(h.store.evict, share)
                freed += int(out) if done else 0
        if freed >= need:
            return freed
        # Not enough was clean or resident: lower the budgets so the stores stop growing back.
        short = need - freed
        cuts = []
        for h in handles:
            stats = h.stats()
            budget = stats.hot_budget_bytes if stats.hot_budget_bytes else stats.hot_bytes
            cut = short * resident[h.name] // total if total else short // len(handles)
            new_budget = max(int(budget) - cut, self.min_hot_bytes)
            if new_budget < budget:
                if not self._ask(h.store.set_budget, hot_bytes=new_budget)[0]:
                    continue  # refused this time (a flush writing, an I/O error): next check retries
                cuts.append(f"{h.name!r} {_mib(budget)} -> {_mib(new_budget)}")
        if cuts:
            self.budget_cuts += 1
            if self._warned:  # once per callback: the figures differ every time
                return freed
            self._warned = True
            rank_zero_warn(
                f"MemoryPressure: memory at {reading.used_fraction:.0%} of {_mib(reading.limit_bytes)} "
                f"(high={self.high}, "
                f"target={self.target}); evicting freed {_mib(freed)} of the {_mib(need)} needed, so hot budgets "
                f"were lowered: {', '.join(cuts)}. Training goes on with more cold reads; lower hot_bytes or "
                "num_workers to avoid this."
            )
        return freed

    def _ask(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """One store call of the relief: (True, its result), or (False, None) when the store
        refused it (a StoreError: busy, closed, a failed write-back); the next check asks again."""
        try:
            return True, fn(*args, **kwargs)
        except StoreError as exc:
            self.deferred += 1
            log.debug("MemoryPressure: %s deferred to the next check: %s", getattr(fn, "__name__", fn), exc)
            return False, None

    @staticmethod
    def _resident(handle: Any) -> int:
        stats = handle.stats()
        return int(stats.hot_bytes) + int(stats.warm_bytes)

    @rank_zero_only
    def _log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.last_metrics.update(metrics)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
