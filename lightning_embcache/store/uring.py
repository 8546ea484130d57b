"""Many positional reads in one system call, through Linux io_uring (with a ``preadv`` fallback).

A disk-mode miss batch reads hundreds of rows scattered over many files. One ``preadv`` per row
costs a system call and a round of the interpreter each (~1 us here), and a thread issuing them
gives the GIL back and waits for it again on every read, so a background prefetch thread falls far
behind a busy training thread. Here a whole batch of reads is described in numpy arrays, written
into an io_uring submission queue in a few vectorised operations, and submitted and awaited by
one ``io_uring_enter`` call made through ctypes, which releases the GIL for the whole batch: rows in
the page cache are copied by the kernel inline, rows on disk are read with many in flight.

Where io_uring is not available (not Linux, a kernel before 5.6, ``kernel.io_uring_disabled``, a
seccomp filter) `read_into` falls back to one ``preadv`` per read, driven by ``map``.

Each thread has its own ring (a ring is not thread-safe); a forked child makes its own rings (a
ring shared with the parent would mix the two processes' completions).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import threading

import numpy as np

ENTRIES = 1024  # reads per submission (a larger batch is submitted in rounds)

_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427  # the same on every Linux architecture (new table)
_REGISTER_PROBE = 8
_OP_SUPPORTED = 1
_OP_READ = 22
_ENTER_GETEVENTS = 1
_SQE_ASYNC = 1 << 4  # IOSQE_ASYNC (5.6): never tried inline, always a kernel worker's
_FEAT_SINGLE_MMAP = 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000

_SQE = np.dtype({"names": ["opcode", "flags", "ioprio", "fd", "off", "addr", "len", "rw_flags", "user_data"],
                 "formats": [np.uint8, np.uint8, np.uint16, np.int32, np.uint64, np.uint64, np.uint32,
                             np.uint32, np.uint64],
                 "offsets": [0, 1, 2, 4, 8, 16, 24, 28, 32], "itemsize": 64})
_CQE = np.dtype({"names": ["user_data", "res", "flags"], "formats": [np.uint64, np.int32, np.uint32],
                 "offsets": [0, 8, 12], "itemsize": 16})

_libc = None
# The rings' head and tail words are read and written as plain memory, without the acquire/release
# barriers liburing issues: correct under x86-64's total store order only, so io_uring is used on
# x86-64 alone and other machines take the pread path.
_disabled = (not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64")
             or os.environ.get("EMBCACHE_NO_IO_URING") == "1")


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


class _Ring:
    """One io_uring instance (single-threaded use)."""

    def __init__(self, entries: int) -> None:
        syscall = _syscall()
        params = (ctypes.c_uint32 * 30)()
        fd = syscall(ctypes.c_long(_SYS_SETUP), ctypes.c_uint32(entries), params)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = int(fd)
        self._pid = os.getpid()
        self._maps: list[mmap.mmap] = []
        try:
            p = np.frombuffer(params, np.uint32)  # type: ignore[call-overload]  # a ctypes buffer
            sq_entries, cq_entries, features = int(p[0]), int(p[1]), int(p[5])
            sq_off, cq_off = p[10:20], p[20:30]
            sq_size = int(sq_off[6]) + sq_entries * 4
            cq_size = int(cq_off[5]) + cq_entries * 16
            if features & _FEAT_SINGLE_MMAP:
                sq_size = cq_size = max(sq_size, cq_size)
            sq = self._map(sq_size, _OFF_SQ_RING)
            cq = sq if features & _FEAT_SINGLE_MMAP else self._map(cq_size, _OFF_CQ_RING)
            sqes = self._map(sq_entries * 64, _OFF_SQES)
            u32 = lambda m, off: np.frombuffer(m, np.uint32, 1, int(off))  # noqa: E731
            self.sq_head, self.sq_tail = u32(sq, sq_off[0]), u32(sq, sq_off[1])
            self.sq_mask = int(u32(sq, sq_off[2])[0])
            self.sq_array = np.frombuffer(sq, np.uint32, sq_entries, int(sq_off[6]))
            self.cq_head, self.cq_tail = u32(cq, cq_off[0]), u32(cq, cq_off[1])
            self.cq_mask = int(u32(cq, cq_off[2])[0])
            self.cqes = np.frombuffer(cq, _CQE, cq_entries, int(cq_off[5]))
            self.sqes = np.frombuffer(sqes, _SQE, sq_entries)
            # The same memory as 64-bit words: a batch is written a column at a time into
            # contiguous ring slots (a structured gather, eight field writes and a scatter back
            # would cost about half of what the kernel takes to serve a read from the page cache)
            self.sqe_words = np.frombuffer(sqes, np.uint64, sq_entries * 8).reshape(sq_entries, 8)
            self.cqe_words = np.frombuffer(cq, np.uint64, cq_entries * 2, int(cq_off[5])).reshape(cq_entries, 2)
            self.cq_entries = cq_entries
            self.entries = sq_entries
            # entry i of the submission array always names ring slot i
            self.sq_array[:] = np.arange(sq_entries, dtype=np.uint32)
            self._check_read_supported()
        except BaseException:
            self.close()
            raise

    def _check_read_supported(self) -> None:
        """Refuse a kernel whose io_uring lacks the read operation (5.1-5.5 have io_uring but
        not IORING_OP_READ, which came with the probe in 5.6): asked through IORING_REGISTER_PROBE,
        so such a kernel (or a filter refusing the probe) makes the store use preadv."""
        ops = 256
        probe = (ctypes.c_uint8 * (16 + 8 * ops))()
        got = _syscall()(ctypes.c_long(_SYS_REGISTER), ctypes.c_int(self.fd), ctypes.c_uint32(_REGISTER_PROBE),
                         probe, ctypes.c_uint32(ops))
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_register(PROBE): {os.strerror(err)}")
        raw = np.frombuffer(probe, np.uint8)  # type: ignore[call-overload]  # a ctypes buffer
        last_op = int(raw[0])
        flags = int(np.frombuffer(probe, np.uint16, 1, 16 + 8 * _OP_READ + 2)[0])  # type: ignore[call-overload]
        if last_op < _OP_READ or not flags & _OP_SUPPORTED:
            raise OSError(95, "io_uring without IORING_OP_READ")  # EOPNOTSUPP

    def __del__(self) -> None:
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.close()
        except Exception:
            pass

    def _map(self, size: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(self.fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self._maps.append(m)
        return m

    def close(self) -> None:
        for name in ("sq_head", "sq_tail", "sq_array", "cq_head", "cq_tail", "cqes", "sqes", "sqe_words", "cqe_words"):
            self.__dict__.pop(name, None)  # numpy views first: a map with exported views cannot close
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _queue(self, fds: np.ndarray, addrs: np.ndarray, lens: np.ndarray, offs: np.ndarray, tags: np.ndarray,
               sqe_flags: int = 0, rw_flags: int = 0) -> None:
        """Write at most ``entries`` reads into the submission queue (the next `_enter_raw` hands
        them to the kernel); their completions carry ``tags``."""
        n = len(fds)
        words = self.sqe_words
        tail = int(self.sq_tail[0])
        first = tail & self.sq_mask
        # they go to slots first.. (wrapping to 0): at most two contiguous runs of slots
        for x, y, slot in ((0, min(n, self.entries - first), first), (self.entries - first, n, 0)):
            if y <= x:
                continue
            w = words[slot : slot + y - x]
            # word 0: opcode | sqe flags | ioprio 0 | fd; 1: offset; 2: address; 3: length |
            # rw_flags; 4: user_data (the tag); 5-7 stay zero
            w[:, 0] = ((fds[x:y].astype(np.uint64) << np.uint64(32)) | np.uint64(_OP_READ)
                       | np.uint64(sqe_flags << 8))
            w[:, 1] = offs[x:y]
            w[:, 2] = addrs[x:y]
            w[:, 3] = lens[x:y].astype(np.uint64) | (np.uint64(rw_flags) << np.uint64(32))
            w[:, 4] = tags[x:y]
        self.sq_tail[0] = np.uint32((tail + n) & 0xFFFFFFFF)

    def read(self, fds: np.ndarray, addrs: np.ndarray, lens: np.ndarray, offs: np.ndarray,
             rw_flags: int = 0) -> np.ndarray:
        """Bytes read by each request (or -errno); every request completed when it returns."""
        n = len(fds)
        res = np.empty(n, np.int64)
        for a in range(0, n, self.entries):
            b = min(n, a + self.entries)
            self._queue(fds[a:b], addrs[a:b], lens[a:b], offs[a:b], np.arange(a, b, dtype=np.uint64),
                        rw_flags=rw_flags)
            todo = b - a
            try:
                while todo:
                    todo -= self._enter(todo, res)
            except BaseException:
                # Never leave a read in flight into a buffer the caller may free (an interrupt, an
                # unexpected error): wait for every submitted request first, then give up the ring.
                self._drain(todo, res)
                raise
        return res

    def _enter(self, todo: int, res: np.ndarray, strict: bool = True) -> int:
        """Submit what the kernel has not taken yet, wait for completions; returns how many came."""
        self._enter_raw(todo, strict)
        tags, results = self.completed()
        res[tags.astype(np.int64)] = results
        return len(tags)

    def _drain(self, todo: int, res: np.ndarray) -> None:
        global _disabled
        tries = 0
        while todo > 0 and tries < 1000:
            try:
                n = self._enter(todo, res, strict=False)
            except BaseException:  # another interrupt: keep waiting, the buffer is still in use
                n = 0
            todo -= n
            tries += 0 if n else 1
        if todo > 0:  # the kernel still holds requests: this ring (and its buffers) must not be reused
            _disabled = True

    # ---- reads left in flight (`async_ring`; chunkload.py) -------------------------------------
    def submit(self, fds: np.ndarray, addrs: np.ndarray, lens: np.ndarray, offs: np.ndarray,
               tags: np.ndarray, sqe_flags: int = 0) -> None:
        """Queue reads and hand them to the kernel without waiting; their completions carry
        ``tags``. The caller keeps the buffers alive and never has more reads in flight than
        the completion queue holds."""
        if len(fds) > self.entries:
            raise ValueError(f"at most {self.entries} reads at once; got {len(fds)}")
        self._queue(fds, addrs, lens, offs, tags, sqe_flags=sqe_flags)
        while (int(self.sq_tail[0]) - int(self.sq_head[0])) & 0xFFFFFFFF:
            self._enter_raw(0)

    def _enter_raw(self, wait: int, strict: bool = True) -> None:
        """Hand the kernel what it has not taken yet (it moves the SQ head as it takes them) and
        wait for ``wait`` completions."""
        submit = (int(self.sq_tail[0]) - int(self.sq_head[0])) & 0xFFFFFFFF
        got = _syscall()(ctypes.c_long(_SYS_ENTER), ctypes.c_int(self.fd), ctypes.c_uint32(submit),
                         ctypes.c_uint32(wait), ctypes.c_uint32(_ENTER_GETEVENTS if wait else 0), None,
                         ctypes.c_size_t(0))
        if got < 0:
            err = ctypes.get_errno()
            if strict and err not in (4, 11, 16):  # EINTR, EAGAIN, EBUSY: reap what completed, go on
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    def completed(self, wait: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(tags, results) of the reads completed since the last call: bytes read, or -errno.
        ``wait``: first wait until at least that many completions are there (no system call
        where they already are)."""
        if wait and ((int(self.cq_tail[0]) - int(self.cq_head[0])) & 0xFFFFFFFF) < wait:
            self._enter_raw(wait)
        head, ctail = int(self.cq_head[0]), int(self.cq_tail[0])
        done = (ctail - head) & 0xFFFFFFFF
        if not done:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        h = head & self.cq_mask
        first = min(done, self.cq_entries - h)
        part = self.cqe_words[h : h + done] if first == done else np.concatenate(
            [self.cqe_words[h : h + first], self.cqe_words[: done - first]])
        # word 0: user_data; word 1: res (low 32 bits, signed) | flags; copied before the slots go back
        tags, results = part[:, 0].copy(), part[:, 1].astype(np.uint32).view(np.int32).astype(np.int64)
        self.cq_head[0] = np.uint32(ctail)
        return tags, results


