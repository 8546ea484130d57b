"""lightning_embcache: trainable per-sample embedding rows for datasets larger than RAM.

The storage engine and the optimizers import without Lightning; the Lightning layer (mixin,
callbacks, profiler) is imported on first use, so a DataLoader worker or a script that only needs
the store does not pay for importing Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_embcache.data import ChunkShuffleSampler, LookaheadSampler, ResumableLoader
from lightning_embcache.device_tier import DeviceTier
from lightning_embcache.optim import RowOptimizer, make_row_optimizer
from lightning_embcache.store import (
    CorruptStoreError,
    DiskFullError,
    EmbeddingStore,
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
    StoreStats,
    VersionNotFoundError,
)
from lightning_embcache.trainable import TrainableRows, trainable_fields

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily: these need Lightning)
_LAZY = {
    "StepProfiler": "lightning_embcache.profiling",
    "DeferredSync": "lightning_embcache.lightning",
    "EmbeddingStoreMixin": "lightning_embcache.lightning",
    "MemoryPressure": "lightning_embcache.lightning",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_embcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ChunkShuffleSampler",
    "CorruptStoreError",
    "DeferredSync",
    "DeviceTier",
    "DiskFullError",
    "EmbeddingStore",
    "EmbeddingStoreMixin",
    "ForkedWriterError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "OutOfMemoryError",
    "LookaheadSampler",
    "ResumableLoader",
    "MemoryPressure",
    "ReadOnlyError",
    "RowOptimizer",
    "StepProfiler",
    "StoreBusyError",
    "StoreClosedError",
    "StoreError",
    "StoreIOError",
    "StoreLockedError",
    "StoreStats",
    "TrainableRows",
    "VersionNotFoundError",
    "make_row_optimizer",
    "trainable_fields",
]
