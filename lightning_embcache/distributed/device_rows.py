"""`ShardedDeviceRows`: trainable rows of a `ShardedStore` whose owners keep them in GPU memory.

Each rank's shard gets a `DeviceTier` on the rank's GPU (its hot rows with their optimizer state,
within ``device_bytes``; the shard's other rows stay in its host tiers). Per lookup:

1. the batch's unique ids and the split sizes travel over the store's **Gloo** group (host to
   host, O(batch) int64): the owner's tier decides residency on the host from host ids, so the
   ids must reach the owner's host anyway, and split sizes known on the host are what
   ``all_to_all_single`` needs, so no step waits for a GPU to learn them;
2. each owner gathers the rows it serves from its tier (a device gather; misses come up from its
   host tiers without waiting for the GPU);
3. the rows travel GPU to GPU with one NCCL ``all_to_all_single`` on the default (NCCL) group.

At the optimizer step each rank sums its gradient rows per unique id on the GPU, divides them by
the world size (the rows see the mean of the ranks' gradients, as DDP gives the dense
parameters) and sends them back along the lookup's route with one NCCL ``all_to_all_single``; the
owner runs the tier's row optimizer (the fused Adam kernel where it applies) on rows and moments
in place. Nothing of a training step waits for a GPU (no ``.item()``/``.cpu()``/synchronize).

Announced lookups (`prefetch`, or `ShardedStore.prefetch` from the Lightning handle) go through a
two-stage pipeline (`RunAhead`): one thread exchanges the ids of the batch after next while
another brings up the rows this owner serves for the next one, both during the current step;
the lookup of an announced batch then only gathers and moves rows.

Reads and writes through the store (`ShardedStore.get`/``update``, `row_meta`, a flush) first
bring the tier's updated rows down into the shard's host store (`ShardedStore.before_exchange`);
a direct write of weights at an owner goes into its tier as well, so both copies agree.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_embcache.device_tier import SLOT_OVERHEAD, DeviceTier
from lightning_embcache.distributed.exchange import Route
from lightning_embcache.optim.base import RowOptimizer
from lightning_embcache.optim.clip import check_max_norm, renorm_rows
from lightning_embcache.store import EmbeddingStore, StoreError, idsets
from lightning_embcache.store.errors import InvalidArgumentError
from lightning_embcache.trainable import TrainableRows

log = logging.getLogger(__name__)


def auto_device_bytes(local: EmbeddingStore, device: torch.device) -> int:
    """``device_bytes=None``: the whole shard if it takes at most a quarter of the GPU, else a quarter."""
    shard = local.num_rows * (local.row_bytes + SLOT_OVERHEAD)
    return min(shard, torch.cuda.get_device_properties(device).total_memory // 4)


class _Lookup:
    """One lookup's route and where its rows sit: this rank as requester and as owner."""

    __slots__ = ("route", "pos_d", "slots", "slots_d", "grad")

    def __init__(self, route: Route, pos_d: Tensor, slots: np.ndarray, slots_d: Tensor) -> None:
        self.route = route
        self.pos_d = pos_d        # batch position -> row of the exchange's output (device)
        self.slots = slots        # tier slots of the rows this rank served (host)
        self.slots_d = slots_d    # the same on the device
        self.grad: Tensor | None = None  # per unique requested id, in the exchange's order


