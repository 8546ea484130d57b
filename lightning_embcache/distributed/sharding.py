"""Which rank owns which row, and where each rank keeps its shard.

The rule is cyclic: **id `i` lives on rank `i % world_size`, at local row `i // world_size`** of
that rank's own `EmbeddingStore`, in ``<path>/rank-RRRRR-of-WWWWW/``.

Why cyclic rather than contiguous ranges: per-sample ids are usually handed out in data order
(file order, time of arrival), and a contiguous range split then gives one rank all of one kind of
sample, so a curriculum, a sorted file or new data landing at the end of the id space loads a
single rank. Taking ids round-robin spreads any such run over every rank while keeping the map one
modulo and one division, with nothing to store and nothing to look up. Shard `r` holds
``ceil((num_rows - r) / world_size)`` rows, so shards differ by at most one row.

A table must look the same whatever the world size, so initial rows are computed from the
*global* id: ``init="normal"`` reproduces exactly the rows a single-process store with the same
``seed`` starts with, and a callable ``init`` receives global ids.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lightning_embcache.store.store import StridedNormal

SHARD_DIR = re.compile(r"^rank-(\d{5})-of-(\d{5})$")


def shard_dir(path: Path, rank: int, world_size: int) -> Path:
    """``<path>/rank-RRRRR-of-WWWWW``: rank `rank`'s store of a table split over `world_size` ranks."""
    return Path(path) / f"rank-{rank:05d}-of-{world_size:05d}"


def shard_layouts(path: Path) -> set[int]:
    """World sizes of the shard directories found under `path` (empty when there are none)."""
    if not Path(path).is_dir():
        return set()
    found = set()
    for entry in Path(path).iterdir():
        m = SHARD_DIR.match(entry.name)
        if m and entry.is_dir():
            found.add(int(m.group(2)))
    return found


@dataclass(frozen=True)
class RowSharding:
    """The id -> (owner rank, local row) map of a table of `num_rows` rows over `world_size` ranks."""

    num_rows: int
    world_size: int

    def owner(self, ids: Tensor) -> Tensor:
        return ids % self.world_size

    def local(self, ids: Tensor) -> Tensor:
        return ids // self.world_size

    def global_ids(self, rank: int, local: Tensor) -> Tensor:
        return local * self.world_size + rank

    def shard_rows(self, rank: int) -> int:
        return max(0, (self.num_rows - rank + self.world_size - 1) // self.world_size)


class GlobalNormalInit(StridedNormal):
    """``init="normal"`` of a single-process store, evaluated at the global ids of one shard.

    The store draws row `i` from a generator keyed by ``(seed, i)`` alone, so a shard computes the
    rows the whole table would have by passing the global ids of its local rows (local *
    world_size + rank). The shard's META records that, so the store, and `embcache verify`,
    `inspect`, `compact` and `export`, rebuild this init from the shard folder alone.
    """

    def __init__(self, sharding: RowSharding, rank: int, dim: int, seed: int, std: float) -> None:
        super().__init__(sharding.world_size, rank, dim, seed, std)
        self.sharding, self.rank = sharding, rank


class GlobalCallableInit:
    """A user's ``init(ids) -> rows`` called with the global ids of a shard's local rows."""

    def __init__(self, fn: Callable[[Tensor], Tensor], sharding: RowSharding, rank: int) -> None:
        self.fn, self.sharding, self.rank = fn, sharding, rank

    def __call__(self, local_ids: Tensor) -> Tensor:
        return self.fn(self.sharding.global_ids(self.rank, local_ids.to(torch.int64)))
