"""A dropped segment file kept for the next flush to overwrite, instead of deleted.

A large flush writes one segment file; compaction later folds it into the chunk files and the
file is garbage. Creating a file of a few hundred MiB and deleting one cost more than
overwriting blocks the file system already holds (no block allocation when the pages go out, no
discard of freed blocks at the journal commit a later ``fsync`` waits for; figures in
docs/benchmarks.md), so the writer keeps one dropped segment file here and the next flush writes
its segment over it (`fileio.write_parts(reuse=...)`), as RocksDB recycles its log files.

Crash safety is that of a new file: the pooled file carries a temporary name (``.segpool-*.tmp``,
which no manifest lists and a writable open deletes), a flush renames it to its own temporary
name, overwrites it, writes the header last, cuts it to length, ``fsync``s it and only then
renames it to ``s<seq>`` and publishes a manifest naming it. Whatever a crash or a power cut
leaves of a half-overwritten file lies under a temporary name; and a file's header is bound to
its name (`fileio.bound_crc`) and its records to the checksums in its directory, so old bytes are
never read as the new segment's.

Deleting a file is safe while someone reads it; overwriting it is not. A segment is pooled only
when no kept version lists it (the rule for deleting it), and a pooled file is reused only once
every read of this process that may have planned to read it has ended: reads planned without the
store's lock register in the file pool's epochs (recycle.FilePool), and pooling a file seals an
epoch (the reads planned after that see a layout without the segment).
"""

from __future__ import annotations

import os
import stat
import threading

from . import fileio
from .recycle import FilePool, rename_into_pool

SEGMENT_POOL_PREFIX = ".segpool-"  # with the ".tmp" suffix a writable open deletes leftovers of a crash


class SegmentPool:
    """At most `limit` dropped segment files in ``segments/``, kept for the next flush."""

    def __init__(self, dir_fd: int, epochs: FilePool) -> None:
        self._dir_fd = dir_fd
        self._epochs = epochs  # the chunk file pool's read epochs: every read registers there
        self._lock = threading.Lock()
        self._free: list[tuple[str, int, int]] = []  # (name, size, epoch from which it may be reused)
        self._names = 0
        self._pid = os.getpid()  # a forked child's copy never touches the writer's files
        self.limit = 1  # files kept at most (0: dropped segments are deleted at once)
        self.pooled = 0  # segment files kept instead of deleted
        self.reused = 0  # segment files overwritten instead of created

    def __len__(self) -> int:
        return len(self._free)

    def put(self, name: str) -> bool:
        """Move dropped segment file ``name`` into the pool (False: not moved, delete it instead);
        a full pool deletes its oldest file for it (the newest drop is the likeliest size of the
        next flush). The caller has published a layout that does not list it, and dropped its
        descriptors of the chunk files it pooled (`recycle.FilePool`) before calling: this seals
        a read epoch."""
        if self._dir_fd < 0 or self._pid != os.getpid() or self.limit < 1:
            return False
        try:
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode):  # a symlink planted there is deleted, never reused
            return False
        self._names += 1
        pooled = rename_into_pool(name, SEGMENT_POOL_PREFIX, self._names, self._dir_fd)
        if pooled is None:
            return False
        ready = self._epochs.seal()
        with self._lock:
            self._free.append((pooled, st.st_size, ready))
            self.pooled += 1
            old = [self._free.pop(0)[0] for _ in range(len(self._free) - self.limit)]
        for n in old:
            self._delete(n)
        return True

    def take(self, size: int) -> str | None:
        """A pooled file no read can reach any more for a segment of ``size`` bytes, or None. A
        file more than twice that size stays (cutting it to length would free most of it on the
        flush's time: a delete's cost, none of reuse's gain); the next drop replaces it."""
        if self._pid != os.getpid():
            return None
        with self._lock:
            if not self._free:
                return None
            name, held, ready = self._free[0]
            if held > 2 * size or self._epochs.reads_before(ready):
                return None
            del self._free[0]
            self.reused += 1
        return name

    def drain(self) -> None:
        """Delete every pooled file: disk use drops to what the versions hold."""
        if self._pid != os.getpid():
            self._free.clear()
            return
        while self._dir_fd >= 0:
            with self._lock:
                if not self._free:
                    return
                name = self._free.pop()[0]
            self._delete(name)

    def forget(self) -> None:
        """Keep nothing pooled and delete nothing (a store that met damage touches no file; the
        next writable open deletes the file with the other temporary ones)."""
        with self._lock:
            self._free.clear()

    def close(self) -> None:
        """Delete the pooled files; nothing is pooled after this (the folder's descriptor closes)."""
        self.drain()
        self.limit = 0
        self._dir_fd = -1

    def _delete(self, name: str) -> None:
        try:
            fileio.unlink(name, self._dir_fd)
        except OSError:
            pass  # a writable open deletes leftovers
