"""The store's exception family: one base class, a few named cases a caller can catch."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class InvalidArgumentError(StoreError, ValueError):
    """An argument is out of its allowed range; the message names it, its value and the range."""


class InvalidTypeError(StoreError, TypeError):
    """An argument has the wrong type or dtype; the message names it and what is allowed."""


class CorruptStoreError(StoreError):
    """A store file fails its checksum, is truncated, or is not a store file at all."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class StoreLockedError(StoreError):
    """Another writer holds the store (one writer per path)."""


class ForkedWriterError(StoreError):
    """A writable store was used in a forked child, e.g. a DataLoader worker."""


class VersionNotFoundError(StoreError):
    """The requested version was reclaimed or never existed."""


class StoreClosedError(StoreError):
    """The store was used after `close()`."""


class ReadOnlyError(StoreError):
    """A write was attempted on a store opened with `readonly=True`."""
