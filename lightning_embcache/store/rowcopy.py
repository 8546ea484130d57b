"""Gathers and scatters of many whole records, split over a few threads.

A batch of records scattered over a large table costs memory latency, not bandwidth: one thread
waits on one row's cache and TLB misses at a time. NumPy releases the GIL inside `take` and
fancy assignment, so a few threads keep several rows in flight (the device tier moves thousands
of records per step between host RAM and the GPU). Small batches stay on the calling thread.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

#: batches below this many rows are copied on the calling thread
PARALLEL_MIN_ROWS = 2048
#: at most this many threads (and never more than the machine's cores)
MAX_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def np_dtype(dtype: torch.dtype) -> np.dtype:
    # bfloat16 has no numpy dtype: move its bits as int16
    return np.dtype(np.int16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _executor() -> tuple[ThreadPoolExecutor | None, int]:
    global _pool, _pool_pid
    n = min(MAX_THREADS, os.cpu_count() or 1)
    if n < 2:
        return None, 1
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():  # threads do not survive a fork
            _pool = ThreadPoolExecutor(n, thread_name_prefix="embcache-rowcopy")
            _pool_pid = os.getpid()
    return _pool, n


def _spans(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // parts)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def gather(table: np.ndarray, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``table[idx]`` for a C-contiguous 2-D ``table``, into ``out`` if given."""
    if out is None:
        out = np.empty((len(idx), table.shape[1]), table.dtype)
    pool, n = _executor() if len(idx) >= PARALLEL_MIN_ROWS else (None, 1)
    # mode="clip": the ids are validated already, and with mode="raise" (the default) numpy
    # buffers `out` through a temporary copy of the whole result
    if pool is None:
        np.take(table, idx, axis=0, out=out, mode="clip")
        return out
    list(pool.map(lambda ab: np.take(table, idx[ab[0]:ab[1]], axis=0, out=out[ab[0]:ab[1]], mode="clip"),
                  _spans(len(idx), n)))
    return out


def scatter(table: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> None:
    """``table[idx] = rows`` for ids that are unique (the parts may run in any order)."""
    pool, n = _executor() if len(idx) >= PARALLEL_MIN_ROWS else (None, 1)
    if pool is None:
        table[idx] = rows
        return

    def part(ab: tuple[int, int]) -> None:
        table[idx[ab[0]:ab[1]]] = rows[ab[0]:ab[1]]

    list(pool.map(part, _spans(len(idx), n)))
