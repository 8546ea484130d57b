"""Argument checks shared by the row optimizers: one message shape, `<name> must be <rule>; got <value>`."""

from __future__ import annotations

import math
from typing import Any

from lightning_embcache.store.errors import InvalidArgumentError, InvalidTypeError


def check_number(name: str, value: Any, *, ge: float | None = None, gt: float | None = None,
                 lt: float | None = None, le: float | None = None) -> float:
    """Return `value` as a float after checking it is a finite real number within the given bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{name} must be a real number; got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite; got {value}")
    if ge is not None and le is not None and not ge <= value <= le:
        raise InvalidArgumentError(f"{name} must be in [{ge:g}, {le:g}]; got {value:g}")
    if ge is not None and lt is not None and not ge <= value < lt:
        raise InvalidArgumentError(f"{name} must be in [{ge:g}, {lt:g}); got {value:g}")
    if ge is not None and value < ge:
        raise InvalidArgumentError(f"{name} must be >= {ge:g}; got {value:g}")
    if gt is not None and value <= gt:
        raise InvalidArgumentError(f"{name} must be > {gt:g}; got {value:g}")
    if lt is not None and value >= lt:
        raise InvalidArgumentError(f"{name} must be < {lt:g}; got {value:g}")
    if le is not None and value > le:
        raise InvalidArgumentError(f"{name} must be <= {le:g}; got {value:g}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidTypeError(f"{name} must be a bool; got {value!r} ({type(value).__name__})")
    return value


def check_betas(value: Any) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidTypeError(f"betas must be a pair (beta1, beta2); got {value!r}")
    return (check_number("betas[0]", value[0], ge=0.0, lt=1.0),
            check_number("betas[1]", value[1], ge=0.0, lt=1.0))
