"""Page-level memory helpers: huge-page backed buffers and returning pages to the OS.

Random 512-byte row gathers are TLB-bound on virtual machines: the same gather ran 1.2-1.4x
(earlier VMs: 2.7-24x) faster from a buffer on transparent huge pages than from 4 KiB pages.
Anonymous mappings are also zero-filled lazily, so a large table costs nothing until a row is
touched.

*Private* buffers (a writable store's rows and bookkeeping) are not inherited by forked children
(``MADV_DONTFORK``). A DataLoader worker forked from the training process otherwise shares every
page of them copy-on-write: each page the training process writes afterwards is copied at its
first write (64 MiB of rows rewritten: 69 -> 471 ns per row on the first pass) and the worker
keeps the old copy for as long as it lives (256 MiB of rows rewritten beside one forked child:
+257 MiB of memory). A child cannot use a writable store anyway (`ForkedWriterError`); a
read-only handle, which workers may use, keeps ordinary buffers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref

import numpy as np
import numpy.typing as npt
import torch

HUGE_PAGE = 2 << 20
# Calls larger than this are resolved (and, in disk mode, served) in slices of this many rows, so
# one call's temporaries stay bounded whatever its batch (docs/store.md, "Memory").
SLICE_ROWS = 8192
_DONTFORK = getattr(mmap, "MADV_DONTFORK", None)
# Private mappings of this process (weak: closing a store frees them). A forked child has holes
# where they were, which its own new mappings may fill: it must never unmap them, so the child
# keeps them all referenced (`_keep_private_maps`).
_PRIVATE: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()
_KEPT_IN_CHILD: list = []


class PageBuffer:
    """A zero-filled anonymous mapping, advised onto huge pages where the kernel allows;
    ``private``: not inherited by forked children (see the module docstring)."""

    def __init__(self, nbytes: int, *, huge: bool = True, private: bool = False) -> None:
        self.nbytes = max(int(nbytes), 1)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._pid = os.getpid()
        self.huge = False
        if huge and self.nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except OSError:  # kernel without THP: ordinary pages still work
                pass
        self.private = False
        if private and _DONTFORK is not None:
            try:
                self._map.madvise(_DONTFORK)
                self.private = True
                _PRIVATE.add(self._map)
            except OSError:  # not Linux: children share the pages copy-on-write, as before
                pass
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def tensor(self, rows: int, row_bytes: int) -> torch.Tensor:
        return torch.from_numpy(self.array[: rows * row_bytes].reshape(rows, row_bytes))

    def release(self, start: int, length: int) -> None:
        """Give the pages of [start, start+length) back to the OS; they read as zeros afterwards."""
        page = mmap.PAGESIZE
        lo = (start + page - 1) // page * page
        hi = (start + length) // page * page
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        if self.private and os.getpid() != self._pid:
            return  # a forked child: nothing of it is mapped here (see `_keep_private_maps`)
        try:
            self._map.close()
        except BufferError:  # a tensor view still exported: the GC frees it with the view
            pass


def private_zeros(shape: tuple[int, ...] | int, dtype: npt.DTypeLike) -> np.ndarray:
    """Zeros like `zeros` (untouched pages cost nothing) that a forked child does not inherit."""
    count = int(np.prod(shape))
    itemsize = np.dtype(dtype).itemsize
    buf = PageBuffer(count * itemsize, huge=False, private=True)
    return buf.array[: count * itemsize].view(dtype).reshape(shape)


def _keep_private_maps() -> None:
    """In a forked child: keep every private mapping object alive, so that none is ever unmapped
    here (its address range is a hole in the child, which new mappings may reuse)."""
    _KEPT_IN_CHILD.extend(list(_PRIVATE))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_private_maps)


def zeros(shape: tuple[int, ...] | int, dtype: npt.DTypeLike) -> np.ndarray:
    """np.zeros is calloc: untouched pages stay unallocated (a sparse id map costs what it touches)."""
    return np.zeros(shape, dtype=dtype)


def _libc_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def trim_heap() -> None:
    """Return freed heap pages to the OS (glibc keeps them per thread arena otherwise).

    Chunk reads, write-backs and flushes on background threads free their buffers into those
    threads' arenas; without a trim the process RSS keeps that slack and drifts above the budget.
    Called after flushes and compactions, never on the per-step path.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
