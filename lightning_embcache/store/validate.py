"""Argument checks at the public boundary: one cheap pass, clear messages, nothing changed on error."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError, InvalidTypeError


def as_ids(ids: Any, num_rows: int, arg: str = "ids") -> np.ndarray:
    """``ids`` as a 1-D int64 numpy array (zero-copy for CPU int64 tensors), bounds-checked."""
    if type(ids) is torch.Tensor and ids.dtype is torch.int64 and ids.dim() == 1 and ids.is_cpu:
        # the hot path: one pass. Seen as unsigned, a negative id is huge, so one max bounds both
        # ends (numpy has no fused min/max; two reductions cost twice this).
        arr = ids.numpy()
    elif isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InvalidTypeError(f"{arg} must be an integer tensor; got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise InvalidArgumentError(f"{arg} must be 1-D; got shape {tuple(ids.shape)}")
        arr = ids.detach().to("cpu", torch.int64).numpy()  # the store is host-side
    else:
        arr = np.asarray(ids)
        if arr.dtype == object or arr.dtype.kind not in "iu":
            if not (arr.size == 0 and arr.dtype.kind == "f"):
                raise InvalidTypeError(f"{arg} must hold integers; got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise InvalidArgumentError(f"{arg} must be 1-D; got shape {arr.shape}")
        arr = arr.astype(np.int64, copy=False)
    if arr.size and _UMAX(arr.view(np.uint64)) >= num_rows:
        _raise_out_of_range(arr, num_rows, arg)
    return arr


_UMAX = np.maximum.reduce


def _raise_out_of_range(arr: np.ndarray, num_rows: int, arg: str) -> None:
    lo, hi = int(arr.min()), int(arr.max())
    bad = lo if lo < 0 else hi
    pos = int(np.flatnonzero(arr == bad)[0])
    raise InvalidArgumentError(
        f"{arg} must be in [0, {num_rows}); got {'min' if bad < 0 else 'max'} id {bad} (batch position {pos})"
    )


def as_values(
    values: Any, n: int, cols: int, dtype: torch.dtype, *, arg: str, check_finite: bool
) -> torch.Tensor:
    """``values`` as a contiguous CPU (n, cols) tensor of ``dtype``."""
    if (type(values) is torch.Tensor and values.dtype is dtype and values.is_cpu and values.shape == (n, cols)
            and not values.requires_grad and values.is_contiguous()):
        # the per-step path: a training step's own rows back, already in the store's layout
        if check_finite and n and dtype.is_floating_point and not _all_finite(values):
            _raise_not_finite(values, arg, dtype, dtype)
        return values
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(np.asarray(values))
        except (TypeError, ValueError) as exc:
            raise InvalidTypeError(f"{arg} must be a tensor or array of numbers; got {type(values).__name__}") from exc
    vdtype = values.dtype
    if vdtype.is_complex or vdtype == torch.bool:
        raise InvalidTypeError(f"{arg} has dtype {vdtype}, which cannot be cast to the store dtype {dtype}")
    if values.shape != (n, cols):
        raise InvalidArgumentError(f"{arg} must have shape ({n}, {cols}) to match ids; got {tuple(values.shape)}")
    if not dtype.is_floating_point and vdtype.is_floating_point:
        raise InvalidTypeError(f"{arg} has floating dtype {vdtype}; this field holds {dtype}")
    if values.device.type != "cpu":
        values = values.to("cpu")
    if values.requires_grad:
        values = values.detach()
    if vdtype != dtype:
        values = values.to(dtype)
    # Checked after the cast: a finite float64 beyond float32's range would be stored as inf.
    if check_finite and n and dtype.is_floating_point and not _all_finite(values):
        _raise_not_finite(values, arg, dtype, vdtype)
    return values if values.is_contiguous() else values.contiguous()


def _raise_not_finite(values: torch.Tensor, arg: str, dtype: torch.dtype, vdtype: torch.dtype) -> None:
    bad = int((~torch.isfinite(values)).any(dim=1).nonzero()[0, 0])
    raise InvalidArgumentError(
        f"{arg} must be finite in the store dtype {dtype} (check_finite=True); row {bad} holds NaN or "
        f"Inf{' after the cast from ' + str(vdtype) if vdtype != dtype else ''}"
    )


def _all_finite(values: torch.Tensor) -> bool:
    # numpy's isfinite is ~15x faster than torch's on small CPU batches (no thread pool start-up).
    if values.dtype == torch.bfloat16:
        return math.isfinite(float(values.float().sum())) or bool(torch.isfinite(values).all())
    if not values.is_contiguous():
        values = values.contiguous()
    arr = values.numpy()
    # NaN and Inf always reach a sum of squares; a finite one proves every value finite without
    # allocating a mask. For float32/64 it is BLAS's dot (2.4x numpy's pairwise sum here); a sum
    # that overflows from finite values only sends us to the exact check.
    if arr.dtype == np.float32 or arr.dtype == np.float64:
        flat = arr.reshape(-1)
        total = float(np.dot(flat, flat))
    else:
        total = float(np.add.reduce(arr, axis=None))
    return math.isfinite(total) or bool(np.isfinite(arr).all())


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
