"""Warm tier: LZ4-compressed chunks in RAM, least recently used first out, within a byte budget.

Chunks are kept compressed where LZ4 gains at least 5% (else raw). The budget's slack also holds
the decompressed records of the most recently used compressed chunks, dropped first when the
budget is short: a chunk that serves a few rows to each of many batches (`ChunkShuffleSampler`
order: about 1/32 of its rows per batch while it is in the window) is decompressed once, not
once per batch. A store whose chunks do not compress stops trying for a while, so its puts cost
a copy at most. Raw chunks (kept raw or decompressed) live in the slots of one `ChunkSlab` where
there is room, so that rows of many of them are gathered in one call (`rows_of`).
"""

from __future__ import annotations

from collections import OrderedDict

import lz4.block
import numpy as np

from . import idsets
from .slab import ChunkSlab

# A chunk that compresses worse than this is kept raw: decompressing it would cost time for nothing.
MIN_RATIO = 1.05
# After this many incompressible chunks in a row, the next SKIP_PUTS puts are kept raw untried.
GIVE_UP_AFTER = 4
SKIP_PUTS = 32
# A chunk read ahead takes the slot of the least recently read chunk only if that was last read
# this many serving calls ago or more (the chunks of a window in use are read by every call)...
LATELY = 2
FRESH = 1 << 62  # ...and never that of a chunk read ahead that no call has read yet


