"""Argument checks at the public boundary: one cheap pass, clear messages, nothing changed on error."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError, InvalidTypeError


def as_ids(ids: Any, num_rows: int, arg: str = "ids") -> np.ndarray:
    """``ids`` as a 1-D int64 numpy array (zero-copy for CPU int64 tensors), bounds-checked."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InvalidTypeError(f"{arg} must be an integer tensor; got dtype {ids.dtype}")
        if ids.device.type != "cpu":
            ids = ids.cpu()  # the store is host-side; the Lightning layer keeps ids on the host
        if ids.dim() != 1:
            raise InvalidArgumentError(f"{arg} must be 1-D; got shape {tuple(ids.shape)}")
        arr = ids.numpy() if ids.dtype == torch.int64 else ids.to(torch.int64).numpy()
    else:
        arr = np.asarray(ids)
        if arr.dtype == object or arr.dtype.kind not in "iu":
            if arr.size == 0 and arr.dtype.kind == "f":
                arr = arr.astype(np.int64)
            else:
                raise InvalidTypeError(f"{arg} must hold integers; got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise InvalidArgumentError(f"{arg} must be 1-D; got shape {arr.shape}")
        arr = arr.astype(np.int64, copy=False)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            pos = int(np.flatnonzero(arr == bad)[0])
            raise InvalidArgumentError(
                f"{arg} must be in [0, {num_rows}); got {'min' if bad < 0 else 'max'} id {bad} (batch position {pos})"
            )
    return arr


def as_values(
    values: Any, n: int, cols: int, dtype: torch.dtype, *, arg: str, check_finite: bool
) -> torch.Tensor:
    """``values`` as a contiguous CPU (n, cols) tensor of ``dtype``."""
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(np.asarray(values))
        except (TypeError, ValueError) as exc:
            raise InvalidTypeError(f"{arg} must be a tensor or array of numbers; got {type(values).__name__}") from exc
    if values.dtype.is_complex or values.dtype == torch.bool:
        raise InvalidTypeError(f"{arg} has dtype {values.dtype}, which cannot be cast to the store dtype {dtype}")
    if tuple(values.shape) != (n, cols):
        raise InvalidArgumentError(f"{arg} must have shape ({n}, {cols}) to match ids; got {tuple(values.shape)}")
    if values.device.type != "cpu":
        values = values.detach().to("cpu", non_blocking=False)
    values = values.detach()
    if check_finite and values.dtype.is_floating_point and n:
        if not bool(torch.isfinite(values).all()):
            bad = int((~torch.isfinite(values)).any(dim=1).nonzero()[0, 0])
            raise InvalidArgumentError(
                f"{arg} must be finite (check_finite=True); row {bad} holds NaN or Inf"
            )
    if dtype.is_floating_point is False and values.dtype.is_floating_point:
        raise InvalidTypeError(f"{arg} has floating dtype {values.dtype}; this field holds {dtype}")
    return values.to(dtype).contiguous()


def positive_int(value: Any, arg: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{arg} must be an int; got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{arg} must be >= {minimum}; got {value}")
    return int(value)


def budget(value: Any, arg: str, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        allowed = "None or an int >= 0" if allow_none else "an int >= 0"
        raise InvalidArgumentError(f"{arg} must be {allowed} (bytes); got {value!r}")
    return int(value)
