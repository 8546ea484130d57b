"""`make_row_optimizer`: build a row optimizer from a name and keyword arguments."""

from __future__ import annotations

import inspect
from typing import Any

from lightning_embcache.optim.adagrad import Adagrad, RowWiseAdagrad
from lightning_embcache.optim.adam import Adam, AdamW
from lightning_embcache.optim.base import RowOptimizer
from lightning_embcache.optim.sgd import SGD
from lightning_embcache.store.errors import InvalidArgumentError, InvalidTypeError

#: optimizer name -> class
OPTIMIZERS: dict[str, type[RowOptimizer]] = {
    cls.name: cls for cls in (SGD, Adagrad, RowWiseAdagrad, Adam, AdamW)
}


def make_row_optimizer(name: str, **kwargs: Any) -> RowOptimizer:
    """Return the row optimizer `name` ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw").

    Keyword arguments are the optimizer's (`lr`, `momentum`, `betas`, `eps`, `weight_decay`, ...,
    and `per_row_step`); each is checked and an error names the argument, its value and its range.

    Raises:
        InvalidArgumentError: unknown name or argument, or a value out of range.
        InvalidTypeError: `name` is not a string, or a value of the wrong type.
    """
    if not isinstance(name, str):
        raise InvalidTypeError(f"optimizer must be a str, one of {sorted(OPTIMIZERS)}; got {name!r}")
    cls = OPTIMIZERS.get(name.lower())
    if cls is None:
        raise InvalidArgumentError(f"optimizer must be one of {sorted(OPTIMIZERS)}; got {name!r}")
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise InvalidArgumentError(
            f"unknown argument {unknown[0]!r} for optimizer {cls.name!r}; allowed: {allowed}")
    return cls(**kwargs)
