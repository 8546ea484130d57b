"""Adam with lazy per-row moments (the semantics of `torch.optim.SparseAdam`) and AdamW."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_embcache.optim._checks import check_betas, check_number
from lightning_embcache.optim.base import RowOptimizer, StateFields


class Adam(RowOptimizer):
    """Lazy Adam: the update `torch.optim.SparseAdam` makes, row by row.

    Per touched row::

        g = grad + weight_decay * w                         # L2 (coupled) decay, default 0
        m += (1 - beta1) * (g - m)
        v += (1 - beta2) * (g * g - v)
        w -= lr * sqrt(1 - beta2**step) / (1 - beta1**step) * m / (sqrt(v) + eps)

    Notes:
        * Lazy: moments of rows not in the batch are not decayed (dense Adam decays every moment at
          every step). The bias correction uses the *global* step, as SparseAdam's single step count
          per parameter does; `eps` is added to `sqrt(v)` before bias correction, as SparseAdam does
          (dense `torch.optim.Adam` adds it after). With `per_row_step=True` each row's own update
          count is used instead (the "LazyAdam with per-row step" variant), which keeps the bias
          correction right for rarely seen rows.
        * `weight_decay` is not in SparseAdam; here it adds `weight_decay * w` to touched rows'
          gradients. Prefer `AdamW`.

    Args:
        lr: >= 0. betas: each in [0, 1). eps: >= 0. weight_decay: >= 0.
    """

    name = "adam"
    _decoupled = False

    def __init__(self, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, per_row_step: bool = False) -> None:
        super().__init__(lr=lr, per_row_step=per_row_step)
        self.betas = check_betas(betas)
        self.eps = check_number("eps", eps, ge=0.0)
        self.weight_decay = check_number("weight_decay", weight_decay, ge=0.0)

    def _state_columns(self, dim: int, dtype: torch.dtype) -> StateFields:
        return {"exp_avg": (dtype, dim), "exp_avg_sq": (dtype, dim)}

    def _hparams(self) -> dict[str, Any]:
        return {"betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}

    def _update(self, w: Tensor, state: dict[str, Tensor], g: Tensor, *,
                step: int | Tensor, lr: float) -> None:
        beta1, beta2 = self.betas
        if self.weight_decay:
            if self._decoupled:
                w.mul_(1.0 - lr * self.weight_decay)
            else:
                g = g.add(w, alpha=self.weight_decay)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1.0 - beta1)                     # m + (1 - beta1) * (g - m)
        v.lerp_(g.square(), 1.0 - beta2)
        denom = v.sqrt().add_(self.eps)
        if isinstance(step, Tensor):                # per-row counts, Tensor[B, 1]
            step_size = lr * torch.sqrt(1.0 - torch.pow(beta2, step)) / (1.0 - torch.pow(beta1, step))
            w.sub_(m.div(denom).mul_(step_size))
        else:
            size = lr * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
            w.addcdiv_(m, denom, value=-size)


class AdamW(Adam):
    """Lazy Adam with decoupled weight decay (`w *= 1 - lr * weight_decay`) on touched rows only.

    The decay is applied before the Adam update, as `torch.optim.AdamW` does; rows absent from the
    batch do not decay (dense AdamW decays every row at every step). Moments and bias correction as
    `Adam`. `weight_decay` defaults to 1e-2 as in torch.
    """

    name = "adamw"
    _decoupled = True

    def __init__(self, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, per_row_step: bool = False) -> None:
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         per_row_step=per_row_step)