_local = threading.local()  # a thread's ring closes with the thread (its locals are dropped)


def _ring() -> _Ring | None:
    global _disabled
    if _disabled:
        return None
    r = getattr(_local, "ring", None)
    pid = os.getpid()
    if r is not None and getattr(_local, "pid", None) == pid:
        return r
    try:
        r = _Ring(ENTRIES)
    except (OSError, AttributeError, ValueError):
        _disabled = True  # not available here: the preadv path from now on
        return None
    _local.ring, _local.pid = r, pid
    return r


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 8)


def async_ring(entries: int) -> _Ring | None:
    """A ring of the caller's own for reads left in flight (`_Ring.submit`, `_Ring.completed`),
    or None where io_uring is not available. Single-threaded use; useless in a forked child."""
    if _disabled:
        return None
    try:
        return _Ring(entries)
    except (OSError, AttributeError, ValueError):
        return None


def available() -> bool:
    """Whether reads go through io_uring in this process."""
    return _ring() is not None


def read_into(out: np.ndarray, dst: np.ndarray, fds: np.ndarray, lens: np.ndarray, offs: np.ndarray,
              counts: list | None = None) -> np.ndarray:
    """Read ``lens[i]`` bytes at ``offs[i]`` of file ``fds[i]`` into the flat uint8 array ``out`` at byte
    ``dst[i]``, all at once; returns the bytes each read got (short means the file ended).

    ``counts``: a list ``[reads, reads the page cache did not hold]`` to add this call's numbers to
    (through io_uring only: the preadv fallback cannot tell, and adds nothing)."""
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("read_into needs a writable C-contiguous output array")
    ring = _ring()
    if ring is None or len(fds) < 2:
        mv = out.reshape(-1).data
        bufs = [[mv[o : o + k]] for o, k in zip(dst.tolist(), lens.tolist())]
        return np.asarray(list(map(os.preadv, fds.tolist(), bufs, offs.tolist())), np.int64)
    base = out.ctypes.data
    addrs = base + dst.astype(np.uint64)
    # First only from the page cache (RWF_NOWAIT: a row not cached fails at once); what did not
    # come (or came in part) is read again, waiting for the disk. The split tells how many reads
    # the page cache served (``counts``), at no extra cost when it served all of them.
    res = ring.read(fds, addrs, lens, offs, _RWF_NOWAIT)
    again = np.flatnonzero(res != lens)
    if counts is not None:
        counts[0] += len(fds)
        counts[1] += len(again)
    if len(again):
        res[again] = ring.read(fds[again], addrs[again], lens[again], offs[again])
    bad = res < 0
    if bad.any():
        err = int(-res[np.flatnonzero(bad)[0]])
        raise OSError(err, os.strerror(err))
    return res
