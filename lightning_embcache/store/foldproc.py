"""Compaction rounds folded in a child process.

A fold is CPU work (merging delta rows into chunks, a checksum per 4 KiB block, copies into the
page cache) and dozens of system calls per chunk. In the training process it ran under the GIL
beside the training thread: every system call handed the GIL over and waited to get it back, so a
background pass crawled (a 0.3 s pass took 46 s beside a busy Python thread) and the flushes that
came meanwhile had to fold the rest on the training thread (about a quarter of a disk-mode epoch
at 500K x 128). A child process folds on another core and holds no lock the trainer needs.

The child imports only numpy, lz4 and the store's file modules (never torch: ~40 MiB, started
in ~0.2 s). It writes chunk files of a generation the parent reserved and makes them durable; the
parent alone publishes (chunk map, manifest) and collects garbage, exactly as for a round folded
in its own thread. Files of a generation never published are garbage to the next writable open,
so a crash of either process at any instant loses nothing. The child dies with its parent
(``PR_SET_PDEATHSIG`` and a check of its parent before each chunk); a child that fails or dies
only sends the round back to the parent's own thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from socket import socketpair
from typing import Any

from .errors import InvalidArgumentError

# Tables smaller than this fold in the store's own thread: their passes are short, and a process
# per small store (tests, many little stores) would cost more than it saves.
MIN_TABLE_BYTES = 64 << 20
# EMBCACHE_COMPACTION_PROCESS: "auto" (tables of MIN_TABLE_BYTES or more), "always" or "never"
# (a single-core machine, or a sandbox that forbids starting processes).
ENV = "EMBCACHE_COMPACTION_PROCESS"


START_WAIT_S = 5.0  # a background pass waits this long at most for a child still starting


def setting() -> str:
    """The EMBCACHE_COMPACTION_PROCESS setting; a value it cannot be is named."""
    mode = os.environ.get(ENV, "auto").strip().lower()
    if mode not in ("auto", "always", "never"):
        raise InvalidArgumentError(f"environment variable {ENV}={mode!r}: use 'auto', 'always' or 'never'")
    return mode


def wanted(table_bytes: int) -> bool:
    """Whether a writable disk store of ``table_bytes`` folds in a compaction process."""
    mode = setting()
    return mode == "always" or (mode == "auto" and table_bytes >= MIN_TABLE_BYTES)

_BOOT = (
    "import sys, types, json\n"
    "cfg = json.loads(sys.argv[1])\n"
    "sys.path[:] = cfg['sys_path']\n"
    "pkg = types.ModuleType('_embcache_fold')\n"
    "pkg.__path__ = [cfg['package']]\n"
    "sys.modules['_embcache_fold'] = pkg\n"
    "from _embcache_fold.foldproc import serve\n"
    "serve(cfg, int(sys.argv[2]))\n"
)


class FoldProcess:
    """The parent's handle on one store's compaction process."""

    def __init__(self, root: Path, num_rows: int, chunk_rows: int, row_bytes: int, uid: bytes, *,
                 unbound: bool = True) -> None:
        self._pid = os.getpid()
        self._broken = False
        self._ready = False
        self._hello_lock = threading.Lock()
        self.base_rss = 0
        mine, theirs = socketpair()
        cfg = {"root": str(root), "num_rows": num_rows, "chunk_rows": chunk_rows, "row_bytes": row_bytes,
               "uid": uid.hex(), "unbound": unbound, "ppid": os.getpid(), "sys_path": list(sys.path),
               "package": str(Path(__file__).resolve().parent)}
        self._conn = Connection(mine.detach())
        # `interrupt` writes to this pipe: every `wait_ready` wakes, then and later (the store closes)
        self._wake_r, self._wake_w = os.pipe()
        started = threading.Event()
        box: list[Any] = []

        def run() -> None:
            # The thread that starts the child waits for it: PR_SET_PDEATHSIG fires when the
            # starting *thread* ends, so this thread lives exactly as long as the child.
            try:
                proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(cfg), str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, start_new_session=True)
            except BaseException as exc:
                box.append(exc)
                started.set()
                return
            box.append(proc)
            started.set()
            proc.wait()

        threading.Thread(target=run, name="embcache-fold-reaper", daemon=True).start()
        started.wait()
        theirs.close()
        if isinstance(box[0], BaseException):
            self._conn.close()
            _close_fds(self._wake_r, self._wake_w)
            raise box[0]
        self._proc: subprocess.Popen = box[0]
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn, self._pid, self._wake_r, self._wake_w)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def broken(self) -> bool:
        """It died, failed a round or could not start: the store folds in its own thread."""
        return self._broken

    def peak_rss(self) -> int:
        """The child's peak resident bytes so far (0 where unknown); ``base_rss``: its resident
        bytes once started (the interpreter, numpy, lz4), before any round."""
        return _status_bytes(self._proc.pid, "VmHWM")

    def usable(self) -> bool:
        """True when the child has started and not failed (never waits for it)."""
        if self._broken or self._pid != os.getpid():
            return False
        if not self._ready:
            # one reader of the child's hello: a second thread that polled too would block on a
            # message already taken, or take the next one for it (and call the child broken)
            with self._hello_lock:
                if self._ready or self._broken:
                    return self._ready
                try:
                    if not self._conn.poll():
                        self._broken = self._proc.poll() is not None  # died before it was ready
                        return False
                    msg = self._conn.recv()
                except (OSError, EOFError, TypeError):  # (TypeError: closed by another thread meanwhile)
                    self._broken = True
                    return False
                self._ready = isinstance(msg, tuple) and msg[0] == "ready"
                self._broken = not self._ready
                if self._ready:
                    self.base_rss = msg[1]
        return self._ready

    def wait_ready(self, timeout: float) -> bool:
        """Block until the child is up (True), or it failed or died, ``timeout`` seconds passed
        or `interrupt` was called (False); whether it is `usable` then."""
        if not (self._ready or self._broken or self._pid != os.getpid()):
            try:
                wait([self._conn, self._wake_r], timeout)
            except (OSError, ValueError):
                pass  # closed meanwhile: `usable` tells
        return self.usable()

    def interrupt(self) -> None:
        """Wake every `wait_ready` of other threads now, and return every later one at once (the
        store closes: its waiters stop)."""
        try:
            os.write(self._wake_w, b"x")  # never read: the pipe stays readable
        except OSError:
            pass

    def fold(self, chunks: list[int], bases: list[int], folded: list[int], segments: list[int], gen: int,
             compress: bool, own_gens_from: int, reuse: list[str]) -> tuple[bool, dict]:
        """Fold ``chunks`` (their base generations ``bases``, holding the segments up to ``folded``)
        with ``segments`` into files of ``gen``,
        made durable. (True, result) where the child did it: ``done`` and ``skipped`` chunks (those
        that need initial values), byte counts, the ``reuse`` names it left; (False, {"left":
        names or None, "error": text}) where it failed: the caller folds the round itself."""
        try:
            self._conn.send((chunks, bases, folded, segments, gen, compress, own_gens_from, reuse))
            msg = self._conn.recv()
        except (OSError, EOFError) as exc:
            self._broken = True
            return False, {"left": None, "error": f"the compaction process is gone ({exc!r})"}
        ok, result = msg
        self._broken = not ok  # whatever failed there, the store folds from now on (one restart)
        return ok, result

    def close(self) -> None:
        if self._pid == os.getpid():
            self._finalizer()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _stop(proc: subprocess.Popen, conn: Connection, pid: int, wake_r: int, wake_w: int) -> None:
    """Ask the child to exit. Not waited for: it is between rounds (the store's writer lock is
    held while one is asked for) and writes nothing more; the reaper thread collects it. Only in
    the process that started it: a forked copy of the handle (a DataLoader worker) must not stop
    the parent's child."""
    if os.getpid() != pid:
        return
    try:
        conn.send(None)
    except (OSError, ValueError):
        pass
    conn.close()
    _close_fds(wake_r, wake_w)


