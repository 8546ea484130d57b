"""TrainableRows: rows of an EmbeddingStore trained by gradient, optimizer state stored beside them.

`lookup(ids)` returns rows as a leaf tensor that joins autograd; after backward, `collect()` takes
its gradient rows (summing ids repeated within and across micro-batches); `apply(step)` runs the
sparse row-wise optimizer on exactly those rows and writes weights, moments and per-row metadata
back in one `update_fields` call. Because the whole record is written at once, a flush can never
hold a row from one step and its moments from another.

With a `DeviceTier` (rows and their optimizer state in GPU memory) the whole step stays on the
device: `lookup` gathers there, `apply` runs the fused row-wise kernel in place, and the host only
decides which slot holds which id. Without one, rows and their state stay in host RAM and travel
through reused pinned buffers.

No Lightning imports: the mixin drives this from its hooks; a plain training loop can too.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_embcache.device_tier import DeviceTier
from lightning_embcache.optim.base import RowOptimizer
from lightning_embcache.optim.clip import check_max_norm, clip_rows_by_norm_, renorm_rows
from lightning_embcache.optim.coalesce import RowGradBuffer
from lightning_embcache.optim.fused import fused_adam_step_rows
from lightning_embcache.optim.rounding import ROUNDED_DTYPES
from lightning_embcache.pinned import PinnedRing, pinned_empty
from lightning_embcache.store import EmbeddingStore, InvalidArgumentError, OutOfMemoryError
from lightning_embcache.store.validate import as_ids

#: per-row metadata kept by trainable stores: the step a row was last updated at, and how often.
META_FIELDS: dict[str, tuple[torch.dtype, int]] = {"last_step": (torch.int32, 1), "updates": (torch.int32, 1)}


def _translate_device_oom(method: Any) -> Any:
    """A GPU allocation that fails inside a training call raises the store's `OutOfMemoryError`
    naming the device tier's budget (never a raw CUDA error); the rows are as they were."""

    @functools.wraps(method)
    def call(self: TrainableRows, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except torch.cuda.OutOfMemoryError as exc:
            tier = self.device_tier
            if tier is not None:
                raise tier._out_of_memory(exc) from None
            raise OutOfMemoryError(
                f"the GPU ran out of memory in a row update ({str(exc).splitlines()[0] if str(exc) else exc!r}): "
                "lower the batch size or leave the model more room") from None

    return call


def trainable_fields(optimizer: RowOptimizer, dim: int, dtype: torch.dtype) -> dict[str, tuple[torch.dtype, int]]:
    """The `fields=` a store needs so `optimizer` can keep its state beside each row."""
    return {**optimizer.state_fields(dim, dtype), **META_FIELDS}


class TrainableRows:
    """Train the rows of `store` with `optimizer`; state lives in the store's per-row fields.

    Example::

        opt = make_row_optimizer("adam", lr=1e-3)
        store = EmbeddingStore.create(path, N, 64, fields=trainable_fields(opt, 64, torch.float32))
        rows = TrainableRows(store, opt)   # device_tier=DeviceTier(store, "cuda", 8 << 30) on a GPU
        z = rows.lookup(ids)               # requires_grad leaf
        loss(z).backward()
        rows.collect()                     # after every backward (gradient accumulation sums)
        rows.apply(step=global_step + 1)   # at the optimizer step

    Notes:
        * With ``device_tier`` the rows live on its GPU: lookups, gradients and the update never
          leave the device, and nothing waits for it. Call `write_down()` (the Lightning handle's
          ``flush()`` does) before reading the rows through the store.
        * Without one, on CUDA the gradient rows are copied to pinned host memory without waiting;
          `apply` only records the step, and the update runs at the next `lookup`/`get`/`settle()`
          (by then the copy has normally finished), so the training step never waits for the host.
        * `max_grad_norm` clips each row's summed gradient (per-row clipping); Lightning's
          `gradient_clip_val` covers only `model.parameters()`, which never include these rows.
        * `max_norm` bounds the rows themselves, as ``nn.Embedding(max_norm=...)`` does: `lookup`
          first rescales, in the store, every looked-up row whose `norm_type`-norm exceeds it (by
          ``max_norm / (norm + 1e-7)``), then returns the rows.
        * `stochastic_rounding` (16-bit rows; None: on for bfloat16/float16 rows): the optimizer
          computes in float32 and writes the rows back with unbiased stochastic rounding, keyed
          by ``(seed, step, id)`` (`seed`: the store's), so small updates still move them.

    Raises:
        InvalidArgumentError: ``max_norm <= 0``, a ``norm_type`` that is not > 0,
            ``stochastic_rounding=True`` on 32/64-bit rows, a store without the optimizer's fields.
    """

    def __init__(self, store: EmbeddingStore, optimizer: RowOptimizer, *, max_grad_norm: float | None = None,
                 device_tier: DeviceTier | None = None, max_norm: float | None = None,
                 norm_type: float = 2.0, stochastic_rounding: bool | None = None) -> None:
        if not isinstance(optimizer, RowOptimizer):
            raise InvalidArgumentError(f"optimizer must be a RowOptimizer (make_row_optimizer(...)); got {optimizer!r}")
        need = trainable_fields(optimizer, store.dim, store.dtype)
        missing = [n for n, spec in need.items() if n not in store.field_names or store.field_spec(n) != spec]
        if missing:
            raise InvalidArgumentError(
                f"store at {store.path} lacks the per-row fields {missing} that {type(optimizer).__name__} needs; "
                f"create it with fields=trainable_fields(optimizer, dim, dtype)"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InvalidArgumentError(f"max_grad_norm must be None or > 0; got {max_grad_norm!r}")
        if device_tier is not None and device_tier.store is not store:
            raise InvalidArgumentError("device_tier must hold the rows of this store (DeviceTier(store, ...))")
        self.max_norm, self.norm_type = check_max_norm(max_norm, norm_type)
        self.stochastic_rounding = check_stochastic_rounding(stochastic_rounding, store.dtype)
        self._rounding_seed = int(getattr(store, "_seed", 0))
        self.store = store
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.device_tier = device_tier
        self._state_names = tuple(optimizer.state_fields(store.dim, store.dtype))
        self._leaves: list[tuple[Tensor, Tensor]] = []
        self._grads = RowGradBuffer()
        self._pending: tuple[int, float | None, torch.cuda.Event | None] | None = None
        # host path on CUDA: reused pinned buffers for rows going up and gradients coming down
        self._up_ring: PinnedRing | None = None
        self._grad_bufs: list[Tensor] = []  # one per micro-batch of a step, reused every step
        self._grad_k = 0
        self._pending_scale: float | None = None
        # the host path's update may run on a flush thread (the handle settles before flushing)
        # while the training thread collects or looks up: one at a time
        self._host_lock = threading.RLock()
        # device path: per lookup (host slots per position, device slots, leaf)
        self._dev_leaves: list[tuple[np.ndarray, Tensor, Tensor]] = []
        self._dev_grads: list[tuple[np.ndarray, Tensor, Tensor]] = []
        self._dev_ids: list[np.ndarray] = []  # the ids of _dev_leaves then _dev_grads (rounding keys)
        self._dev_grad_ids: list[np.ndarray] = []

    # ---- forward -------------------------------------------------------------------------------
    @_translate_device_oom
    def lookup(self, ids: Any, device: torch.device | str | None = None, *,
               device_ids: Tensor | None = None) -> Tensor:
        """Rows of `ids` as a leaf with `requires_grad=True` (when grad is enabled).

        On the device tier's GPU with a tier; else on `device` (default: the host).
        ``device_ids``: the same ids already on the tier's GPU (e.g. the batch Lightning moved
        there); a tier holding the whole table then gathers with them instead of copying `ids` up.
        """
        if self.device_tier is not None:
            return self._lookup_on_device(as_ids(ids, self.store.num_rows), device_ids)
        self.settle()
        idx = torch.from_numpy(as_ids(ids, self.store.num_rows))  # as_ids returns our own copy
        rows = self.store.get(idx)
        if self.max_norm is not None:
            rows = self._renorm_in_store(idx, rows)
        if device is not None and torch.device(device).type == "cuda":
            rows = self._to_cuda(rows, torch.device(device))
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._leaves.append((idx, rows))
        return rows

    def _renorm_in_store(self, idx: Tensor, rows: Tensor) -> Tensor:
        """Rows over `max_norm` rescaled, written back to the store (only those rows)."""
        assert self.max_norm is not None
        new, over = renorm_rows(rows, self.max_norm, self.norm_type)
        if bool(over.any()):  # host tensors: no device sync
            sel = over.nonzero().squeeze(1)
            with self._host_lock:
                # duplicates of an id carry equal rows, so whichever write wins is the same
                self.store.update_fields(idx[sel], {"weight": new[sel]})
        return new

    def _to_cuda(self, rows: Tensor, device: torch.device) -> Tensor:
        if self._up_ring is None:
            self._up_ring = PinnedRing()
        return self._up_ring.to_device(rows, device)

    def _lookup_on_device(self, idx: np.ndarray, device_ids: Tensor | None) -> Tensor:
        tier = self.device_tier
        assert tier is not None
        if tier.resident:  # slot == id (idx is as_ids' own copy: the caller may refill its ids)
            tier.ready(idx)
            pos = idx
            same = (device_ids is not None and device_ids.device == tier.device and device_ids.dim() == 1
                    and device_ids.dtype == torch.int64 and device_ids.numel() == len(idx))
            pos_d = device_ids if same and device_ids is not None else tier.to_device(pos)
        else:
            pos = self._device_slots(idx)
            pos_d = tier.device_positions(pos)
        weight = tier.view("weight")
        rows = weight.index_select(0, pos_d)
        if self.max_norm is not None:
            # On the device without waiting for it: every looked-up row is written back, scaled
            # or (under the limit) with its exact bits.
            rows, _ = renorm_rows(rows, self.max_norm, self.norm_type)
            with tier.writing(pos):
                weight.index_copy_(0, pos_d, rows)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._dev_leaves.append((pos, pos_d, rows))
            self._dev_ids.append(idx)
        return rows

    def _device_slots(self, idx: np.ndarray) -> np.ndarray:
        """Device slot of every position of validated ``idx``, rows brought up as needed."""
        assert self.device_tier is not None
        return self.device_tier.positions(idx, self.held_slots())

    def held_slots(self) -> np.ndarray | None:
        """Device slots of rows whose gradients are not applied yet: they must stay on the device."""
        held = [p for p, _, _ in self._dev_leaves] + [p for p, _, _ in self._dev_grads]
        return np.concatenate(held) if held else None

    def prefetch(self, ids: Any) -> None:
        """Bring rows `ids` to the device tier now (copies queued without waiting), so that the
        next `lookup` of them is a gather on the device. Without a tier: the store's prefetch."""
        if self.device_tier is None:
            self.store.prefetch(ids)
            return
        self.device_tier.prefetch(as_ids(ids, self.store.num_rows), self.held_slots())

    # ---- backward ------------------------------------------------------------------------------
    @_translate_device_oom
    def collect(self) -> int:
        """Move the gradients of this micro-batch's lookups into the buffer; returns rows taken."""
        taken = 0
        for (pos, pos_d, leaf), ids in zip(self._dev_leaves, self._dev_ids):
            if leaf.grad is not None:
                self._dev_grads.append((pos, pos_d, leaf.grad))
                self._dev_grad_ids.append(ids)
                taken += len(pos)
        self._dev_leaves.clear()
        self._dev_ids.clear()
        if not self._leaves:
            return taken
        with self._host_lock:
            for idx, leaf in self._leaves:
                g = leaf.grad
                if g is None:
                    continue
                if g.is_cuda:
                    g = self._grad_to_host(g)
                self._grads.add(idx, g)
                taken += idx.numel()
            self._leaves.clear()
        return taken

    def _grad_to_host(self, g: Tensor) -> Tensor:
        """Queue a copy of `g` into the step's next pinned buffer. `settle` consumes the buffers
        (after waiting for the step's event) before the next step's `collect` refills them."""
        k = self._grad_k
        self._grad_k += 1
        nbytes = g.numel() * g.element_size()
        if k == len(self._grad_bufs):
            self._grad_bufs.append(torch.empty(0, dtype=torch.uint8))
        if self._grad_bufs[k].numel() < nbytes:
            self._grad_bufs[k] = pinned_empty(nbytes * 5 // 4)
        host = self._grad_bufs[k][:nbytes].view(g.dtype).view(g.shape)
        host.copy_(g, non_blocking=True)
        return host

    @_translate_device_oom
    def apply(self, step: int, lr: float | None = None, *, grad_scale: float | None = None) -> None:
        """Run (device tier) or schedule (host: at the next settle point) the optimizer step.

        ``grad_scale``: the loss scale of mixed-precision training (a GradScaler's current scale):
        the gradient rows are divided by it, and a step whose rows' gradients are not finite is
        skipped, as the scaler skips the dense parameters' step.
        """
        self.collect()
        if self._dev_grads:
            self._apply_on_device(int(step), lr, grad_scale)
        with self._host_lock:
            if not len(self._grads):
                return
            if self._pending is not None:
                self.settle()
            event = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                event = torch.cuda.Event()
                event.record()
            self._pending = (int(step), lr, event)
            self._pending_scale = grad_scale
            if event is None:
                self.settle()

    def settle(self) -> int:
        """Run a scheduled optimizer step now; returns the number of rows updated. Thread-safe:
        a lookup on the training thread waits for an update a flush thread is running."""
        with self._host_lock:
            return self._settle_locked()

    def _settle_locked(self) -> int:
        if self._pending is None:
            return 0
        step, lr, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()  # waits for the gradient copy only, not for later queued work
        ids, grads = self._grads.pop()  # coalescing copies the rows out of the pinned buffers
        self._grad_k = 0
        scale, self._pending_scale = self._pending_scale, None
        if scale is not None:
            grads = grads / scale
            if not bool(torch.isfinite(grads).all()):  # host memory: no device sync
                return 0  # an overflow step: skipped, as the scaler skips the dense one
        if self.max_grad_norm is not None:
            clip_rows_by_norm_(grads, self.max_grad_norm)
        # One gather of whole records (weight, moments, metadata) and one scatter back: the update
        # costs what the batch's rows cost, whatever the table's size, and a row and its state are
        # always written together.
        store = self.store
        rec = store.read_records(ids)
        state = {n: store.record_view(rec, n) for n in self._state_names}
        self.optimizer.step(store.record_view(rec, "weight"), state, grads, step=step, lr=lr, ids=ids,
                            stochastic_rounding=self.stochastic_rounding, seed=self._rounding_seed)
        store.record_view(rec, "last_step").fill_(step)
        store.record_view(rec, "updates").add_(1)
        store.write_records(ids, rec)
        return int(ids.numel())

    def _apply_on_device(self, step: int, lr: float | None, grad_scale: float | None = None) -> None:
        """The step on the device tier, queued without waiting for the GPU."""
        tier = self.device_tier
        assert tier is not None
        parts, self._dev_grads = self._dev_grads, []
        part_ids, self._dev_grad_ids = self._dev_grad_ids, []
        pos = np.concatenate([p for p, _, _ in parts])
        pos_d = torch.cat([p for _, p, _ in parts]) if len(parts) > 1 else parts[0][1]
        grads = torch.cat([g for _, _, g in parts]) if len(parts) > 1 else parts[0][2]
        if grad_scale is not None:
            grads = grads.float() / grad_scale
            # Mixed precision with a loss scale only: the GradScaler waits for the GPU every step
            # to skip overflow steps anyway; the rows' step is skipped alike.
            if not bool(torch.isfinite(grads).all()):
                return
        lr_now = self.optimizer.lr if lr is None else lr
        weight = tier.view("weight")
        state = {n: tier.view(n) for n in self._state_names}
        keys_d = None  # 16-bit rows round stochastically keyed by id, not by slot
        if self.stochastic_rounding and self.max_grad_norm is None:
            keys_d = tier.to_device(np.concatenate(part_ids))
        meta = (tier.view("last_step"), tier.view("updates"))
        with tier.writing(pos):  # a background write_down sees the whole step or none of it
            done = self.max_grad_norm is None and fused_adam_step_rows(
                self.optimizer, weight, state, pos_d, grads, step=step, lr=lr_now,
                stochastic_rounding=self.stochastic_rounding, seed=self._rounding_seed, keys=keys_d, meta=meta)
            if done:  # the kernel counted the rows' updates itself
                return
            uniq, first, inv = np.unique(pos, return_index=True, return_inverse=True)
            u_d, inv_d = tier.to_device(uniq), tier.to_device(inv)
            g = torch.zeros((len(uniq), grads.shape[1]), dtype=torch.float32, device=grads.device)
            g.index_add_(0, inv_d, grads.float())
            if self.max_grad_norm is not None:
                clip_rows_by_norm_(g, self.max_grad_norm)
            w = weight.index_select(0, u_d)
            st = {n: v.index_select(0, u_d) for n, v in state.items()}
            keys = None
            if self.stochastic_rounding:  # the rounding is keyed by id, not by slot
                keys = tier.to_device(np.concatenate(part_ids)[first])
            self.optimizer.step(w, st, g, step=step, lr=lr, ids=keys,
                                stochastic_rounding=self.stochastic_rounding, seed=self._rounding_seed)
            weight.index_copy_(0, u_d, w)
            for n, v in state.items():
                v.index_copy_(0, u_d, st[n])
            # per-row metadata: duplicates write the same value, so each row counts one update
            tier.view("last_step").index_fill_(0, pos_d, step)
            updates = tier.view("updates")
            updates[pos_d] = updates.index_select(0, pos_d) + 1

    @_translate_device_oom
    def write_down(self) -> int:
        """Bring the device tier's updated rows into the store (before reading or flushing it)."""
        return self.device_tier.write_down() if self.device_tier is not None else 0

    def discard(self) -> None:
        """Drop collected gradients and a scheduled step (e.g. a skipped step with inf loss)."""
        with self._host_lock:
            self._leaves.clear()
            self._dev_leaves.clear()
            self._dev_grads.clear()
            self._dev_ids.clear()
            self._dev_grad_ids.clear()
            self._pending = None
            self._grad_k = 0
            if len(self._grads):
                self._grads.pop()

    # ---- metadata ------------------------------------------------------------------------------
    def row_meta(self, ids: Any) -> dict[str, Tensor]:
        """`{"last_step": int32[len(ids)], "updates": int32[len(ids)]}` for staleness-aware losses."""
        if self.device_tier is not None:
            tier = self.device_tier
            pos_d = tier.to_device(self._device_slots(as_ids(ids, self.store.num_rows)))
            return {k: tier.view(k).index_select(0, pos_d)[:, 0] for k in ("last_step", "updates")}
        self.settle()
        got = self.store.get_fields(ids, ("last_step", "updates"))
        return {k: v[:, 0] for k, v in got.items()}


def check_stochastic_rounding(value: bool | None, dtype: torch.dtype) -> bool:
    """``stochastic_rounding`` for rows of `dtype`: None means on for 16-bit rows, off otherwise."""
    if value is None:
        return dtype in ROUNDED_DTYPES
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"stochastic_rounding must be None, True or False; got {value!r}")
    if value and dtype not in ROUNDED_DTYPES:
        raise InvalidArgumentError(
            f"stochastic_rounding=True applies to bfloat16/float16 rows; these rows are {dtype}: "
            "pass stochastic_rounding=None or False (32-bit rows are written back exactly)")
    return value
