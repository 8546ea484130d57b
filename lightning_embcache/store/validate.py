"""Argument checks at the public boundary: one cheap pass, clear messages, nothing changed on error."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError, InvalidTypeError
from .limits import MAX_ROWS


def as_ids(ids: Any, num_rows: int, arg: str = "ids") -> np.ndarray:
    """``ids`` as a new 1-D int64 numpy array of the store's own, bounds-checked.

    Always a copy, validated after copying: the caller's memory may change while the call runs (a
    DataLoader reusing a shared buffer, a pinned batch refilled from numpy), and an id checked
    in one place and read again in another could then reach a row it was never checked for. No
    cache either: a tensor refilled through ``.data`` or a numpy view keeps its version counter.
    """
    if type(ids) is torch.Tensor and ids.dtype is torch.int64 and ids.dim() == 1 and ids.is_cpu:
        # the hot path: one copy, then one pass. Seen as unsigned, a negative id is huge, so one
        # max bounds both ends (numpy has no fused min/max; two reductions cost twice this).
        arr = ids.numpy().copy()
    elif isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InvalidTypeError(f"{arg} must be an integer tensor; got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise InvalidArgumentError(f"{arg} must be 1-D; got shape {tuple(ids.shape)}")
        if ids.device.type == "meta":
            raise InvalidArgumentError(f"{arg} is on the 'meta' device (no data); pass ids on the CPU or a GPU")
        arr = ids.detach().to("cpu", torch.int64).numpy()  # the store is host-side
        if arr.base is not None or not arr.flags.owndata:
            arr = arr.copy()
    else:
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidTypeError(f"{arg} must be a 1-D sequence of integers; got {type(ids).__name__}") from exc
        if arr.dtype == object or arr.dtype.kind not in "iu":
            if not (arr.size == 0 and arr.dtype.kind == "f"):
                raise InvalidTypeError(f"{arg} must hold integers; got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise InvalidArgumentError(f"{arg} must be 1-D; got shape {arr.shape}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 1 << 63:
            raise InvalidArgumentError(f"{arg} must be in [0, {num_rows}); got max id {int(arr.max())}")
        arr = arr.astype(np.int64)  # a copy: the caller's array may change under us
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
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InvalidTypeError(f"{arg} must be a tensor or array of numbers; got {type(values).__name__}") from exc
    if values.device.type == "meta":
        raise InvalidArgumentError(f"{arg} is on the 'meta' device (no data); pass values on the CPU or a GPU")
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
        if not dtype.is_floating_point and len(values):
            _check_int_range(values, arg, dtype)
        values = values.to(dtype)
    # Checked after the cast: a finite float64 beyond float32's range would be stored as inf.
    if check_finite and n and dtype.is_floating_point and not _all_finite(values):
        _raise_not_finite(values, arg, dtype, vdtype)
    return values if values.is_contiguous() else values.contiguous()


def check_finite(values: torch.Tensor, arg: str) -> None:
    """Raise naming ``arg`` where a CPU float tensor (strided views welcome) holds NaN or Inf."""
    if values.dtype.is_floating_point and values.numel() and not _all_finite(values):
        _raise_not_finite(values, arg, values.dtype, values.dtype)


def _check_int_range(values: torch.Tensor, arg: str, dtype: torch.dtype) -> None:
    """An integer field must hold the value written, not its low bits (2**40 + 7 as int32 is 7)."""
    info = torch.iinfo(dtype)
    lo, hi = int(values.min()), int(values.max())
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        raise InvalidArgumentError(f"{arg} must fit {dtype} (range [{info.min}, {info.max}]); got {bad}")


def _raise_not_finite(values: torch.Tensor, arg: str, dtype: torch.dtype, vdtype: torch.dtype) -> None:
    bad = int((~torch.isfinite(values)).any(dim=1).nonzero()[0, 0])
    raise InvalidArgumentError(
        f"{arg} must be finite in the store dtype {dtype} (check_finite=True); row {bad} holds NaN or "
        f"Inf{' after the cast from ' + str(vdtype) if vdtype != dtype else ''}"
    )


def _all_finite(values: torch.Tensor) -> bool:
    # numpy's isfinite: no thread-pool start-up, which dominates torch's on small CPU batches.
    if values.dtype == torch.bfloat16:
        return math.isfinite(float(values.float().sum())) or bool(torch.isfinite(values).all())
    # a strided view (one field of whole records): numpy's copy, several times torch's for a
    # (rows, cols) view whose rows lie apart
    arr = values.numpy() if values.is_contiguous() else np.ascontiguousarray(values.numpy())
    # NaN and Inf always reach a sum of squares; a finite one proves every value finite without
    # allocating a mask. For float32/64 it is BLAS's dot (2.4x numpy's pairwise sum here); a sum
    # that overflows from finite values only sends us to the exact check.
    if arr.dtype == np.float32 or arr.dtype == np.float64:
        flat = arr.reshape(-1)
        total = float(np.dot(flat, flat))
    else:
        total = float(np.add.reduce(arr, axis=None))
    return math.isfinite(total) or bool(np.isfinite(arr).all())


def positive_int(value: Any, arg: str, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{arg} must be an int; got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidArgumentError(f"{arg} must be {allowed}; got {value}")
    return int(value)


def version_arg(value: Any, arg: str = "version") -> int:
    """A version number: an int >= 0 (not a bool, not a float: 1.7 must not open version 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{arg} must be an int version number; got {type(value).__name__} {value!r}")
    if value < 0 or value >= 1 << 62:
        raise InvalidArgumentError(f"{arg} must be in [0, 2**62); got {value}")
    return int(value)


def finite_float(value: Any, arg: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidTypeError(f"{arg} must be a float; got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or (positive and v <= 0) or (not positive and v < 0):
        raise InvalidArgumentError(f"{arg} must be a finite float {'> 0' if positive else '>= 0'}; got {value!r}")
    return v


def budget(value: Any, arg: str, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        allowed = "None or an int >= 0" if allow_none else "an int >= 0"
        raise InvalidArgumentError(f"{arg} must be {allowed} (bytes); got {value!r}")
    return int(value)


# Limits of the on-disk format and of one process's address space.
MAX_CHUNK_ROWS = (1 << 31) - 1  # chunk_rows is a u32 in segment headers; chunk maps are int32


def check_meta(meta: Any, path: Any) -> None:
    """META of a store on disk, checked before anything is allocated from it (a crafted META
    with num_rows=2**62 must be a named error, not a 16 PiB allocation)."""
    from .errors import CorruptStoreError
    from .schema import Schema

    def bad(why: str) -> None:
        raise CorruptStoreError(path, f"not a valid store description: {why}")

    if not isinstance(meta, dict) or meta.get("format") != "lightning_embcache":
        raise CorruptStoreError(path, "not a lightning_embcache store")
    n, cr = meta.get("num_rows"), meta.get("chunk_rows")
    if type(n) is not int or not 1 <= n <= MAX_ROWS:
        bad(f"num_rows={n!r}")
    if type(cr) is not int or not 1 <= cr <= MAX_CHUNK_ROWS:
        bad(f"chunk_rows={cr!r}")
    if meta.get("compression") not in (None, "lz4"):
        bad(f"compression={meta.get('compression')!r}")
    if meta.get("init") not in ("zeros", "normal", "callable"):
        bad(f"init={meta.get('init')!r}")
    if type(meta.get("seed")) is not int or not isinstance(meta.get("init_std"), (int, float)) \
            or isinstance(meta.get("init_std"), bool) or not math.isfinite(float(meta["init_std"])):
        bad("seed/init_std")
    try:
        schema = Schema.from_json(meta.get("schema") or {})
    except Exception as exc:  # noqa: BLE001 - any malformed schema is one named corruption
        bad(f"schema ({type(exc).__name__}: {exc})")
    if type(schema.dim) is not int or not 1 <= schema.dim <= 1 << 20 or schema.row_bytes > 1 << 24:
        bad(f"record of {schema.row_bytes} bytes")