class ShardedDeviceRows:
    """The `TrainableRows` interface over a `ShardedStore` whose owners hold rows on their GPUs.

    Notes:
        * `lookup`, `apply` and `row_meta` are collectives: every rank calls them in the same
          order (as DDP's forward and backward already require).
        * A lookup's rows are updated at `apply` even where a rank's result got no gradient
          (its gradient rows are zeros), so every rank makes the same exchanges.
        * ``device_bytes`` smaller than the shard keeps the rows used last on the GPU (CLOCK);
          rows still to receive gradients are never evicted.

    Args:
        switch_interval: if given, ``sys.setswitchinterval(switch_interval)`` (seconds) while
            these rows are open, restored at `close`. **Process-wide**: every thread of the
            process takes turns on the interpreter lock at that interval. A shorter interval
            than Python's 5 ms lets the exchange, upload and write-back threads take their turns
            sooner after each call that released the lock; measured in docs/benchmarks.md
            (Distributed).
        max_norm, norm_type: as for `TrainableRows`; each owner rescales the rows it serves for a
            training lookup in its device tier (no extra exchange, no wait for the GPU).
        stochastic_rounding: as for `TrainableRows`; 16-bit rows are rounded by the owner's fused
            step, keyed by the owner's ids.

    Raises:
        InvalidArgumentError: invalid ids on any rank (every rank raises; nothing changes); a
            ``switch_interval`` out of range.
    """

    def __init__(self, store: Any, optimizer: RowOptimizer, device: torch.device, device_bytes: int | None, *,
                 max_grad_norm: float | None = None, switch_interval: float | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 stochastic_rounding: bool | None = None) -> None:
        if switch_interval is not None and (
            isinstance(switch_interval, bool)
            or not isinstance(switch_interval, (int, float))
            or not 0 < switch_interval <= 1
        ):
            raise InvalidArgumentError(
                f"Invalid value for switch_interval={switch_interval!r}. Must be in (0, 1] seconds, or None to leave "
                f"Python's setting ({sys.getswitchinterval()}) as it is"
            )
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        budget = auto_device_bytes(store.local, device) if device_bytes is None else device_bytes
        self.store = store
        self.optimizer = optimizer
        self.device = device
        self.tier = DeviceTier(store.local, device, budget)
        # the owner's optimizer: the tier's fused row step (16-bit rows rounded as `stochastic_rounding`
        # says, keyed by the owner's ids), metadata, dirty marks
        self.local = TrainableRows(store.local, optimizer, max_grad_norm=max_grad_norm, device_tier=self.tier,
                                   stochastic_rounding=stochastic_rounding)
        self.max_norm, self.norm_type = check_max_norm(max_norm, norm_type)
        self.group = dist.group.WORLD  # NCCL: the training group (its order is every rank's program order)
        self._lookups: list[_Lookup] = []  # since the last apply, in call order
        self._leaves: list[tuple[_Lookup, Tensor]] = []
        self._written = True  # the host store holds every update (nothing applied since write_down)
        self._stream = torch.cuda.current_stream(device)
        store.before_exchange = self.write_down
        store.device_rows = self
        store.ahead.serve, store.ahead.protect = self._serve, self.held_slots
        store.ahead.prepare = _prepare  # host work of the lookup and upload, two batches ahead
        self._switch = _SwitchInterval(switch_interval)

    device_tier = None  # the handle's own (single-process) tier is not involved

    # ---- forward -------------------------------------------------------------------------------
    def lookup(self, ids: Any, device: torch.device | str | None = None, device_ids: Tensor | None = None) -> Tensor:
        """Rows of global `ids` on this rank's GPU, a leaf with ``requires_grad=True`` when grad is
        enabled. (`device` and `device_ids` are accepted for the `TrainableRows` interface.)"""
        ahead = self.store.ahead
        try:
            route = ahead.take(torch.as_tensor(ids).detach().cpu())  # exchanged ahead, rows served
            if route is None:
                route = self._route(ids)
            pos = route.positions if route.positions is not None else _positions(route)
            tier, dim = self.tier, self.store.dim
            with self.store._clock:
                served = route.served.numpy()
                slots = tier.positions(served, self.held_slots()) if len(served) else np.empty(0, np.int64)
                slots_d = tier.device_positions(slots)
                weight = tier.view("weight")
                rows_out = weight.index_select(0, slots_d)
                if self.max_norm is not None and torch.is_grad_enabled() and len(slots):
                    # the owner renorms the rows it serves in its tier, as nn.Embedding(max_norm)
                    # does in its table at lookup; on the GPU, without waiting for it
                    rows_out, _ = renorm_rows(rows_out, self.max_norm, self.norm_type)
                    with tier.writing(slots):
                        weight.index_copy_(0, slots_d, rows_out)
                got = torch.empty((route.num_unique, dim), dtype=rows_out.dtype, device=self.device)
                dist.all_to_all_single(got, rows_out, route.send_splits, route.recv_splits, group=self.group)
                pos_d = tier.to_device(pos)
                rows = got.index_select(0, pos_d)
                route.bytes_sent += (route._out_serve) * dim * rows_out.element_size()
                self.store._clock.bytes_sent += route.bytes_sent
            if torch.is_grad_enabled():
                look = _Lookup(route, pos_d, slots, slots_d)
                self._lookups.append(look)
                rows.requires_grad_(True)
                self._leaves.append((look, rows))
        finally:
            ahead.release()  # the next announced lookup may bring its rows up, protecting these
        return rows

    def _route(self, ids: Any) -> Any:
        """Agree with every rank on who sends what (Gloo, the training thread)."""
        return self.store.route(ids, hook=False)[2]

    def prefetch(self, ids: Any) -> None:
        """Exchange a coming lookup's ids and bring the rows this rank serves for them up to its
        GPU in background threads, overlapping the current step; that lookup (which must be the
        next lookup of this object, of exactly these ids) then only moves rows. Call it after the
        current step's lookups, with the next batch's ids, and again with the one after it: the
        exchange of the batch after next then overlaps the owners' uploads for the next one.
        A collective: every rank calls it at the same points. (`ShardedStore.prefetch` announces
        lookups that may come in any pattern, e.g. from a `LookaheadSampler`.)
        """
        self.store.announce(ids, explicit=True, raise_invalid=False)  # invalid ids raise at the lookup

    def _serve(self, route: Any, protect: np.ndarray | None) -> None:
        """`RunAhead`'s serve stage: bring up the rows this rank serves for an announced lookup."""
        uniq = route.served_unique
        if uniq is None:
            uniq = idsets.unique(route.served.numpy())
        if not len(uniq):
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            try:
                self.tier.slots(uniq, protect)
            except StoreError:
                # This step's rows and the next batch's do not fit the tier at once: the rows
                # come up at the lookup instead (an error here would stop this rank alone and
                # leave the others waiting in the rows' exchange).
                pass

    def _join(self) -> None:
        """Wait for an owner's upload running ahead (before the tier's rows go down)."""
        self.store.ahead.quiesce()

    def held_slots(self) -> np.ndarray | None:
        """Tier slots this rank serves for lookups whose gradients are not applied yet."""
        held = [k.slots for k in self._lookups]
        return np.concatenate(held) if held else None

    # ---- backward ------------------------------------------------------------------------------
    def collect(self) -> int:
        """Sum this micro-batch's gradient rows per unique id on the GPU; no communication."""
        taken = 0
        for look, leaf in self._leaves:
            g = leaf.grad
            if g is None:
                continue
            if look.grad is None:
                look.grad = torch.zeros((look.route.num_unique, g.shape[1]), dtype=torch.float32, device=g.device)
            look.grad.index_add_(0, look.pos_d, g.float())
            taken += g.shape[0]
        self._leaves.clear()
        return taken

    def apply(self, step: int, lr: float | None = None, *, grad_scale: float | None = None) -> None:
        """Send every lookup's gradient rows to their owners (NCCL) and run the owners' row step on
        their GPUs. Every rank calls it at the same steps."""
        self.collect()
        lookups, self._lookups = self._lookups, []
        divisor = float(self.store.world_size)
        if grad_scale is not None:
            # Mixed precision with a loss scale: the step is skipped on every rank when any rank's
            # rows overflowed, as the scaler skips the dense step (one flag all-reduced; the
            # GradScaler waits for the GPU every step anyway).
            ok = torch.ones((), dtype=torch.float32, device=self.device)
            for look in lookups:
                if look.grad is not None:
                    ok = ok * torch.isfinite(look.grad).all()
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
            if not bool(ok):
                return
            divisor *= grad_scale
        with self.store._clock:
            for look in lookups:
                route = look.route
                g = look.grad
                if g is None:
                    g = torch.zeros((route.num_unique, self.store.dim), dtype=torch.float32, device=self.device)
                g = g / divisor
                got = torch.empty((int(sum(route.recv_splits)), g.shape[1]), dtype=torch.float32, device=self.device)
                dist.all_to_all_single(got, g, route.recv_splits, route.send_splits, group=self.group)
                self.store._clock.bytes_sent += route._out_push * g.shape[1] * 4
                if len(look.slots):
                    # the owner's step through its TrainableRows: rows several ranks sent for one id
                    # are summed by the row step, as duplicates of one batch are
                    self.local._dev_grads.append((look.slots, look.slots_d, got))
                    assert route.served is not None  # a route with served rows
                    self.local._dev_grad_ids.append(route.served.numpy())  # keys of 16-bit rounding
        if self.local._dev_grads:
            self.local.apply(int(step), lr)
            self._written = False

    def settle(self) -> int:
        """Nothing to run: the owners' steps are queued on their GPUs at `apply`. Waits for an
        exchange running ahead, so that what follows (a flush, a checkpoint) comes after it."""
        self._join()
        return 0

    def finish(self) -> int:
        return 0

    def write_down(self) -> int:
        """Bring the tier's updated rows into the shard's host store (before a read, write or flush
        through the store); returns rows written."""
        self._join()  # its exchange comes first on every rank
        if self._written:
            return 0
        n = self.tier.write_down()
        self._written = True
        return n

    def write_served(self, local_ids: Tensor, values: dict[str, Tensor]) -> None:
        """A direct write at this owner (after `write_down`): the host store has it; the tier's
        copies of those rows take the new weights too."""
        if "weight" not in values or not len(local_ids):
            return
        ids = local_ids.numpy()
        self.tier.scatter(ids, values["weight"].to(self.device, self.store.dtype), self.held_slots())
        self._written = False

    def discard(self) -> None:
        """Drop collected gradients (every rank alike: the exchanges of `apply` are skipped)."""
        self._leaves.clear()
        self._lookups.clear()

    def row_meta(self, ids: Any) -> dict[str, Tensor]:
        """`{"last_step": int32[len(ids)], "updates": int32[len(ids)]}` from the rows' owners."""
        got = self.store.get_fields(ids, ("last_step", "updates"))
        return {k: v[:, 0] for k, v in got.items()}

    def close(self) -> None:
        """Free the GPU memory (after a flush: rows not written down are dropped)."""
        ahead = self.store.ahead
        ahead.close()  # its uploads are this tier's
        ahead.serve, ahead.protect, ahead.prepare = None, lambda: None, None
        self.tier.close()
        self._switch.restore()


