"""lightning_embcache: trainable per-sample embedding rows for datasets larger than RAM."""

from lightning_embcache.store import (
    CorruptStoreError,
    DiskFullError,
    EmbeddingStore,
    ForkedWriterError,
    InvalidArgumentError,
    InvalidTypeError,
    ReadOnlyError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
    StoreStats,
    VersionNotFoundError,
)
from lightning_embcache.profiling import StepProfiler
from lightning_embcache.lightning import DeferredSync, EmbeddingStoreMixin, MemoryPressure
from lightning_embcache.optim import RowOptimizer, make_row_optimizer

__version__ = "0.1.0"

__all__ = [
    "RowOptimizer",
    "make_row_optimizer",
    "CorruptStoreError",
    "DeferredSync",
    "DiskFullError",
    "EmbeddingStore",
    "EmbeddingStoreMixin",
    "ForkedWriterError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "MemoryPressure",
    "ReadOnlyError",
    "StoreClosedError",
    "StoreError",
    "StoreLockedError",
    "StepProfiler",
    "StoreStats",
    "VersionNotFoundError",
]
