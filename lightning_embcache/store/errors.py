"""The store's exception family: one base class, a few named cases a caller can catch."""

from __future__ import annotations

import errno as _errno


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class InvalidArgumentError(StoreError, ValueError):
    """An argument is out of its allowed range; the message names it, its value and the range."""


class InvalidTypeError(StoreError, TypeError):
    """An argument has the wrong type or dtype; the message names it and what is allowed."""


class CorruptStoreError(StoreError):
    """A store file fails its checksum, is truncated, is not a store file at all, belongs to
    another store, or a file the store needs is missing (e.g. its newest manifest)."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class StoreLockedError(StoreError):
    """Another writer holds the store (one writer per path)."""


class ForkedWriterError(StoreError):
    """A writable store was used in a forked child, e.g. a DataLoader worker."""


class VersionNotFoundError(StoreError):
    """The requested version was reclaimed or never existed."""


class StoreClosedError(StoreError):
    """The store was used after (or while) `close()`."""


class ReadOnlyError(StoreError):
    """A write was attempted on a store opened with `readonly=True`."""


class StoreBusyError(StoreError):
    """The call cannot run while other store work is in progress (e.g. shrinking the hot tier while
    a flush writes); nothing changed, retry it later."""


class OutOfMemoryError(StoreError, MemoryError):
    """GPU memory or pinned host memory ran out for the store's rows or its copy buffers; the
    message names the budget to lower. The store and its rows are as they were."""


class StoreIOError(StoreError, OSError):
    """The operating system refused a read or write of a store file (permissions, I/O error, a
    symlink where the store expects its own file); ``errno`` and ``filename`` say which. The
    previous version is intact and a rejected call changed nothing."""

    def __init__(self, err: int, message: str, filename: object = None) -> None:
        OSError.__init__(self, err, message)
        self.filename = None if filename is None else str(filename)

    def __str__(self) -> str:
        name = _errno.errorcode.get(self.errno, str(self.errno)) if self.errno else "error"
        where = f" ({self.filename})" if self.filename else ""
        return f"[{name}] {self.strerror}{where}"


class DiskFullError(StoreIOError):
    """The disk filled up (or a file grew past the file system's limit) while writing; the
    previous version is intact."""


def io_error(exc: OSError, doing: str, path: object) -> StoreIOError:
    """The named error for an OSError raised while ``doing`` something to ``path``."""
    if isinstance(exc, StoreError):
        return exc  # type: ignore[return-value]
    code = exc.errno or _errno.EIO
    if code in (_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG):
        what = "disk full" if code != _errno.EFBIG else "file too large for the file system (disk full for this file)"
        return DiskFullError(code, f"{what} while {doing} {path}; the previous version is intact. Free space on "
                             f"that file system: keep fewer checkpoints (each pins a store version), run `embcache "
                             f"compact` on the store, or move it to a larger disk (docs/troubleshooting.md, "
                             f"DiskFullError)", path)
    if code == _errno.ELOOP:
        return StoreIOError(
            code, f"refusing to follow a symlink while {doing} {path}: the store only touches its own files", path
        )
    return StoreIOError(code, f"{exc.strerror or exc} while {doing} {path}; the previous version is intact", path)
