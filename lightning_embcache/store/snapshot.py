"""The records of a flush's dirty rows as they were when it began, read block by block.

A flush of many dirty rows writes them in blocks (`Disk.write_segment`), so it holds one or two
blocks in memory instead of a copy of every dirty row, yet writes one consistent moment: a row
updated while the flush is writing first saves its old record here (`save`, copy-on-write).

Blocks are gathered straight into the writer's buffer (`read_into`): the gather is the only copy
of a row before the file, and the buffers are reused block after block (a fresh array per block
costs a page fault per 4 KiB on its first touch).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from . import idsets


class Snapshot:
    """Copy-on-write snapshot of the records in ``slots`` of a pool of records.

    ``pool`` returns the pool's array (C-contiguous, one record per row) when called under
    ``lock``; ``saved`` maps a slot to its record when the snapshot began, filled by whoever
    overwrites a row still being written out (`Tiers.save_cow`).
    """

    def __init__(self, lock: AbstractContextManager[Any], pool: Callable[[], np.ndarray],
                 slots: np.ndarray, saved: dict[int, np.ndarray]) -> None:
        self._lock = lock
        self._pool = pool
        self._slots = slots
        self._saved = saved

    def read_into(self, a: int, b: int, out: np.ndarray) -> np.ndarray:
        """The records of ``slots[a:b]`` written into the first ``b - a`` rows of ``out``
        (returned: that part of it)."""
        part = self._slots[a:b]
        dst = out[: b - a]
        with self._lock:
            # mode="clip": the slots are valid, and with mode="raise" numpy buffers `out` through
            # a temporary copy of the whole result
            np.take(self._pool(), part, axis=0, out=dst, mode="clip")
            saved = self._saved
            if saved:
                keys = np.fromiter(saved, np.int64, len(saved))
                for pos in np.flatnonzero(idsets.isin(part, keys)).tolist():
                    dst[pos] = saved[int(part[pos])]
        return dst