class WarmTier:
    def __init__(self, budget: int, chunk_rows: int = 0, row_bytes: int = 0, num_chunks: int = 0) -> None:
        """``chunk_rows``, ``row_bytes``, ``num_chunks``: the store's shape, for the slab (none
        without them)."""
        self._budget = max(int(budget), 0)
        self._shape = (chunk_rows, row_bytes, num_chunks)
        self.slab: ChunkSlab | None = None  # made at the first raw chunk, sized to the budget
        self._pins = 0  # readers holding views of the slab (`pin`)
        # chunk -> (bytes or read-only uint8 array, compressed?, raw length); oldest first
        self._items: OrderedDict[int, tuple[bytes | np.ndarray, bool, int]] = OrderedDict()
        self._raw: OrderedDict[int, np.ndarray] = OrderedDict()  # decompressed copies, oldest first
        self._item_bytes = 0  # bytes of ``_items`` (compressed where LZ4 paid)
        self._raw_copy_bytes = 0
        self._sorted: np.ndarray | None = None  # `chunks()`, until the chunks held change
        self._incompressible = 0  # incompressible puts in a row
        self._skip = 0  # puts left to keep raw without trying LZ4
        self._loading: dict[int, tuple[int, int]] = {}  # chunk -> (slot, bytes): being read into the slab
        self._loading_bytes = 0
        # per chunk: the serving call (``_clock``) that last read it; FRESH until a chunk read
        # ahead is first read (a read ahead never takes the slot of a chunk read since LATELY calls)
        self._clock = 0
        self._stamp: dict[int, int] = {}
        self.raw_bytes = 0
        self.hits = 0
        self.misses = 0
        self.bytes_read = 0  # raw bytes served from the tier
        self.bytes_written = 0  # bytes stored into it (compressed where LZ4 paid)

    @property
    def budget(self) -> int:
        return self._budget

    @budget.setter
    def budget(self, value: int) -> None:
        """A new budget: chunks in the slab move out to arrays of their own and the slab is
        made again at the next raw chunk, sized to the new budget."""
        value = max(int(value), 0)
        if self._loading:
            raise RuntimeError("WarmTier.budget changed while chunks are read into the slab; cancel them first")
        if value != self._budget and self.slab is not None:
            for chunk, (data, compressed, raw_len) in list(self._items.items()):
                if not compressed and self._in_slab(chunk):
                    assert isinstance(data, np.ndarray)  # a slab slot's view
                    self._items[chunk] = (_frozen(data.copy()), False, raw_len)
            for chunk in list(self._raw):
                if self._in_slab(chunk):
                    self._raw[chunk] = _frozen(self._raw[chunk].copy())
            self.slab.close()
            self.slab = None
        self._budget = value

    def _in_slab(self, chunk: int) -> bool:
        return self.slab is not None and self.slab.slot_of[chunk] >= 0

    def _slab(self) -> ChunkSlab | None:
        """The slab, made at first need; None where the budget holds no chunk or no map could be had."""
        slab = self.slab
        if slab is None:
            rows, rb, n = self._shape
            if not n or self._budget < rows * rb:
                return None
            try:  # (never more slots than the table has chunks)
                slab = ChunkSlab(rows, rb, min(n, self._budget // (rows * rb)), n, hold=self._pins > 0)
            except (OSError, MemoryError, OverflowError, ValueError):  # no address space for it
                self._shape = (rows, rb, 0)  # chunks stay arrays of their own, as they always can
                return None
            self.slab = slab
        return slab

    def _keep(self, chunk: int, raw: np.ndarray) -> np.ndarray:
        """``raw`` (flat, read-only) where it is kept: a slot of the slab if one is free."""
        slab = self._slab()
        if slab is None:
            return raw
        placed = slab.place(chunk, raw)
        return raw if placed is None else placed

    # ---- chunks read into the slab by the kernel (`ChunkLoader`) -----------------------------
    def reserve(self, chunk: int, nbytes: int) -> np.ndarray | None:
        """A slot for ``chunk``'s ``nbytes`` of records about to be read into it: its writable
        bytes, or None where no slot can be had without dropping a chunk read in the last
        LATELY serving calls (those of the window being trained on) or one read ahead and not
        read yet. The bytes count against the budget until `adopt` or `unreserve`."""
        if chunk in self._loading:
            return None
        slab = self._slab()
        if slab is None or nbytes > slab.chunk_bytes:
            return None
        self._trim_raw(self.budget - nbytes if slab.free_slots else 0)  # (copies can be made again)
        while self.nbytes + nbytes > self.budget or not slab.free_slots:
            victim = next(iter(self._items), None)
            if victim is None or self._stamp.get(victim, 0) > self._clock - LATELY:
                return None
            self.discard(victim)
        got = slab.reserve()
        if got is None:  # (slots freed while a reader holds views come free at `unpin`)
            return None
        slot, flat = got
        self._loading[chunk] = (slot, nbytes)
        self._loading_bytes += nbytes
        self._trim_pages(self.budget)
        return flat[:nbytes]

    def adopt(self, chunk: int) -> None:
        """The reserved slot of ``chunk`` holds its current records: the tier serves them."""
        slot, nbytes = self._loading.pop(chunk)
        self._loading_bytes -= nbytes
        self.discard(chunk)
        assert self.slab is not None  # slots are reserved in the slab
        self._add(chunk, self.slab.fill(chunk, slot, nbytes), False, nbytes, nbytes)
        self._stamp[chunk] = FRESH

    def unreserve(self, chunk: int, reuse: bool = True) -> None:
        """Give back the slot reserved for ``chunk`` (its read failed or is no longer current);
        ``reuse=False``: the slot is never used again (a read into it may still be running)."""
        slot, nbytes = self._loading.pop(chunk)
        self._loading_bytes -= nbytes
        if reuse:
            assert self.slab is not None  # slots are reserved in the slab
            self.slab.unreserve(slot)

    def loading(self, chunk: int) -> bool:
        return chunk in self._loading

    def pin(self) -> None:
        """Views `get` returns from now on stay valid until `unpin` (a plan holds several at
        once; a slot freed meanwhile is not reused, in a slab made meanwhile too)."""
        self._pins += 1
        if self.slab is not None:
            self.slab.hold = True

    def unpin(self) -> None:
        """End a `pin`; slots freed meanwhile are free again (their pages within the budget)."""
        self._pins -= 1
        if self.slab is not None and not self._pins:
            self.slab.let_go()
            self._trim_pages(self.budget)

    def rows_of(self, chunks: np.ndarray, local: np.ndarray) -> np.ndarray | None:
        """Where rows ``local`` of ``chunks`` lie in ``slab.rows`` (one gather serves them all),
        or None unless every chunk is held raw in the slab. Counts the hits as `get` does."""
        slab = self.slab
        if slab is None:
            return None
        slots = slab.locate(chunks)
        if slots is None:
            return None
        self._clock += 1
        for c in slab.chunks_of(np.flatnonzero(np.bincount(slots, minlength=slab.slots))):
            self._stamp[c] = self._clock
            self._items.move_to_end(c)
            if c in self._raw:
                self._raw.move_to_end(c)
            self.hits += 1
            self.bytes_read += self._items[c][2]
        return slots.astype(np.int64) * slab.chunk_rows + local

    def close(self) -> None:
        """Let go of every chunk and the slab (the store is closing)."""
        self._items.clear()
        self._raw.clear()
        self._loading.clear()
        self._stamp.clear()
        self._item_bytes = self._raw_copy_bytes = self.raw_bytes = self._loading_bytes = 0
        self._sorted = None
        if self.slab is not None:
            self.slab.close()
            self.slab = None

    @property
    def nbytes(self) -> int:
        """Bytes held: the chunks as kept, the decompressed copies and the slots being read
        into (what the budget bounds)."""
        return self._item_bytes + self._raw_copy_bytes + self._loading_bytes

    def __contains__(self, chunk: int) -> bool:
        return chunk in self._items

    def __len__(self) -> int:
        return len(self._items)

    def chunks(self) -> np.ndarray:
        """The chunks held now, sorted (for a vectorised membership test of a batch's chunks)."""
        if self._sorted is None:  # asked about once per call, changed once per chunk read
            self._sorted = np.sort(np.fromiter(self._items, np.int64, len(self._items)))
        return self._sorted

    def get(self, chunk: int) -> np.ndarray | None:
        """The chunk's records as a flat, read-only uint8 array, or None. Served without a copy
        where a raw form is held (a batch in `ChunkShuffleSampler` order takes 1/32 of a chunk's
        rows per hit: copying or decompressing the whole chunk each time cost 32 times the rows
        it served)."""
        item = self._items.get(chunk)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(chunk)
        self._clock += 1
        self._stamp[chunk] = self._clock
        self.hits += 1
        data, compressed, raw_len = item
        self.bytes_read += raw_len
        if not compressed:
            return data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        arr = self._raw.get(chunk)
        if arr is not None:
            self._raw.move_to_end(chunk)
            return arr
        arr = np.frombuffer(lz4.block.decompress(data, uncompressed_size=raw_len), dtype=np.uint8)
        return self._keep_raw(chunk, arr)

    def put(self, chunk: int, records: np.ndarray) -> None:
        """Keep a chunk's records (read whole). Records kept raw are copied into the slab, or
        where it has no room kept as they are: the caller must not change them afterwards."""
        if self.budget <= 0:
            return
        raw = _frozen(records)
        data: bytes | np.ndarray = raw
        compressed = False
        if self._skip:
            self._skip -= 1
        else:
            packed = lz4.block.compress(raw, store_size=False)
            compressed = raw.nbytes >= MIN_RATIO * len(packed)
            if compressed:
                data, self._incompressible = packed, 0
            else:
                self._incompressible += 1
                if self._incompressible >= GIVE_UP_AFTER:
                    self._incompressible, self._skip = 0, SKIP_PUTS
        size = _size(data)
        if size > self.budget:
            return
        self.discard(chunk)
        # room first, so that the raw form takes the slot of a chunk dropped for it (its pages
        # are reused, not given back and faulted in again)
        self._fit(self.budget - size - (raw.nbytes if compressed else 0))
        if not compressed:
            data = raw = self._keep(chunk, raw)
        self._add(chunk, data, compressed, raw.nbytes, size)
        if compressed:
            self._keep_raw(chunk, raw)  # just read for a batch: its next batches want it too
        self.shrink(self.budget)

    def _add(self, chunk: int, data: bytes | np.ndarray, compressed: bool, raw_len: int, size: int) -> None:
        """Hold ``data`` (``size`` bytes as kept) as ``chunk``'s records, most recently used."""
        self._items[chunk] = (data, compressed, raw_len)
        self._stamp[chunk] = self._clock
        self._sorted = None
        self._item_bytes += size
        self.bytes_written += size
        self.raw_bytes += raw_len

    def _keep_raw(self, chunk: int, arr: np.ndarray) -> np.ndarray:
        """Keep ``arr`` as the decompressed copy of a packed chunk where the budget has room
        beside the packed chunks; returns the records to serve now (``arr`` itself if not kept:
        a slot given up at once would be reused or given back under the caller)."""
        self._trim_raw(self.budget - arr.nbytes)
        if self.nbytes + arr.nbytes > self.budget:
            return arr
        arr = self._raw[chunk] = self._keep(chunk, arr)
        self._raw_copy_bytes += arr.nbytes
        self._trim_pages(self.budget)
        return arr

    def _trim_raw(self, limit: int) -> int:
        """Drop decompressed copies, oldest first, until the tier fits ``limit``."""
        freed = 0
        while self.nbytes > limit and self._raw:
            chunk, arr = self._raw.popitem(last=False)
            self._raw_copy_bytes -= arr.nbytes
            if self.slab is not None:
                self.slab.release(chunk)
            freed += arr.nbytes
        return freed

    def discard(self, chunk: int) -> None:
        item = self._items.pop(chunk, None)
        if item is not None:
            self._stamp.pop(chunk, None)
            self._sorted = None
            self._item_bytes -= _size(item[0])
            self.raw_bytes -= item[2]
        arr = self._raw.pop(chunk, None)
        if arr is not None:
            self._raw_copy_bytes -= arr.nbytes
        if self.slab is not None:
            self.slab.release(chunk)

    def patch(self, chunk: int, local: np.ndarray, records: np.ndarray) -> bool:
        """Write ``records`` over rows ``local`` of ``chunk``'s copy, so that it stays exact when
        those rows get a new record below the hot tier. Only a chunk held raw (rows that do not
        compress, as trained float rows mostly do not) is patched, in place where its memory is
        writable, else replaced by a writable copy once. A compressed chunk is not: compressing it
        again on every write kept allocating (a bounded-memory probe's RSS grew 5 MiB past its
        allowance) and keeping it raw instead grew it past the budget's slack, dropping the
        decompressed copies of other chunks. A reader of the store's own may be reading the copy
        meanwhile: rows read from whole chunks are always read again under the lock before use
        (`Tiers.moved_since`). True when done or the chunk is not held; False when it is
        held compressed (the caller drops it instead)."""
        item = self._items.get(chunk)
        if item is None:
            return True
        data, compressed, raw_len = item
        if compressed:
            return False
        raw = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        try:
            raw.flags.writeable = True
            target = raw
        except ValueError:  # over bytes (a chunk read into bytes)
            target = raw.copy()
        target.reshape(-1, records.shape[1])[local] = records
        target.flags.writeable = False
        if target is not data:
            self._items[chunk] = (target, False, raw_len)  # same place in the LRU order
            self._item_bytes += target.nbytes - _size(data)
        return True

    def discard_many(self, chunks: np.ndarray) -> None:
        if self._items:
            for c in idsets.unique(chunks).tolist():
                self.discard(c)

    def shrink(self, limit: int) -> int:
        """Drop decompressed copies, then least recently used chunks, until at most ``limit``
        bytes remain (the slab's pages included); return bytes freed."""
        freed = self._fit(limit)
        self._trim_pages(limit)
        return freed

    def _trim_pages(self, limit: int) -> None:
        """What is held outside the slab plus the slab's pages fit ``limit`` too."""
        if self.slab is not None:
            outside = self.nbytes - self.slab.placed_bytes - self._loading_bytes
            self.slab.trim(max(0, limit - outside))

    def _fit(self, limit: int) -> int:
        freed = self._trim_raw(limit)
        while self.nbytes > limit and self._items:
            chunk = next(iter(self._items))
            before = self.nbytes
            self.discard(chunk)
            freed += before - self.nbytes
        return freed

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self._item_bytes if self._item_bytes else 1.0


def _size(data: bytes | np.ndarray) -> int:
    return data.nbytes if isinstance(data, np.ndarray) else len(data)


def _frozen(records: np.ndarray) -> np.ndarray:
    """``records`` as a flat read-only uint8 array of exactly their bytes (a view where they own
    their memory; a copy where they are part of a larger buffer the tier must not keep alive)."""
    arr = np.ascontiguousarray(records).view(np.uint8).reshape(-1)
    base = arr
    while isinstance(base.base, np.ndarray):
        base = base.base
    owner = base.base
    if isinstance(owner, memoryview):  # np.frombuffer(bytearray(...)) keeps a memoryview of it
        owner = owner.obj if owner.nbytes == arr.nbytes else None
        sized = isinstance(owner, (bytes, bytearray)) and len(owner) == arr.nbytes
    else:
        sized = owner is None or (isinstance(owner, (bytes, bytearray)) and len(owner) == arr.nbytes)
    if not sized or base.nbytes != arr.nbytes:
        arr = arr.copy()  # a view of a larger buffer, or of memory the tier cannot size
    else:
        arr = arr.view()
    arr.flags.writeable = False
    return arr