class _SwitchInterval:
    """Python's thread switch interval while the rows are open (``switch_interval``), restored at
    `ShardedDeviceRows.close` unless something else changed it meanwhile. Process-wide."""

    def __init__(self, seconds: float | None) -> None:
        self.before = self.set = None
        if seconds is not None:
            self.before = sys.getswitchinterval()
            sys.setswitchinterval(float(seconds))
            self.set = sys.getswitchinterval()  # as Python rounds it (whole microseconds)
            log.info("sys.setswitchinterval(%s) while sharded rows train (was %s)", self.set, self.before)

    def restore(self) -> None:
        if self.set is not None and self.before is not None and sys.getswitchinterval() == self.set:
            sys.setswitchinterval(self.before)
        self.set = None


def _prepare(route: Any) -> None:
    """`RunAhead`'s prepare stage, in the exchange thread: the lookup's `_positions` and the
    distinct ids the upload brings up (its sort would otherwise hold up the upload thread)."""
    route.positions = _positions(route)
    route.served_unique = idsets.unique(route.served.numpy())


def _positions(route: Any) -> np.ndarray:
    """For each batch position, the row of the exchange's (owner-grouped) output holding its id."""
    where = torch.empty_like(route.order)
    where[route.order] = torch.arange(len(route.order))
    return where.index_select(0, route.inverse).numpy()
