"""Checks of ``add_embedding_store``'s arguments, before anything is made: named errors, allowed
values, and the argument a misspelt one probably meant."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lightning_embcache.optim.factory import OPTIMIZERS
from lightning_embcache.store.errors import InvalidArgumentError


def named_options(fn: Any) -> tuple[str, ...]:
    """The keyword-only arguments `fn` names (``add_embedding_store``'s store options), in order."""
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY)

#: optimizer keywords the layer takes itself rather than the row optimizer
LAYER_OPTIM_OPTIONS = ("max_grad_norm",)
# bytes of a hot-tier slot beyond its record (the store's id map and CLOCK bits)
HOT_SLOT_OVERHEAD = 11


class UnknownArgumentError(InvalidArgumentError, TypeError):
    """A keyword ``add_embedding_store`` does not take; a `TypeError` too, as Python's own is."""


def suggestion(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean hot_bytes=?)"`` for a near miss of one of `choices`, else ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}=?)" if close else ""


def optimizer_options(name: str | None) -> tuple[str, ...]:
    """The keyword arguments row optimizer `name` takes; every optimizer's for ``None``."""
    classes = OPTIMIZERS.values() if name is None else [OPTIMIZERS[name.lower()]]
    found: dict[str, None] = {}
    for cls in classes:
        found.update((p, None) for p in inspect.signature(cls.__init__).parameters if p not in ("self", "lr"))
    return (*found, *LAYER_OPTIM_OPTIONS)


def check_optimizer(optimizer: Any) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZERS:
        close = difflib.get_close_matches(optimizer.lower(), list(OPTIMIZERS), n=1, cutoff=0.6) \
            if isinstance(optimizer, str) else []
        hint = f" (did you mean optimizer={close[0]!r}?)" if close else ""
        raise InvalidArgumentError(
            f"Invalid value for optimizer={optimizer!r}. Must be None (direct writes only) or one of "
            f"{', '.join(map(repr, OPTIMIZERS))}{hint}"
        )


def check_choice(arg: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6) if isinstance(value, str) else []
        hint = f" (did you mean {arg}={close[0]!r}?)" if close else ""
        raise InvalidArgumentError(f"Invalid value for {arg}={value!r}. Must be one of "
                                   f"{', '.join(map(repr, allowed))}{hint}")


def check_unknown_keywords(optim_kwargs: Mapping[str, Any], optimizer: str | None,
                           store_options: tuple[str, ...]) -> None:
    """Every keyword beyond the named ones (`store_options`) must be an option of the chosen row optimizer."""
    if not optim_kwargs:
        return
    own = optimizer_options(optimizer) if optimizer is not None else LAYER_OPTIM_OPTIONS
    unknown = [k for k in optim_kwargs if k not in own]
    if not unknown:
        return
    key = unknown[0]
    if optimizer is None and key in optimizer_options(None):
        raise UnknownArgumentError(
            f"add_embedding_store() got {key}={optim_kwargs[key]!r}, an option of the row optimizer, without "
            f"optimizer=...; pass optimizer= one of {', '.join(map(repr, OPTIMIZERS))} to train the rows"
        )
    others = [n for n in OPTIMIZERS if key in optimizer_options(n)]
    if optimizer is not None and others:
        raise UnknownArgumentError(
            f"add_embedding_store() got {key}={optim_kwargs[key]!r}, which row optimizer {optimizer!r} does not "
            f"take (it takes {', '.join(own)}); {key} is an option of {', '.join(map(repr, others))}"
        )
    what = f"row optimizer {optimizer!r} takes {', '.join(own)}" if optimizer else \
        "row optimizer options need optimizer=..."
    raise UnknownArgumentError(
        f"add_embedding_store() got an unknown argument {key}={optim_kwargs[key]!r}"
        f"{suggestion(key, (*store_options, *own))}; store options are {', '.join(store_options)}; {what}"
    )


def check_hot_bytes(hot_bytes: Any, dim: int, dtype: torch.dtype, fields: Mapping[str, Any] | None) -> None:
    """A hot budget must hold one record: below that nothing could ever be served from RAM."""
    if hot_bytes is None or isinstance(hot_bytes, bool) or not isinstance(hot_bytes, int) or hot_bytes < 0:
        return  # None is memory mode; a wrong type or a negative value: the store's own check names it
    from lightning_embcache.store.schema import Schema

    try:
        record = Schema(dim, dtype, dict(fields or {})).row_bytes + HOT_SLOT_OVERHEAD
    except Exception:  # a bad dim, dtype or field: the store's own checks report it when it opens
        return
    if hot_bytes < record:
        raise InvalidArgumentError(
            f"Invalid value for hot_bytes={hot_bytes}. Must be None (the whole table in RAM) or at least one "
            f"record, {record} bytes here ({dim} x {str(dtype).replace('torch.', '')}"
            f"{' + optimizer state and row fields' if fields else ''} + {HOT_SLOT_OVERHEAD} bytes of slot); "
            f"hot_bytes is a budget in bytes, e.g. 256 << 20 for 256 MiB"
        )
