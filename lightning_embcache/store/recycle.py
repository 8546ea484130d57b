"""Replaced chunk files kept for reuse by the next compaction round, and who may still read them.

A pass of compaction rounds rewrites chunk files one round after another; each round's garbage
is the previous generation of the chunks it rewrote. Creating a file and deleting one cost more
than writing a chunk's bytes (this VM's ext4: 0.35 ms to create, 0.19 ms to delete a 512 KiB file,
0.09 ms to write it; a pass over a 244 MiB table spent half its CPU there), so a round renames
its garbage into a small pool and the next round overwrites those files in place (`fileio.
write_parts(reuse=...)`), as RocksDB recycles its log files.

Deleting a file is safe while someone reads it; overwriting is not. Files are pooled only when no
kept version uses them (the same rule as deleting: other processes read only versions they hold),
and a pooled file is overwritten only once every read of this process that could have reached it
has ended: each read of a chunk file registers the epoch it began in (`begin_read`), the store
drops its cached descriptors of the files it pools, then `seal` starts a new epoch; an entry is
reused once no read that began before its seal is still running (epoch-based reclamation).

The same registry keeps reads away from a chunk file that compaction folds in place (inplace.py):
`folding` waits until the synchronous reads of this process have ended, lets none begin while
the file's bytes and block checksums change, and bumps `inplace_seq` before and after (odd while
a file changes), so a read done by the kernel in the background (`begin_async_read`, the warm
tier's read-ahead) can tell that it may have seen the file mid-change and must not be used.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from . import fileio

FOLD_LOG = 4096  # files folded in place remembered (`unchanged_since`): more than a round folds
POOL_PREFIX = ".pool-"  # with the ".tmp" suffix a writable open deletes leftovers of a crash


def rename_into_pool(name: str, prefix: str, number: int, dir_fd: int) -> str | None:
    """Rename file ``name`` to this process's pool name ``<prefix><pid>-<number>.tmp`` (a name no
    manifest lists, which a writable open deletes); None where the rename failed."""
    pooled = f"{prefix}{os.getpid()}-{number}.tmp"
    try:
        fileio.rename(name, pooled, dir_fd)
    except OSError:
        return None
    return pooled


class FilePool:
    """Garbage chunk files awaiting reuse in one folder, and the epochs of the reads in flight."""

    def __init__(self, dir_fd: int) -> None:
        self._dir_fd = dir_fd
        self._lock = threading.Lock()
        self._epoch = 0
        self._reads: dict[int, int] = {}  # epoch -> reads begun in it and still running
        self._free: deque[tuple[str, int]] = deque()  # (name, epoch from which it may be reused)
        self._names = 0
        self.limit = 0  # files pooled at most (0: garbage is deleted at once)
        self.reused = 0  # files overwritten instead of created
        self._pid = os.getpid()  # a forked child's copy never touches the writer's files
        # In-place folds (inplace.py): synchronous reads running, a fold waiting for them or
        # writing, and the count of fold phases begun and ended (odd: a file is changing now).
        self._changed = threading.Condition(self._lock)
        self._sync_reads = 0
        self._folding = False
        self._depth = threading.local()  # synchronous reads this thread has open (nested reads go on)
        self.inplace_seq = 0
        # (inplace_seq while folding, chunk, gen) of the files folded in place lately, oldest
        # first, and the seq below which folds are forgotten (`unchanged_since`)
        self._fold_log: deque[tuple[int, int, int]] = deque()
        self._log_floor = 0

    def __len__(self) -> int:
        return len(self._free)

    # ---- reads -------------------------------------------------------------------------------
    def begin_read(self) -> int:
        """Register a read of chunk files that this thread runs now (ended by `end_read` on the
        same thread); it waits while compaction changes a file in place (`folding`)."""
        depth = getattr(self._depth, "n", 0)
        with self._lock:
            while self._folding and not depth:  # (a nested read goes on: its outer read holds the fold off)
                self._changed.wait()
            self._sync_reads += 1
            e = self._epoch
            self._reads[e] = self._reads.get(e, 0) + 1
        self._depth.n = depth + 1
        return e

    def end_read(self, epoch: int) -> None:
        self._depth.n = getattr(self._depth, "n", 1) - 1
        with self._lock:
            self._sync_reads -= 1
            if not self._sync_reads:
                self._changed.notify_all()
            self._end(epoch)

    def begin_async_read(self) -> int:
        """Register a read the kernel does in the background (ended by `end_async_read`, from
        any thread). It does not hold off in-place folds: its user compares `inplace_seq`
        before and after (`moved_since`)."""
        with self._lock:
            e = self._epoch
            self._reads[e] = self._reads.get(e, 0) + 1
            return e

    def end_async_read(self, epoch: int) -> None:
        with self._lock:
            self._end(epoch)

    def _end(self, epoch: int) -> None:  # (caller holds the lock)
        n = self._reads[epoch] - 1
        if n:
            self._reads[epoch] = n
        else:
            del self._reads[epoch]

    def moved_since(self, seq: int) -> bool:
        """Whether a chunk file may have changed in place since `inplace_seq` was ``seq``."""
        return bool(seq & 1) or self.inplace_seq != seq

    def note_folded(self, chunk: int, gen: int) -> None:
        """Chunk file (chunk, gen) changes in place now (inside `folding`)."""
        with self._lock:
            self._fold_log.append((self.inplace_seq, chunk, gen))
            if len(self._fold_log) > FOLD_LOG:
                self._log_floor = self._fold_log.popleft()[0] + 1

    def unchanged_since(self, seq: int, chunk: int, gen: int) -> int:
        """`inplace_seq` now where chunk file (chunk, gen) has not changed in place since
        `inplace_seq` was ``seq`` and is not changing now, else ``seq``: a background read of that
        file begun at ``seq`` is then as good as one begun now (a fold of another file meanwhile
        does not make it useless)."""
        with self._lock:
            now = self.inplace_seq
            if now & 1 or seq < self._log_floor:
                return seq
            for s, c, g in reversed(self._fold_log):
                if s < seq:
                    break
                if c == chunk and g == gen:
                    return seq
            return now

    @contextmanager
    def folding(self) -> Iterator[None]:
        """No synchronous read of this process runs inside: waits for those running, holds new
        ones off (caller holds no lock a reader may wait for: the store's lock is not held).
        Reads of the calling thread itself are not waited for: they are not running meanwhile."""
        own = getattr(self._depth, "n", 0)
        with self._lock:
            self._folding = True
            self.inplace_seq += 1
            while self._sync_reads > own:
                self._changed.wait()
        try:
            yield
        finally:
            with self._lock:
                self.inplace_seq += 1
                self._folding = False
                self._changed.notify_all()

    # ---- the pool (callers serialise: compaction and garbage collection hold the writer lock) --
    def room(self) -> int:
        return max(0, self.limit - len(self._free))

    def close(self) -> None:
        """Delete the pooled files; nothing is pooled after this (the folder's descriptor closes)."""
        self.drain()
        self.limit = 0
        self._dir_fd = -1

    def put(self, name: str) -> bool:
        """Move garbage file ``name`` into the pool (False: not moved, delete it instead). It is
        reusable after the next `seal`."""
        if not self.room() or self._dir_fd < 0 or self._pid != os.getpid():
            return False
        self._names += 1
        pooled = rename_into_pool(name, POOL_PREFIX, self._names, self._dir_fd)
        if pooled is None:
            return False
        with self._lock:
            self._free.append((pooled, self._epoch + 1))
        return True

    def seal(self) -> int:
        """The files pooled so far can no longer be reached by a read that begins from now on.
        Returns the new epoch (holes.py waits for the reads begun before it, as `take` does)."""
        with self._lock:
            self._epoch += 1
            return self._epoch

    def reads_before(self, epoch: int) -> bool:
        """Is a read begun before ``epoch`` still running?"""
        with self._lock:
            return self._reads_before(epoch)

    def _reads_before(self, epoch: int) -> bool:  # (caller holds the lock)
        return bool(self._reads) and min(self._reads) < epoch

    def take(self) -> str | None:
        """A pooled file no read can reach any more, or None."""
        with self._lock:
            if not self._free or self._pid != os.getpid():
                return None
            name, ready = self._free[0]
            if ready > self._epoch or self._reads_before(ready):
                return None
            self._free.popleft()
            self.reused += 1
            return name

    def adopt(self, names: list[str]) -> None:
        """Files another process's pool took for this one to overwrite (the compaction process):
        reusable at once, their reads were over when they were taken."""
        with self._lock:
            self._free.extend((n, 0) for n in names)

    def release(self) -> list[str]:
        """The pooled files not used, handed back (the compaction process ends a round)."""
        with self._lock:
            names = [n for n, _ in self._free]
            self._free.clear()
            return names

    def restore(self, names: list[str]) -> None:
        """Files given out by `take` and not used: reusable again at once."""
        with self._lock:
            self._free.extendleft((n, self._epoch) for n in reversed(names))

    def drain(self) -> None:
        """Delete every pooled file (a pass of rounds ended, or the store closes): disk use drops
        to what the versions hold."""
        if self._pid != os.getpid():
            self._free.clear()
            return
        while self._dir_fd >= 0:
            with self._lock:
                if not self._free:
                    return
                name, _ = self._free.popleft()
            try:
                fileio.unlink(name, self._dir_fd)
            except OSError:
                pass  # a writable open deletes leftovers
