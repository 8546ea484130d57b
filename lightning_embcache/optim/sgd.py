"""Lazy SGD with momentum: only the rows in the batch move, and only their buffers decay."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_embcache.optim._checks import check_bool, check_number
from lightning_embcache.optim.base import STEP_FIELD, RowOptimizer, StateFields
from lightning_embcache.store.errors import InvalidArgumentError


class SGD(RowOptimizer):
    """Row-wise SGD with optional momentum, dampening, Nesterov and L2 weight decay.

    Per touched row, with the arithmetic of `torch.optim.SGD`::

        g = grad + weight_decay * w
        buf = momentum * buf + (1 - dampening) * g        # if momentum > 0
        g = g + momentum * buf if nesterov else buf
        w = w - lr * g

    Notes:
        * Lazy: rows absent from the batch are not touched, so their momentum buffer neither
          decays nor keeps moving them. Dense SGD with momentum (and `torch.optim.SGD` on a sparse
          `nn.Embedding` gradient, whose sparse buffer accumulates every row it has seen) keeps
          applying `lr * buf` to every row with a buffer at every step. With momentum 0 the two are
          identical; with momentum > 0 they agree exactly for rows present in every batch.
        * The buffer starts at zero. `torch.optim.SGD` instead sets the buffer to the first
          gradient; this is the same unless `dampening > 0`. With `per_row_step=True` each row's
          first update sets its buffer to its gradient, as torch does on its first step.
        * Weight decay is applied to touched rows only (torch refuses `weight_decay` with sparse
          gradients).

    Args:
        lr: learning rate, >= 0.
        momentum: in [0, 1).
        dampening: in [0, 1].
        nesterov: Nesterov momentum; needs momentum > 0 and dampening = 0.
        weight_decay: L2 penalty added to the gradient of touched rows, >= 0.
        per_row_step: keep an int32 `"step"` count per row.
    """

    name = "sgd"

    def __init__(self, *, lr: float = 1e-2, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0, per_row_step: bool = False) -> None:
        super().__init__(lr=lr, per_row_step=per_row_step)
        self.momentum = check_number("momentum", momentum, ge=0.0, lt=1.0)
        self.dampening = check_number("dampening", dampening, ge=0.0, le=1.0)
        self.nesterov = check_bool("nesterov", nesterov)
        self.weight_decay = check_number("weight_decay", weight_decay, ge=0.0)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgumentError(
                f"nesterov=True needs momentum > 0 and dampening = 0; got momentum={self.momentum:g}, "
                f"dampening={self.dampening:g}")

    def _state_columns(self, dim: int, dtype: torch.dtype) -> StateFields:
        return {"momentum_buffer": (dtype, dim)} if self.momentum else {}

    def _hparams(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "dampening": self.dampening, "nesterov": self.nesterov,
                "weight_decay": self.weight_decay}

    def _update(self, w: Tensor, state: dict[str, Tensor], g: Tensor, *,
                step: int | Tensor, lr: float) -> None:
        if self.weight_decay:
            g = g.add(w, alpha=self.weight_decay)
        if self.momentum:
            buf = state["momentum_buffer"]
            buf.mul_(self.momentum).add_(g, alpha=1.0 - self.dampening)
            if self.dampening and self.per_row_step:
                first = state[STEP_FIELD] == 1
                buf.copy_(torch.where(first, g, buf))
            g = g.add(buf, alpha=self.momentum) if self.nesterov else buf
        w.add_(g, alpha=-lr)
