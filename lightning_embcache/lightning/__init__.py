"""The Lightning layer: a mixin that gives a LightningModule per-sample tables, and callbacks.

Arrows point one way: this package uses `lightning_embcache.store`; the store never imports Lightning.
"""

from lightning_embcache.lightning.deferred_sync import DeferredSync
from lightning_embcache.lightning.handle import EmbeddingStoreHandle
from lightning_embcache.lightning.memory_pressure import MemoryPressure
from lightning_embcache.lightning.memory_reading import MemoryReader, MemoryReading
from lightning_embcache.lightning.mixin import EmbeddingStoreMixin

__all__ = [
    "DeferredSync",
    "EmbeddingStoreHandle",
    "EmbeddingStoreMixin",
    "MemoryPressure",
    "MemoryReader",
    "MemoryReading",
]
