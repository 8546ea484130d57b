"""Fault in the pages of a hot tier's pool ahead of their first use, on a background thread.

An anonymous mapping costs nothing until a page is first written; then the kernel allocates and
zeroes it inside that write. A hot tier fills slot by slot, so every batch that brings in new rows
pays those faults on the training thread: in `embcache demo` (1M x 64-dim rows, 61 MiB hot tier,
huge pages) the pool's first writes cost a median 14 us per batch but 159 us on average, the
outliers (a 2 MiB huge page allocated, zeroed and sometimes compacted for) adding up to a sixth
of the store's time until the tier was full. Here a daemon thread keeps the pages a little beyond
the highest slot handed out already faulted in, with ``madvise(MADV_POPULATE_WRITE)`` (Linux
5.14+; through ctypes, so the GIL is released meanwhile). The populate call changes no byte of
the buffer, so it may run while the training thread writes rows into it; it never goes past the
tier's usable slots (the memory budget), and `limit` waits for a running call before the tier
releases pages. Where the call is not supported the tier simply faults as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE
STEP = 2 << 20  # bytes populated per call: one huge page; limit/close wait for at most one call
AHEAD = 32 << 20  # bytes kept populated beyond the highest slot in use

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        try:
            f = ctypes.CDLL(None, use_errno=True).madvise
            f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            f.restype = ctypes.c_int
            _madvise = f
        except (OSError, AttributeError):  # not a libc with madvise: nothing to do
            _madvise = False
    return _madvise


class Prefault:
    """Keeps ``[0, used + ahead)`` of a buffer at ``addr`` (``nbytes`` long) populated, never
    past ``limit`` bytes. `want` is the hot-path call: one comparison unless
    the frontier moved past what was asked before."""

    def __init__(self, addr: int, nbytes: int, ahead: int = AHEAD) -> None:
        skew = int(addr) % PAGE  # a buffer from malloc starts past its page's start
        self._addr = int(addr) - skew
        self._skew = skew
        self._cap = int(nbytes) + skew
        self._ahead = int(ahead)
        self._asked = 0  # bytes asked for so far (read without the lock on the hot path)
        self._done = 0  # bytes [0, done) populated
        self._closed = not _libc_madvise()
        self._state = threading.Lock()  # short: the fields above
        self._work = threading.Lock()  # held by the thread during each madvise call
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.populated_calls = 0

    @property
    def populated(self) -> int:
        """Bytes populated so far (from the start of the buffer)."""
        return self._done

    def want(self, used: int) -> None:
        """The first ``used`` bytes are in use now: populate up to ``used + ahead`` (capped)."""
        used += self._skew
        if used + self._ahead // 2 <= self._asked or self._closed or self._forked():
            return
        with self._state:
            if self._closed:
                return
            self._asked = min(self._cap, used + self._ahead)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="embcache-prefault", daemon=True)
                self._thread.start()

    def limit(self, nbytes: int) -> None:
        """The buffer's usable bytes are now ``nbytes``: nothing past them is populated from now
        on (returns after any running call, so the caller may release the pages past them)."""
        if self._forked():
            return
        with self._work, self._state:
            self._cap = int(nbytes) + self._skew
            self._done = min(self._done, self._cap // PAGE * PAGE)
            self._asked = min(self._asked, self._cap)

    def close(self) -> None:
        """Stop populating: returns after any running call, and none starts after (the buffer may
        be unmapped then). The thread ends on its own; it is never joined, which from a finalizer
        at interpreter exit could wait forever for a daemon thread the runtime has stopped."""
        if self._forked():
            return
        with self._work, self._state:
            self._closed = True

    def _forked(self) -> bool:
        """In a forked child nothing populates (the parent's thread does not run here) and the
        locks are never taken (a copy may have been held by that thread at the fork)."""
        if self._pid == os.getpid():
            return False
        self._closed = True
        return True

    def _run(self) -> None:
        """Populate up to what was asked, then end (a later `want` starts another thread)."""
        madvise = _libc_madvise()
        while True:
            with self._work:
                with self._state:
                    lo = self._done
                    hi = min(lo + STEP, self._asked, self._cap)
                    if self._closed or hi <= lo:
                        self._thread = None
                        return
                if madvise(self._addr + lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                    with self._state:  # an older kernel (EINVAL) or no memory: fault as before
                        self._closed = True
                        self._thread = None
                    return
                self.populated_calls += 1
                with self._state:  # the next call starts on a page boundary
                    self._done = max(self._done, -(-hi // PAGE) * PAGE)
