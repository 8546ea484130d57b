"""Exponential moving average for rows written directly (memory banks, pseudo-labels)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_embcache.optim._checks import check_bool, check_number
from lightning_embcache.store.errors import InvalidArgumentError


@torch.no_grad()
def ema_update(old: Tensor, new: Tensor, momentum: float, *, normalize: bool = False) -> Tensor:
    """Return `momentum * old + (1 - momentum) * new`, in `old`'s dtype; `old` is not modified.

    `momentum` is the weight kept on the old value (MoCo/instance-discrimination convention:
    0.5 for a memory bank, 0.99-0.999 for slowly moving targets; 0 writes `new`, 1 keeps `old`).
    Computed in float32 for float16/bfloat16 rows. With `normalize=True` each result row is
    scaled to unit 2-norm, as memory banks of normalized features do.

    Example::

        rows = store.get(ids)
        store.update(ids, ema_update(rows, features.detach().cpu(), momentum=0.5, normalize=True))

    Note: with duplicate ids in `ids`, `store.update` keeps the last; coalesce or deduplicate first
    if each occurrence should count.
    """
    momentum = check_number("momentum", momentum, ge=0.0, le=1.0)
    check_bool("normalize", normalize)
    if old.shape != new.shape:
        raise InvalidArgumentError(f"new must have old's shape {tuple(old.shape)}; got {tuple(new.shape)}")
    compute = torch.float64 if old.dtype == torch.float64 else torch.float32
    out = torch.lerp(new.to(old.device, compute), old.to(compute), momentum)
    if normalize:
        out = torch.nn.functional.normalize(out, dim=-1)
    return out.to(old.dtype)
