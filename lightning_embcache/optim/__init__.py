"""Sparse row-wise optimizers: update only the rows in a batch, with per-row state beside each row.

Independent of the store: everything here works on plain tensors. See docs/optimizers.md.
"""

from lightning_embcache.optim.adagrad import Adagrad, RowWiseAdagrad
from lightning_embcache.optim.adam import Adam, AdamW
from lightning_embcache.optim.base import RowOptimizer, StateFields
from lightning_embcache.optim.clip import (
    clip_grad_norm_with_rows_,
    clip_rows_by_norm_,
    clip_rows_by_value_,
    rows_grad_norm,
)
from lightning_embcache.optim.coalesce import RowGradBuffer, coalesce
from lightning_embcache.optim.ema import ema_update
from lightning_embcache.optim.factory import OPTIMIZERS, make_row_optimizer
from lightning_embcache.optim.sgd import SGD
from lightning_embcache.optim.table import empty_hugepage, step_rows

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "RowGradBuffer",
    "RowOptimizer",
    "RowWiseAdagrad",
    "StateFields",
    "clip_grad_norm_with_rows_",
    "clip_rows_by_norm_",
    "clip_rows_by_value_",
    "coalesce",
    "ema_update",
    "empty_hugepage",
    "make_row_optimizer",
    "rows_grad_norm",
    "step_rows",
]
