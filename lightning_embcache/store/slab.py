"""ChunkSlab: the warm tier's raw chunks in fixed slots of one memory map.

A batch in `ChunkShuffleSampler` order takes a few rows from each of the W chunks of its window,
all held warm. Kept as separate arrays, each chunk cost a gather of its own, a plan and a
reordering per batch (about half of a get). In one slab, slot ``s`` holding chunk ``c``, row
``r`` of that chunk is row ``s * chunk_rows + r`` of one array: a whole batch is one gather in
request order (`EmbeddingStore.get`'s warm path).

Slots freed while ``hold`` is set (a plan or a reader without the store's lock holds views of
the slab: `WarmTier.pin`) are reused only once `let_go` is called. Pages of free slots are given back to the system when
the tier must shrink (`trim`), so the slab never holds more than the warm budget allows.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(
    mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class ChunkSlab:
    def __init__(self, chunk_rows: int, row_bytes: int, slots: int, num_chunks: int, hold: bool = False) -> None:
        self.chunk_rows, self.row_bytes = chunk_rows, row_bytes
        self.chunk_bytes = chunk_rows * row_bytes
        self.slots = slots
        # anonymous, private, not reserved: pages come on first write (a budget is an upper bound)
        self._map = mmap.mmap(-1, max(1, slots * self.chunk_bytes), flags=_FLAGS)
        self.rows = np.frombuffer(self._map, np.uint8, slots * self.chunk_bytes).reshape(-1, row_bytes)
        self.slot_of = np.full(num_chunks, -1, np.int32)  # chunk -> slot, -1 where not here
        self._chunk_of = [-1] * slots
        self._free: list[int] = list(range(slots - 1, -1, -1))  # touched slots last in: reused first
        self._touched = np.zeros(slots, np.bool_)
        self._n_touched = 0
        self._limbo: list[int] = []  # freed while ``hold``
        self.hold = hold
        self._sizes = [0] * slots
        self.placed_bytes = 0  # bytes of the records in the slots

    def close(self) -> None:
        self.rows = np.empty((0, self.row_bytes), np.uint8)
        try:
            self._map.close()
        except BufferError:  # a view still exported (a caller's array): freed with it
            pass

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def touched_bytes(self) -> int:
        """Bytes of slots written since their pages were last given back (what the slab holds)."""
        return self._n_touched * self.chunk_bytes

    def place(self, chunk: int, records: np.ndarray) -> np.ndarray | None:
        """Copy a chunk's records (flat uint8, at most a slot) into a free slot; a read-only view
        of them there, or None if no slot is free."""
        self.release(chunk)
        if records.nbytes > self.chunk_bytes:
            return None
        got = self.reserve()
        if got is None:
            return None
        slot, flat = got
        flat[: records.nbytes] = records.reshape(-1)
        return self.fill(chunk, slot, records.nbytes)

    def reserve(self) -> tuple[int, np.ndarray] | None:
        """A free slot taken for a chunk being read into it (`ChunkLoader`): (slot, its writable
        flat bytes), or None if none is free. It serves nothing until `fill`, and goes back with
        `unreserve`."""
        if not self._free:
            return None
        s = self._free.pop()
        self._n_touched += not self._touched[s]
        self._touched[s] = True  # the kernel writes its pages
        return s, self.rows[s * self.chunk_rows : (s + 1) * self.chunk_rows].reshape(-1)

    def fill(self, chunk: int, slot: int, nbytes: int) -> np.ndarray:
        """A reserved slot now holds ``chunk``'s ``nbytes`` of records: a read-only view of them."""
        self.release(chunk)
        self.slot_of[chunk] = slot
        self._chunk_of[slot] = chunk
        self._sizes[slot] = nbytes
        self.placed_bytes += nbytes
        view = self.rows[slot * self.chunk_rows : (slot + 1) * self.chunk_rows].reshape(-1)[:nbytes].view()
        view.flags.writeable = False
        return view

    def unreserve(self, slot: int) -> None:
        """A reserved slot that was never filled is free again (nobody saw its bytes)."""
        self._free.append(slot)

    def release(self, chunk: int) -> None:
        s = int(self.slot_of[chunk])
        if s < 0:
            return
        self.slot_of[chunk] = -1
        self._chunk_of[s] = -1
        self.placed_bytes -= self._sizes[s]
        (self._limbo if self.hold else self._free).append(s)

    def locate(self, chunks: np.ndarray) -> np.ndarray | None:
        """Slot of each of ``chunks``, or None if any is not in the slab."""
        slots = self.slot_of[chunks]
        return None if (slots < 0).any() else slots

    def chunks_of(self, slots: np.ndarray) -> list[int]:
        """The chunks in ``slots`` (distinct slots)."""
        return [self._chunk_of[s] for s in slots.tolist()]

    def let_go(self) -> None:
        """No view is held any more: slots freed meanwhile are free."""
        self.hold = False
        self._free.extend(self._limbo)
        self._limbo = []

    def trim(self, limit: int) -> int:
        """Give back the pages of free slots until the slab holds at most ``limit`` bytes;
        returns the bytes given back."""
        freed = 0
        if _DONTNEED is None:
            return 0
        for s in self._free:
            if self.touched_bytes <= limit:
                break
            if self._touched[s]:
                lo = -(-s * self.chunk_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only
                hi = (s + 1) * self.chunk_bytes // mmap.PAGESIZE * mmap.PAGESIZE
                if hi > lo:
                    self._map.madvise(_DONTNEED, lo, hi - lo)
                self._touched[s] = False
                self._n_touched -= 1
                freed += self.chunk_bytes
        if freed:  # slots still holding pages are reused first
            self._free.sort(key=lambda s: self._touched[s])
        return freed
