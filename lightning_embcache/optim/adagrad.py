"""Adagrad, element-wise (as `torch.optim.Adagrad` on sparse gradients) and row-wise (FBGEMM/TorchRec)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_embcache.optim._checks import check_number
from lightning_embcache.optim.base import RowOptimizer, StateFields


class Adagrad(RowOptimizer):
    """Element-wise Adagrad, the update `torch.optim.Adagrad` makes for a sparse gradient.

    Per touched row::

        g = grad + weight_decay * w
        sum += g * g
        clr = lr / (1 + (step - 1) * lr_decay)
        w -= clr * g / (sqrt(sum + initial_accumulator_value) + eps)

    Notes:
        * Already lazy in torch: with sparse gradients torch updates only the rows present. The state
          column `"sum"` holds the sum of squares *without* `initial_accumulator_value` (so it starts
          at zero); torch's `state_sum` equals `sum + initial_accumulator_value`.
        * `step` is the global step (torch counts one per parameter); with `per_row_step=True` the
          lr decay uses each row's own update count.
        * `weight_decay` is added to touched rows' gradients only; torch refuses weight decay with
          sparse gradients.

    Args:
        lr: >= 0. lr_decay: >= 0. weight_decay: >= 0. initial_accumulator_value: >= 0. eps: >= 0.
    """

    name = "adagrad"

    def __init__(self, *, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10,
                 per_row_step: bool = False) -> None:
        super().__init__(lr=lr, per_row_step=per_row_step)
        self.lr_decay = check_number("lr_decay", lr_decay, ge=0.0)
        self.weight_decay = check_number("weight_decay", weight_decay, ge=0.0)
        self.initial_accumulator_value = check_number(
            "initial_accumulator_value", initial_accumulator_value, ge=0.0)
        self.eps = check_number("eps", eps, ge=0.0)

    def _state_columns(self, dim: int, dtype: torch.dtype) -> StateFields:
        return {"sum": (dtype, self._columns(dim))}

    def _columns(self, dim: int) -> int:
        return dim

    def _hparams(self) -> dict[str, Any]:
        return {"lr_decay": self.lr_decay, "weight_decay": self.weight_decay,
                "initial_accumulator_value": self.initial_accumulator_value, "eps": self.eps}

    def _accumulate(self, acc: Tensor, g: Tensor) -> None:
        acc.addcmul_(g, g)

    def _update(self, w: Tensor, state: dict[str, Tensor], g: Tensor, *,
                step: int | Tensor, lr: float) -> None:
        if self.weight_decay:
            g = g.add(w, alpha=self.weight_decay)
        acc = state["sum"]
        self._accumulate(acc, g)
        std = acc.add(self.initial_accumulator_value) if self.initial_accumulator_value else acc.clone()
        std.sqrt_().add_(self.eps)
        if isinstance(step, Tensor):
            clr = lr / (1.0 + (step - 1.0) * self.lr_decay)          # Tensor[B, 1]
            w.sub_(g.div(std).mul_(clr))
        else:
            decayed = lr / (1.0 + (step - 1) * self.lr_decay)
            w.addcdiv_(g, std, value=-decayed)


class RowWiseAdagrad(Adagrad):
    """Row-wise Adagrad: one accumulator per row, fed the mean squared gradient of the row.

    Per touched row (FBGEMM's `rowwise_adagrad`, TorchRec's `EXACT_ROWWISE_ADAGRAD`)::

        g = grad + weight_decay * w
        sum += mean(g * g)                                   # one float per row
        w -= clr * g / (sqrt(sum + initial_accumulator_value) + eps)

    State is one column instead of `dim`, which is why large recommendation tables use it.
    Arguments as `Adagrad`; `eps` defaults to 1e-8 as in FBGEMM.
    """

    name = "rowwise_adagrad"

    def __init__(self, *, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-8,
                 per_row_step: bool = False) -> None:
        super().__init__(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                         initial_accumulator_value=initial_accumulator_value, eps=eps,
                         per_row_step=per_row_step)

    def _columns(self, dim: int) -> int:
        return 1

    def _accumulate(self, acc: Tensor, g: Tensor) -> None:
        acc.add_(g.square().mean(dim=1, keepdim=True))
