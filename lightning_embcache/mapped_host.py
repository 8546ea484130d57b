"""A host table the GPU reads and writes in place: page-locked, mapped into the device's address space.

A memory-mode store keeps its whole table in one host buffer (slot == id). Registering that
buffer with CUDA (``cudaHostRegister``, mapped) lets a device kernel gather the rows of a batch
straight from it over PCIe and scatter evicted rows back, so a device tier smaller than the table
moves rows with two kernels a step and no host copy: the training thread's host work stays the
slot bookkeeping, whatever the rows' bytes. The registration pins the table's pages (they were
in RAM anyway); ``EMBCACHE_MAPPED_HOST=0`` turns it off (the tier then stages rows through pinned
buffers).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

#: cudaHostRegisterMapped | cudaHostRegisterPortable
_REGISTER_FLAGS = 2 | 1
#: madvise(MADV_POPULATE_WRITE) (Linux 5.14): back a range with writable pages, contents unchanged
_MADV_POPULATE_WRITE = 23
_POPULATE_PIECE = 64 << 20


def enabled() -> bool:
    """Whether the mapped path may be used (``EMBCACHE_MAPPED_HOST``, default on)."""
    return os.environ.get("EMBCACHE_MAPPED_HOST", "1") != "0"


class _Interface:
    """The minimal ``__cuda_array_interface__`` torch needs to alias device-visible memory."""

    def __init__(self, ptr: int, shape: tuple[int, int]) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class MappedHost:
    """``host`` (a contiguous CPU uint8 ``(rows, row_bytes)`` tensor) registered with CUDA;
    ``dev`` is the same memory as a CUDA tensor on ``device`` (unified addressing: the device
    pointer is the host pointer). Call `close` before the host memory is freed."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        if host.device.type != "cpu" or not host.is_contiguous() or host.dtype != torch.uint8 or host.dim() != 2:
            raise ValueError("MappedHost needs a contiguous 2-d uint8 CPU tensor")
        self.host = host
        self.device = device
        self._ptr = host.data_ptr()
        self._nbytes = host.numel()
        populate(self._ptr, self._nbytes)
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device):
            err = cudart.cudaHostRegister(self._ptr, self._nbytes, _REGISTER_FLAGS)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {self._nbytes} bytes failed (cudaError {int(err)})")
        self._registered = True
        with torch.cuda.device(device):
            self.dev = torch.as_tensor(_Interface(self._ptr, (int(host.shape[0]), int(host.shape[1]))), device=device)
        if self.dev.data_ptr() != self._ptr:  # no unified addressing: do not guess a translation
            self.close()
            raise RuntimeError("the device does not address registered host memory by its host pointer")
        self.words = wide(self.dev)

    def gather_into(self, pool: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """``pool[slots] = host[ids]`` by one kernel reading host memory over the bus."""
        wide(pool).index_copy_(0, slots, self.words.index_select(0, ids))

    def scatter_from(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """``host[ids] = rows`` (device records) by one kernel writing host memory over the bus."""
        self.words.index_copy_(0, ids, wide(rows))

    @classmethod
    def try_register(cls, host: torch.Tensor | None, device: torch.device) -> MappedHost | None:
        """`MappedHost` of ``host``, or None where it cannot be registered (then rows are staged)."""
        if host is None or not enabled() or host.numel() == 0:
            return None
        try:
            return cls(host, device)
        except Exception:  # no CUDA, no unified addressing, or the OS refused to lock the pages
            return None

    def close(self) -> None:
        """Unregister (the caller has waited for every kernel that uses `dev`)."""
        if self._registered:
            self._registered = False
            self.dev = self.words = torch.empty(0, dtype=torch.uint8)
            try:
                torch.cuda.cudart().cudaHostUnregister(self._ptr)
            except Exception:  # the memory may be gone already; nothing to give back then
                pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"MappedHost({self._nbytes} bytes on {self.device})"


def populate(ptr: int, nbytes: int) -> None:
    """Back ``[ptr, ptr + nbytes)`` with pages from all CPUs at once before it is registered:
    registering faults in every page of a lazily zeroed table on one thread, a few GB/s. Contents
    are unchanged (MADV_POPULATE_WRITE); where the kernel lacks it, registering faults them in."""
    if nbytes < 2 * _POPULATE_PIECE or not hasattr(os, "sched_getaffinity"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = (ptr + page - 1) // page * page
    end = (ptr + nbytes) // page * page

    def one(a: int) -> None:  # ctypes releases the GIL for the call
        libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(min(_POPULATE_PIECE, end - a)), _MADV_POPULATE_WRITE)

    with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0))), thread_name_prefix="embcache-populate") as ex:
        list(ex.map(one, range(start, end, _POPULATE_PIECE)))


def wide(records: torch.Tensor) -> torch.Tensor:
    """uint8 records ``(n, row_bytes)`` viewed as the widest integer words that divide a row: a
    kernel over mapped host memory then moves 8 bytes a thread, not 1 (bus transactions are
    per warp access, so narrow words waste most of each one)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if records.shape[1] % size == 0 and records.data_ptr() % size == 0:
            return records.view(dtype)
    return records


def store_table(store: Any) -> torch.Tensor | None:
    """The host tensor holding every record of ``store`` at its id (memory mode), or None."""
    get = getattr(store, "_resident_table", None)
    return get() if get is not None else None
