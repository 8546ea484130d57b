"""The storage engine: no Lightning imports here (the Lightning layer depends on this, not back)."""

from .errors import (
    CorruptStoreError,
    ForkedWriterError,
    InvalidArgumentError,
    InvalidTypeError,
    ReadOnlyError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
    VersionNotFoundError,
)
from .fileio import DiskFullError
from .stats import StoreStats
from .store import EmbeddingStore

__all__ = [
    "CorruptStoreError",
    "DiskFullError",
    "EmbeddingStore",
    "ForkedWriterError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "ReadOnlyError",
    "StoreClosedError",
    "StoreError",
    "StoreLockedError",
    "StoreStats",
    "VersionNotFoundError",
]