def _status_bytes(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# ---------------------------------------------------------------------------------- the child
def _die_with_parent(ppid: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the per-chunk check of the parent below still stops a round
    if os.getppid() != ppid:  # the parent died before the line above
        os._exit(0)


def serve(cfg: dict, fd: int) -> None:
    """The child's loop: fold rounds until the parent says stop or goes away."""
    ppid = cfg["ppid"]
    _die_with_parent(ppid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from .disk import Disk, Segment  # relative: imported as the parent's files, without the package
    from .errors import StoreError
    from .fold import fold_chunk

    conn = Connection(fd)
    try:
        disk = Disk(Path(cfg["root"]), cfg["num_rows"], cfg["chunk_rows"], cfg["row_bytes"], bytes.fromhex(cfg["uid"]),
                    unbound=cfg["unbound"])
    except (OSError, StoreError):  # the store closed and its folder went before this process was up
        conn.close()
        return
    segs: dict[int, Segment] = {}
    try:
        conn.send(("ready", _status_bytes(os.getpid(), "VmRSS")))
    except OSError:  # the store closed before this process was up
        disk.close()
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        chunks, bases, folded, seqs, gen, compress, own_from, reuse = msg
        disk.pool.adopt(reuse)
        try:
            keep = set(seqs)
            for q in [q for q in segs if q not in keep]:
                segs.pop(q).close()
            use = []
            for q in seqs:
                if q not in segs:
                    segs[q] = disk.open_segment(q)
                use.append(segs[q])
            newest = max(seqs, default=0)  # what the new files hold: the chunk map the parent publishes says so
            r0, w0, s0 = disk.bytes_read, disk.bytes_written, disk.segment_reads[0]
            done, skipped = [], []
            for c, b, f in zip(chunks, bases, folded):
                if os.getppid() != ppid:
                    os._exit(0)
                got = fold_chunk(disk, c, b, use, verify=b < own_from, init_rows=None, folded=f)
                if got is None:  # it needs initial values, which only the store can compute
                    skipped.append(c)
                    continue
                recs, present = got
                disk.write_chunk(c, gen, recs, compress, durable=False, present=present, folded=newest)
                done.append(c)
            disk.sync_chunks(done, gen)
            result = {"done": done, "skipped": skipped, "left": disk.pool.release(),
                      "bytes_read": disk.bytes_read - r0, "bytes_written": disk.bytes_written - w0,
                      "segment_reads": disk.segment_reads[0] - s0}
            reply: tuple[bool, dict] = (True, result)
        except Exception as exc:  # the parent folds the round itself and names the error there
            reply = (False, {"left": disk.pool.release(), "error": f"{type(exc).__name__}: {exc}"})
        try:
            conn.send(reply)
        except OSError:
            break
    for s in segs.values():
        s.close()
    disk.close()
