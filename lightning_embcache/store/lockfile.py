"""The LOCK file: one writable handle per store folder.

A writable handle holds an exclusive ``flock`` on ``<store>/LOCK`` from its open to its close
(`Versions` keeps the descriptor); a second writer is refused with StoreLockedError, naming the
way out. The lock lives exactly as long as the descriptor's open file: the kernel lets go of it
when the process dies, so a crash never leaves a store locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from . import fileio
from .errors import StoreLockedError


def take(root: Path) -> int:
    """Hold the LOCK file of ``root`` (one writer per path) and return its descriptor, or raise
    StoreLockedError."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise fileio.io_error(exc, "opening", root / "LOCK") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLockedError(
            f"the store at {str(root)!r} is open for writing elsewhere (one writer per path); "
            f"close it there or open this one with readonly=True"
        ) from None
    return fd


def release(fd: int, owner_pid: int) -> None:
    """Let go of the lock ``fd`` holds and close it; only the process that took it (``owner_pid``)
    unlocks (the open file is shared with forked children)."""
    try:
        if owner_pid == os.getpid():
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    except OSError:
        pass


def drop_in_child(fd: int) -> None:
    """In a forked child: close its copy of the lock's descriptor, without unlocking.

    The child's copy would hold the flock after the parent died (a DataLoader worker outliving a
    killed trainer); the open file is the parent's too, so the lock lives as long as the parent."""
    try:
        os.close(fd)
    except OSError:
        pass
