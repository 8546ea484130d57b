"""The public calls' checks of a store's state and of field names, raising errors that say what to do.

Every public `EmbeddingStore` call checks once at its boundary (closed, read-only, forked child,
unknown field); the code inside trusts what passed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .core import StoreCore
from .errors import ForkedWriterError, InvalidArgumentError, InvalidTypeError, ReadOnlyError, StoreClosedError
from .schema import Schema


def check_state(core: StoreCore, write: bool = False) -> None:
    """Refuse a closed store, a write to a read-only one, and a writable one in a forked child."""
    if core.closed:
        raise StoreClosedError("this EmbeddingStore is closed; open it again with EmbeddingStore.open(path)")
    if write and core.readonly:
        raise ReadOnlyError("this store was opened with readonly=True; open it with readonly=False to write")
    check_owner(core)


def check_owner(core: StoreCore) -> None:
    """A writable store's memory is not mapped in a forked child (memory.PageBuffer): refuse there."""
    if not core.readonly and os.getpid() != core.pid:
        raise ForkedWriterError(
            "a writable EmbeddingStore cannot be used in a forked child process (e.g. a DataLoader "
            "worker); open a readonly handle there: EmbeddingStore.open(path, readonly=True)"
        )


def check_names(schema: Schema, names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple of the schema's field names, or an error naming the one that is not."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (tuple, list)) and not hasattr(names, "__iter__"):
        raise InvalidTypeError(f"names must be a sequence of field names; got {type(names).__name__} {names!r}")
    try:
        names = tuple(names)
    except TypeError:
        raise InvalidTypeError(f"names must be a sequence of field names; got {type(names).__name__}") from None
    for n in names:
        if not isinstance(n, str) or n not in schema.fields:
            raise InvalidArgumentError(f"field {n!r} does not exist; this store has {list(schema.names)}")
    return names
