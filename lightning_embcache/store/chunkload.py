"""ChunkLoader: announced chunks read whole into the warm tier's slab by kernel threads.

In `ChunkShuffleSampler` order every chunk of a window is wanted whole, and the training thread
used to read each one itself when its first row was asked for: the kernel's copy out of the
page cache (``preadv``, ~155 us per 512 KiB) and a copy into its slab slot (~100 us) - a quarter
of the time per row on a fast disk. Chunks that `LookaheadSampler` announces (`upcoming`) are
instead read straight into a reserved slab slot through io_uring with ``IOSQE_ASYNC``: a kernel
worker thread does the reading and the copy beside the training thread, which spends ~5 us a
chunk submitting, never holds up another thread for the GIL, and sees completions by looking at
the ring's memory. When a chunk is first wanted, its header and block checksums are checked (one
pass, blockcrc.py) and its newer delta records applied, then the warm tier serves it.

Each load holds a descriptor of its own and a read epoch of the file pool (recycle.py) until it
completes, so no file it reads is closed, reused or overwritten under it. Without io_uring (not
Linux, a kernel before 5.6, a seccomp filter), or in a forked child (the kernel writes the
parent's memory), nothing is read ahead this way: the store asks the kernel to read the chunks
into the page cache instead (`ChunkRows.will_need`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import idsets, uring
from .chunkrows import _OPEN_FLAGS, _chunk_name

MAX_LOADS = 64  # chunks in flight at most (32 MiB of 512 KiB chunks)
# Loads whose completion could not be awaited (the ring failed): the kernel may still write into
# their slots, so their memory stays mapped (held by these views) and the slots are never reused.
_ABANDONED: list = []


@dataclass
class Load:
    """One chunk file being read whole: its header into ``head``, its records into ``flat``."""

    chunk: int
    gen: int
    flat: np.ndarray  # the reserved slot's bytes (writable)
    head: np.ndarray  # header and directory
    fd: int
    epoch: int
    seq: int = 0  # the file pool's `inplace_seq` when the load began (a fold in place of it since: unusable)
    left: int = 2  # reads not completed yet
    ok: bool = True  # every read got all its bytes


class ChunkLoader:
    """The chunks of one store being read ahead into its warm tier (used under the store's lock)."""

    def __init__(self, disk, warm, max_loads: int = MAX_LOADS) -> None:
        self._disk = disk
        self._warm = warm
        self.max_loads = max_loads
        self._ring = uring.async_ring(2 * max_loads)
        self._pid = os.getpid()
        self._loads: dict[int, Load] = {}  # chunk -> its load in flight
        self._ready: list[Load] = []  # completed, not handed to the caller yet (`done`)
        self._refused: dict[int, int] = {}  # chunk -> generation not loaded ahead (not a dense raw file)

    @property
    def usable(self) -> bool:
        return self._ring is not None and os.getpid() == self._pid

    def __len__(self) -> int:
        return len(self._loads) + len(self._ready)

    def loading(self, chunks: np.ndarray) -> np.ndarray:
        """Per chunk of ``chunks``: read ahead and not taken in yet (in flight or completed)."""
        held = [*self._loads, *(ld.chunk for ld in self._ready)]
        if not held:
            return np.zeros(len(chunks), np.bool_)
        return idsets.isin(chunks, np.asarray(held, np.int64))

    def refuse(self, chunk: int, gen: int) -> None:
        """Never read this generation of ``chunk`` ahead again (not a dense raw chunk file, or it
        failed its checks: the store's own read names the problem)."""
        self._refused[chunk] = gen
        if len(self._refused) > 4096:
            self._refused.pop(next(iter(self._refused)))

    def start(self, chunks: list[int], gens: list[int]) -> set[int]:
        """Start reading these chunk files (generations ``gens``, all > 0) whole into reserved
        slab slots, as many as the warm tier has room for; returns the chunks now in flight."""
        if not self.usable:
            self._forget_forked()
            return set()
        disk, warm = self._disk, self._warm
        covered: set[int] = set()
        new: list[Load] = []
        try:
            for c, g in zip(chunks, gens):
                if c in self._loads or c in warm:  # (adopted since the caller looked)
                    covered.add(c)
                    continue
                if len(self._loads) + len(new) >= self.max_loads or self._refused.get(c) == g:
                    continue
                flat = warm.reserve(c, disk.chunk_rows_of(c) * disk.row_bytes)
                if flat is None:
                    break  # no room without dropping chunks in use: nor for the ones after it
                epoch = disk.pool.begin_async_read()  # before the open: a file pooled since is not found
                seq = disk.pool.inplace_seq  # a fold in place meanwhile makes the load useless
                try:
                    fd = os.open(_chunk_name(c, g), _OPEN_FLAGS, dir_fd=disk._chunks_fd)
                except OSError:  # replaced by a compaction meanwhile: the miss reads the new file
                    disk.pool.end_async_read(epoch)
                    warm.unreserve(c)
                    continue
                new.append(Load(c, g, flat, np.empty(disk.raw_chunk_data_offset(c), np.uint8), fd, epoch, seq))
        finally:
            if new:
                self._submit(new)
        return covered | {ld.chunk for ld in new}

    def _submit(self, new: list[Load]) -> None:
        n = len(new)
        fds = np.repeat(np.array([ld.fd for ld in new], np.int64), 2)
        addrs = np.empty(2 * n, np.uint64)
        lens = np.empty(2 * n, np.int64)
        offs = np.empty(2 * n, np.int64)
        tags = np.empty(2 * n, np.uint64)
        for i, ld in enumerate(new):
            addrs[2 * i], addrs[2 * i + 1] = ld.head.ctypes.data, ld.flat.ctypes.data
            lens[2 * i], lens[2 * i + 1] = len(ld.head), len(ld.flat)
            offs[2 * i], offs[2 * i + 1] = 0, len(ld.head)
            tags[2 * i], tags[2 * i + 1] = 2 * ld.chunk, 2 * ld.chunk + 1
        assert self._ring is not None  # (`usable`)
        try:
            self._ring.submit(fds, addrs, lens, offs, tags, uring._SQE_ASYNC)
        except BaseException:
            # The kernel took none of them, or some: wait for what it took, give back the rest.
            for ld in new:
                self._loads[ld.chunk] = ld
            self.cancel()
            raise
        for ld in new:
            self._loads[ld.chunk] = ld

    def done(self, wait_for: np.ndarray | Sequence[int] = ()) -> list[Load]:
        """Loads whose reads have completed since the last call (no system call unless it
        waits), after waiting for those of the chunks in ``wait_for`` that are in flight. Their
        slots stay reserved: the caller checks each and adopts or unreserves it. While compaction
        folds a file in place (in the background), loads not waited for are kept for a later call:
        the caller would have to throw them away (`FilePool.moved_since`), whatever file it folds."""
        if not self.usable:
            self._forget_forked()
            return []
        wanted = set(wait_for.tolist() if isinstance(wait_for, np.ndarray) else wait_for)
        need = {c for c in wanted if c in self._loads}
        while self._loads:
            # (an error here leaves the loads finished so far in ``_ready`` for the next call)
            assert self._ring is not None  # (`usable`)
            tags, res = self._ring.completed(wait=1 if need else 0)
            for t, r in zip(tags.tolist(), res.tolist()):
                ld = self._loads[t >> 1]
                if r != (len(ld.flat) if t & 1 else len(ld.head)):
                    ld.ok = False  # short (not a dense raw file) or an error: the miss reads it
                ld.left -= 1
                if not ld.left:
                    self._finish(ld)
                    need.discard(ld.chunk)
                    self._ready.append(ld)
            if not need:
                break
        pool = self._disk.pool
        out, later = [], []
        for ld in self._ready:
            if pool.inplace_seq & 1 and ld.chunk not in wanted:
                later.append(ld)
                continue
            ld.seq = pool.unchanged_since(ld.seq, ld.chunk, ld.gen)  # (a fold of another file leaves it usable)
            out.append(ld)
        self._ready = later
        return out

    def _finish(self, ld: Load) -> None:
        del self._loads[ld.chunk]
        os.close(ld.fd)
        self._disk.pool.end_async_read(ld.epoch)
        self._disk.bytes_read += len(ld.head) + len(ld.flat)

    def cancel(self) -> None:
        """Wait for every load in flight and give their slots back (before the warm tier's
        budget changes or the store closes)."""
        if not self.usable:
            self._forget_forked()
            return
        try:
            finished = self.done(list(self._loads))
            finished += self._ready  # (kept back for a fold in place)
            self._ready = []
        except OSError:  # the ring failed: never let the kernel write into memory reused meanwhile
            for c, ld in self._loads.items():
                _ABANDONED.append(ld)
                self._warm.unreserve(c, reuse=False)
            self._loads.clear()
            finished, self._ready = self._ready, []
        for ld in finished:
            self._warm.unreserve(ld.chunk)

    def close(self) -> None:
        self.cancel()
        if self._ring is not None and os.getpid() == self._pid:
            self._ring.close()
        self._ring = None

    def _forget_forked(self) -> None:
        """In a forked child: the kernel fills the parent's slots, never this copy's."""
        for c, ld in list(self._loads.items()):
            self._warm.unreserve(c)
            os.close(ld.fd)  # this process's copy of the descriptor
        self._loads.clear()
        for ld in self._ready:
            self._warm.unreserve(ld.chunk)
        self._ready = []
