"""Row-sharded embedding stores over torch.distributed (no Lightning imports).

Under a multi-process strategy each rank owns the ids with ``id % world_size == rank`` and keeps
them in its own `EmbeddingStore` under ``<path>/rank-RRRRR-of-WWWWW/``; reads, writes and gradient
rows travel to and from their owners through all-to-all. Under NCCL each owner keeps its shard's hot
rows on its GPU (`ShardedDeviceRows`) and rows travel GPU to GPU. See docs/distributed.md.
"""

from lightning_embcache.distributed.device_rows import ShardedDeviceRows
from lightning_embcache.distributed.exchange import sharding_active, world
from lightning_embcache.distributed.sharding import RowSharding, shard_dir
from lightning_embcache.distributed.store import ShardedStore
from lightning_embcache.distributed.trainable import ShardedTrainableRows

__all__ = [
    "RowSharding",
    "ShardedDeviceRows",
    "ShardedStore",
    "ShardedTrainableRows",
    "shard_dir",
    "sharding_active",
    "world",
]
