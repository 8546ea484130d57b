"""TrainableRows: rows of an EmbeddingStore trained by gradient, optimizer state stored beside them.

`lookup(ids)` returns rows as a leaf tensor that joins autograd; after backward, `collect()` takes
its gradient rows (summing ids repeated within and across micro-batches); `apply(step)` runs the
sparse row-wise optimizer on exactly those rows and writes weights, moments and per-row metadata
back in one `update_fields` call. Because the whole record is written at once, a flush can never
hold a row from one step and its moments from another.

No Lightning imports: the mixin drives this from its hooks; a plain training loop can too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_embcache.optim.base import RowOptimizer
from lightning_embcache.optim.clip import clip_rows_by_norm_
from lightning_embcache.optim.coalesce import RowGradBuffer
from lightning_embcache.store import EmbeddingStore, InvalidArgumentError
from lightning_embcache.store.validate import as_ids

#: per-row metadata kept by trainable stores: the step a row was last updated at, and how often.
META_FIELDS: dict[str, tuple[torch.dtype, int]] = {"last_step": (torch.int32, 1), "updates": (torch.int32, 1)}


def trainable_fields(optimizer: RowOptimizer, dim: int, dtype: torch.dtype) -> dict[str, tuple[torch.dtype, int]]:
    """The `fields=` a store needs so `optimizer` can keep its state beside each row."""
    return {**optimizer.state_fields(dim, dtype), **META_FIELDS}


class TrainableRows:
    """Train the rows of `store` with `optimizer`; state lives in the store's per-row fields.

    Example::

        opt = make_row_optimizer("adam", lr=1e-3)
        store = EmbeddingStore.create(path, N, 64, fields=trainable_fields(opt, 64, torch.float32))
        rows = TrainableRows(store, opt)
        z = rows.lookup(ids)               # requires_grad leaf
        loss(z).backward()
        rows.collect()                     # after every backward (gradient accumulation sums)
        rows.apply(step=global_step + 1)   # at the optimizer step

    Notes:
        * On CUDA the gradient rows are copied to pinned host memory without waiting; `apply` only
          records the step, and the update runs at the next `lookup`/`get`/`settle()` (by then the
          copy has normally finished), so the training step never waits for the host update.
        * `max_grad_norm` clips each row's summed gradient (per-row clipping); Lightning's
          `gradient_clip_val` covers only `model.parameters()`, which never include these rows.
    """

    def __init__(self, store: EmbeddingStore, optimizer: RowOptimizer, *, max_grad_norm: float | None = None) -> None:
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
        self.store = store
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self._state_names = tuple(optimizer.state_fields(store.dim, store.dtype))
        self._leaves: list[tuple[Tensor, Tensor]] = []
        self._grads = RowGradBuffer()
        self._pending: tuple[int, float | None, torch.cuda.Event | None] | None = None

    # ---- forward -------------------------------------------------------------------------------
    def lookup(self, ids: Any, device: torch.device | str | None = None) -> Tensor:
        """Rows of `ids` on `device` as a leaf with `requires_grad=True` (when grad is enabled)."""
        self.settle()
        idx = torch.from_numpy(as_ids(ids, self.store.num_rows).copy())
        rows = self.store.get(idx)
        if device is not None and torch.device(device).type != "cpu":
            rows = rows.pin_memory().to(device, non_blocking=True)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._leaves.append((idx, rows))
        return rows

    # ---- backward ------------------------------------------------------------------------------
    def collect(self) -> int:
        """Move the gradients of this micro-batch's lookups into the buffer; returns rows taken."""
        taken = 0
        for idx, leaf in self._leaves:
            g = leaf.grad
            if g is None:
                continue
            if g.is_cuda:
                host = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                host.copy_(g, non_blocking=True)
                g = host
            self._grads.add(idx, g)
            taken += idx.numel()
        self._leaves.clear()
        return taken

    def apply(self, step: int, lr: float | None = None) -> None:
        """Schedule the optimizer step for the collected rows (runs at the next settle point)."""
        self.collect()
        if not len(self._grads):
            return
        if self._pending is not None:
            self.settle()
        event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record()
        self._pending = (int(step), lr, event)
        if event is None:
            self.settle()

    def settle(self) -> int:
        """Run a scheduled optimizer step now; returns the number of rows updated."""
        if self._pending is None:
            return 0
        step, lr, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()  # waits for the gradient copy only, not for later queued work
        ids, grads = self._grads.pop()
        if self.max_grad_norm is not None:
            clip_rows_by_norm_(grads, self.max_grad_norm)
        names = ("weight", *self._state_names, "last_step", "updates")
        rec = self.store.get_fields(ids, names)
        state = {n: rec[n] for n in self._state_names}
        self.optimizer.step(rec["weight"], state, grads, step=step, lr=lr)
        rec["last_step"].fill_(step)
        rec["updates"].add_(1)
        self.store.update_fields(ids, rec)
        return int(ids.numel())

    def discard(self) -> None:
        """Drop collected gradients and a scheduled step (e.g. a skipped step with inf loss)."""
        self._leaves.clear()
        self._pending = None
        if len(self._grads):
            self._grads.pop()

    # ---- metadata ------------------------------------------------------------------------------
    def row_meta(self, ids: Any) -> dict[str, Tensor]:
        """`{"last_step": int32[len(ids)], "updates": int32[len(ids)]}` for staleness-aware losses."""
        self.settle()
        got = self.store.get_fields(ids, ("last_step", "updates"))
        return {k: v[:, 0] for k, v in got.items()}
