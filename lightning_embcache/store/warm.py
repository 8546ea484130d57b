"""Warm tier: LZ4-compressed chunks in RAM, least recently used first out, within a byte budget."""

from __future__ import annotations

from collections import OrderedDict

import lz4.block
import numpy as np

from . import idsets

# A chunk that compresses worse than this is kept raw: decompressing it would cost time for nothing.
MIN_RATIO = 1.05


class WarmTier:
    def __init__(self, budget: int) -> None:
        self.budget = max(int(budget), 0)
        self._items: OrderedDict[int, tuple[bytes, bool, int]] = OrderedDict()
        self.nbytes = 0
        self.raw_bytes = 0
        self.hits = 0
        self.misses = 0
        self.bytes_read = 0  # raw bytes served from the tier
        self.bytes_written = 0  # bytes stored into it (compressed where LZ4 paid)

    def __contains__(self, chunk: int) -> bool:
        return chunk in self._items

    def __len__(self) -> int:
        return len(self._items)

    def chunks(self) -> np.ndarray:
        """The chunks held now (for a vectorised membership test of a batch's chunks)."""
        return np.fromiter(self._items, np.int64, len(self._items))

    def get(self, chunk: int) -> np.ndarray | None:
        """The chunk's records as a flat, read-only uint8 array, or None. A raw chunk is served
        without a copy (a batch in `ChunkShuffleSampler` order takes 1/32 of a chunk's rows per
        hit: copying the whole chunk first cost 32 times the rows it served)."""
        item = self._items.get(chunk)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(chunk)
        self.hits += 1
        data, compressed, raw_len = item
        self.bytes_read += raw_len
        if compressed:
            data = lz4.block.decompress(data, uncompressed_size=raw_len)
        return np.frombuffer(data, dtype=np.uint8)

    def put(self, chunk: int, records: np.ndarray) -> None:
        if self.budget <= 0:
            return
        raw = records.tobytes()
        packed = lz4.block.compress(raw, store_size=False)
        compressed = len(raw) >= MIN_RATIO * len(packed)
        data = packed if compressed else raw
        if len(data) > self.budget:
            return
        self.discard(chunk)
        self._items[chunk] = (data, compressed, len(raw))
        self.bytes_written += len(data)
        self.nbytes += len(data)
        self.raw_bytes += len(raw)
        self.shrink(self.budget)

    def discard(self, chunk: int) -> None:
        item = self._items.pop(chunk, None)
        if item is not None:
            self.nbytes -= len(item[0])
            self.raw_bytes -= item[2]

    def discard_many(self, chunks: np.ndarray) -> None:
        if self._items:
            for c in idsets.unique(chunks).tolist():
                self.discard(c)

    def shrink(self, limit: int) -> int:
        """Drop least recently used chunks until at most ``limit`` bytes remain; return bytes freed."""
        freed = 0
        while self.nbytes > limit and self._items:
            _, (data, _, raw_len) = self._items.popitem(last=False)
            self.nbytes -= len(data)
            self.raw_bytes -= raw_len
            freed += len(data)
        return freed

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.nbytes if self.nbytes else 1.0
