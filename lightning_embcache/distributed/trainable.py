"""`ShardedTrainableRows`: trainable rows of a `ShardedStore`; each owner runs the optimizer on its rows.

`lookup` fetches rows from their owners (one exchange); `collect` keeps this rank's gradient rows
by global id, summed across micro-batches, without communicating; `apply(step)` sends each unique
id's gradient row to its owner (one exchange, O(batch x dim)), and the owner adds the rows that
several ranks sent for one id and runs the sparse optimizer through its own `TrainableRows` on its
shard, writing weights, moments and metadata in one record as a single process does.

The gradient rows' transfer overlaps what follows `apply` (the dense optimizer step, the next
batch); the owners update the rows before the store's next exchange (the next `lookup`, `get`,
`update`) and before any flush, so every read sees every earlier step.

Gradients are divided by the world size before they travel, so the rows see the mean of the ranks'
gradients, as DDP's all-reduce gives the dense parameters: a run on W ranks with a per-rank
batch b trains the rows as one process with batch W x b would (checked against `nn.Embedding` +
`SparseAdam` in ``tests/distributed``).

``max_norm``: each owner rescales the rows it serves for a training lookup in its own shard before
they travel (what ``nn.Embedding(max_norm=...)`` does in its table), so the rows every rank sees
and trains are bounded with no extra exchange. 16-bit rows are rounded stochastically by their
owner, keyed by the row's shard-local id.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from lightning_embcache.distributed.store import ShardedStore
from lightning_embcache.optim.base import RowOptimizer
from lightning_embcache.optim.coalesce import RowGradBuffer
from lightning_embcache.trainable import TrainableRows


class ShardedTrainableRows:
    """The `TrainableRows` interface over a `ShardedStore` (`lookup`, `collect`, `apply`, `settle`,
    `discard`, `row_meta`). `lookup`, `apply` and `row_meta` are collectives: every rank calls them."""

    device_tier = None  # the owners' rows stay on the host

    def __init__(self, store: ShardedStore, optimizer: RowOptimizer, *, max_grad_norm: float | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 stochastic_rounding: bool | None = None) -> None:
        self.store = store
        self.optimizer = optimizer
        # the owner's optimizer: checks the shard's fields, clips the summed rows, writes records;
        # it also renorms the rows it serves (max_norm) and rounds 16-bit rows stochastically
        self.local = TrainableRows(store.local, optimizer, max_grad_norm=max_grad_norm, max_norm=max_norm,
                                   norm_type=norm_type, stochastic_rounding=stochastic_rounding)
        self.max_norm = max_norm
        self._leaves: list[tuple[Tensor, Tensor]] = []
        self._copies: list[Any] = []  # CUDA events behind gradient copies to the host
        self._grads = RowGradBuffer()
        self._lock = threading.Lock()  # apply (training thread) vs settle (a flush thread)
        self._in_flight: tuple[Any, Any, int, float | None] | None = None
        store.before_exchange = self.finish

    def lookup(self, ids: Any, device: torch.device | str | None = None, device_ids: Tensor | None = None) -> Tensor:
        """Rows of global `ids` on `device`, a leaf with ``requires_grad=True`` when grad is enabled.
        (`device_ids`, the same ids on the GPU, serve a device tier; sharded rows come from the host.)"""
        ahead = self.store.ahead
        try:
            route = ahead.take(torch.as_tensor(ids).detach().cpu())  # announced: exchanged ahead
        finally:
            ahead.release()  # host rows: nothing to protect
        if route is None:
            idx, _, route = self.store.route(ids)
        else:
            idx = torch.as_tensor(ids).detach().to("cpu", torch.int64).reshape(-1)
            route.group = self.store.group  # the rows travel on the store's group, in program order
            self.finish()  # as the store's route does first: gradient rows in flight reach the rows
        with self.store._clock:
            served = self.store.local.get(route.served) if len(route.served) else torch.empty(
                (0, self.store.dim), dtype=self.store.dtype)
            if self.max_norm is not None and torch.is_grad_enabled() and len(route.served):
                # the owner renorms the rows it serves in its shard, as nn.Embedding(max_norm) does
                # in its table at lookup: no extra exchange
                served = self.local._renorm_in_store(route.served, served)
            rows = route.fetch(served)
            self.store._clock.bytes_sent += route.bytes_sent
        if device is not None and torch.device(device).type != "cpu":
            rows = rows.pin_memory().to(device, non_blocking=True)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._leaves.append((idx, rows))
        return rows

    def collect(self) -> int:
        """Keep this micro-batch's gradient rows (by global id); no communication."""
        taken = 0
        for idx, leaf in self._leaves:
            g = leaf.grad
            if g is None:
                continue
            if g.is_cuda:
                host = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                host.copy_(g, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._copies.append(event)
                g = host
            self._grads.add(idx, g)
            taken += idx.numel()
        self._leaves.clear()
        return taken

    def apply(self, step: int, lr: float | None = None, *, grad_scale: float | None = None) -> None:
        """Send the collected gradient rows to their owners, who update them before the store's next
        exchange or flush. Every rank calls it at the same steps, also with nothing collected."""
        self.finish()
        self.collect()
        for event in self._copies:
            event.synchronize()  # the gradient copies only, not later queued work
        self._copies.clear()
        if len(self._grads):
            ids, grads = self._grads.pop()
        else:
            ids, grads = torch.empty(0, dtype=torch.int64), torch.empty((0, self.store.dim), dtype=torch.float32)
        grads = grads.float() / (self.store.world_size * (grad_scale or 1.0))
        if grad_scale is not None:  # mixed precision: rows whose gradient overflowed sit this step out
            ok = torch.isfinite(grads).all(dim=1)
            if not bool(ok.all()):
                ids, grads = ids[ok], grads[ok]
        _, _, route = self.store.route(ids, deliver=True, unique=True)
        with self.store._clock:
            received = route.push(grads, wait=False)  # ids are unique and ascending: the route's order
        with self._lock:
            self._in_flight = (route, received, int(step), lr)

    def finish(self) -> int:
        """Wait for gradient rows in flight and update the rows this rank owns; returns how many."""
        with self._lock:
            if self._in_flight is None:
                return 0
            route, received, step, lr = self._in_flight
            self._in_flight = None
            with self.store._clock:
                got = received()
                self.store._clock.bytes_sent += route.bytes_sent
            if not len(route.served):
                return 0
            self.local._grads.add(route.served, got)
            self.local.apply(step, lr)
            return self.local.settle()

    def held_slots(self) -> None:
        return None

    def write_down(self) -> int:
        return 0

    def settle(self) -> int:
        """Update the rows with gradient rows still in flight (before a flush or a read)."""
        return self.finish()

    def discard(self) -> None:
        """Drop collected gradients (e.g. a skipped step)."""
        self._leaves.clear()
        self._copies.clear()
        self._grads.clear()

    def row_meta(self, ids: Any) -> dict[str, Tensor]:
        """`{"last_step": int32[len(ids)], "updates": int32[len(ids)]}` from the rows' owners."""
        got = self.store.get_fields(ids, ("last_step", "updates"))
        return {k: v[:, 0] for k, v in got.items()}
