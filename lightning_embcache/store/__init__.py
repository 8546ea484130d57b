"""The storage engine: no Lightning imports here (the Lightning layer depends on this, not back)."""

from .errors import (
    CorruptStoreError,
    DiskFullError,
    ForkedWriterError,
    InvalidArgumentError,
    InvalidTypeError,
    OutOfMemoryError,
    ReadOnlyError,
    StoreBusyError,
    StoreClosedError,
    StoreError,
    StoreIOError,
    StoreLockedError,
    VersionNotFoundError,
)
from .stats import StoreStats
from .store import EmbeddingStore

__all__ = [
    "CorruptStoreError",
    "DiskFullError",
    "EmbeddingStore",
    "ForkedWriterError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "OutOfMemoryError",
    "ReadOnlyError",
    "StoreBusyError",
    "StoreClosedError",
    "StoreError",
    "StoreIOError",
    "StoreLockedError",
    "StoreStats",
    "VersionNotFoundError",
]
