"""Read-only maps of base chunk files side by side in one reserved address range.

A `get` of rows below the hot tier whose blocks are in the page cache costs, read through
``pread`` or io_uring, a system call's worth of kernel work per row (~1 us), where
``numpy.memmap`` costs a copy (~0.2 us). Here each raw (or sparse) base chunk file is mapped
read-only (``MAP_SHARED | MAP_FIXED``) into its own slot of one address range reserved at start
(``PROT_NONE``, no memory behind it), so the byte address of any row of any mapped file is
``slot * stride + data offset + row * row_bytes`` and a whole batch over hundreds of files is
gathered by one vectorised ``take``: no per-row Python, no system call for a resident row (a
row not resident is read by the page fault, with the kernel's read-around, as memmap's are).

The maps hold page cache pages, not copies: the kernel reclaims them as any cached file page
(they are counted in the process's RSS while mapped, as memmap's are). A slot is unmapped only
when no read is in progress (`ChunkRows` defers it), so a gather never touches an address whose
mapping went away under it. Linux only (``usable`` is False elsewhere, or where the range cannot
be reserved): reads then go through ``pread``/io_uring as before.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

PAGE = mmap.PAGESIZE
_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_FAILED = ctypes.c_void_p(-1).value
#: files mapped at once: each map is one of the process's memory areas (Linux allows 65,530 by
#: default, ``vm.max_map_count``), and the rest of the process needs some
MAX_MAPPED = 16384

_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


class MappedFiles:
    """``slots`` slots of ``stride`` bytes each (a multiple of the page size), one file mapped per
    slot at most; ``rows`` is a read-only view of the whole range as overlapping records of
    ``row_bytes`` bytes starting at every byte, so ``rows.take(addresses)`` gathers records at any
    byte addresses of mapped slots. Callers must only ever index bytes of mapped files."""

    def __init__(self, slots: int, stride: int, row_bytes: int) -> None:
        self.usable = False
        self.slots, self.stride, self.row_bytes = slots, stride, row_bytes
        self.size = slots * stride
        self.mapped = np.zeros(slots, np.int64)  # generation of the file mapped in each slot, 0 if none
        self.count = 0
        self._base = 0
        if not sys.platform.startswith("linux") or slots <= 0 or stride % PAGE:
            return
        try:
            lib = _lib()
        except (OSError, AttributeError):
            return
        base = lib.mmap(None, self.size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base is None or base == _FAILED:
            return
        self._base = base
        raw = memoryview((ctypes.c_char * self.size).from_address(base)).cast("B")
        self.bytes = np.frombuffer(raw, np.uint8)  # (no memory is touched until a mapped byte is read)
        self.rows = np.ndarray((self.size - row_bytes + 1,), np.dtype((np.void, row_bytes)), raw, 0, (1,))
        self.view = raw  # (slices of a memoryview are the cheapest buffers to checksum)
        self.bytes.flags.writeable = False
        self.rows.flags.writeable = False
        self.usable = True

    def map(self, slot: int, fd: int, nbytes: int, gen: int) -> bool:
        """Map the first ``nbytes`` of file ``fd`` (generation ``gen``) into empty ``slot``;
        False if it does not fit or the system refused (the caller reads the file as before)."""
        if not self.usable or self.mapped[slot] or nbytes > self.stride or nbytes <= 0 or self.count >= MAX_MAPPED:
            return False
        addr = self._base + slot * self.stride
        got = _lib().mmap(addr, nbytes, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != addr:
            if got is not None and got != _FAILED:  # (MAP_FIXED never maps elsewhere; be safe)
                self._reserve(slot)
            return False
        self.mapped[slot] = gen
        self.count += 1
        return True

    def unmap(self, slot: int) -> None:
        """Put the slot back to reserved, unreadable address space (no read may be in progress)."""
        if self.usable and self.mapped[slot]:
            self._reserve(slot)
            self.mapped[slot] = 0
            self.count -= 1

    def _reserve(self, slot: int) -> None:
        addr = self._base + slot * self.stride
        got = _lib().mmap(addr, self.stride, _PROT_NONE,
                          _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
        if got != addr:  # cannot re-reserve: at least take the file's map away
            _lib().munmap(addr, self.stride)

    def resident_bytes(self) -> int:
        """Bytes of the maps now in this process's RSS (page cache pages mapped here, which the
        kernel reclaims as any cached file page): what a measure of the store's own memory
        subtracts from RSS. Reads /proc/self/smaps (a few ms: for tests and benchmarks)."""
        if not self.usable:
            return 0
        lo, hi = self._base, self._base + self.size
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, b = (int(x, 16) for x in head.split("-"))
                    inside = lo <= a and b <= hi
                elif inside and head == "Rss:":
                    total += int(line.split()[1]) * 1024
        return total

    def close(self) -> None:
        """Unmap everything (no read may be in progress)."""
        if self.usable:
            self.usable = False
            del self.rows, self.bytes, self.view
            _lib().munmap(self._base, self.size)
            self.mapped[:] = 0
            self.count = 0
