"""Checksummed, crash-safe file primitives: every store file goes through here.

A store file is ``header | payload``. The header names the file kind and the store's uuid, so a
foreign file (another store's, or no store's) or a truncated one is reported as such instead of
being misread. Files are written to a fresh temporary name (``O_CREAT | O_EXCL | O_NOFOLLOW``:
never through a symlink planted there), fsynced, renamed into place and the directory fsynced
(the SQLite/LMDB recipe), so after a crash a file either exists whole or not at all. Writes,
renames and deletes inside the store go through a directory descriptor (``openat``-style), so a
symlink swapped in for ``segments/`` or ``chunks/`` cannot send them outside the folder.

Every write, fsync, rename, unlink and truncate passes `FAULTS` (None in production: one global
load per call); the fault-injection suite sets it to fail call *i* or to kill the process after it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .errors import CorruptStoreError, DiskFullError, StoreError, StoreIOError, io_error  # noqa: F401 (re-exported)

MAGIC = b"EMBCACHE"
# magic, kind (8 bytes), format version, store uuid (16 bytes), payload length, payload crc32, header crc32
_HEADER = struct.Struct("<8s8sI16sQII")
HEADER_SIZE = _HEADER.size
# Format 3: the header checksum also covers the file's own name (`bound_crc`), so a valid file of
# the same store put in another file's place (another chunk, an older generation, another segment
# or manifest) fails its header check instead of being served. Format 2 (stores of 0.1) bound no
# name: its files are read where META allows them (stores created before format 3).
FORMAT_VERSION = 3
UNBOUND_FORMAT = 2
ANY_STORE = None  # parse_header(uid=ANY_STORE): accept any store's uuid (META, read before the uuid is known)

# Set by the fault-injection suite: an object with before(op, name) (may raise OSError) and
# after(op, name) (may end the process). None in production.
FAULTS = None

#: a streamed block of at least this many bytes is written by the stream's helper thread
STREAM_THREAD_BYTES = 1 << 20

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


try:  # ISA-L's CRC-32: the same checksum as zlib's, computed with PCLMULQDQ; both let go of the GIL
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - a platform without an isal wheel
    from zlib import crc32 as _crc32


def crc32(data: bytes | memoryview) -> int:
    return _crc32(data) & 0xFFFFFFFF


def uuid_bytes(hex_uuid: str) -> bytes:
    """The 16 header bytes of a store uuid (META's ``uuid``, 32 hex digits)."""
    try:
        raw = bytes.fromhex(hex_uuid)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 16:
        raise ValueError(f"a store uuid is 32 hex digits; got {hex_uuid!r}")
    return raw


def bound_crc(head: bytes | memoryview, name: str) -> int:
    """The header checksum of format 3: the header's first 48 bytes, then the file's name."""
    return crc32(bytes(head[: HEADER_SIZE - 4]) + name.encode())


def pack(kind: bytes, payload: bytes | memoryview, uid: bytes, name: str) -> list[bytes | memoryview]:
    """The parts of file ``name`` (its name in the store's folder, not a temporary one) of ``kind``
    of store ``uid`` holding ``payload`` (not joined: no copy)."""
    head = _HEADER.pack(MAGIC, kind.ljust(8, b"\0"), FORMAT_VERSION, uid, len(payload), crc32(payload), 0)
    head = head[:-4] + struct.pack("<I", bound_crc(head, name))
    return [head, payload]


def parse_header(path: object, head: bytes, kind: bytes, uid: bytes | None = ANY_STORE, *,
                 name: str | None = None, unbound: bool = True) -> tuple[int, int]:
    """Validate a header of a file of ``kind`` belonging to store ``uid`` and bound to ``name``
    (default: ``path``'s last part); return (payload length, payload crc). ``uid=ANY_STORE``
    accepts any store (use `header_uuid` to learn which); ``unbound=False`` refuses format-2 files,
    which are bound to no name."""
    if len(head) < HEADER_SIZE:
        raise CorruptStoreError(path, f"truncated: {len(head)} bytes, a store file has at least {HEADER_SIZE}")
    magic, got_kind, fmt, got_uid, length, pcrc, hcrc = _HEADER.unpack(head[:HEADER_SIZE])
    if magic != MAGIC:
        raise CorruptStoreError(path, "not a lightning_embcache store file (bad magic)")
    if fmt == FORMAT_VERSION:
        bind = name if name is not None else os.path.basename(os.fspath(path))  # type: ignore[call-overload]
        if bound_crc(head, bind) != hcrc:
            if uid is not None and got_uid != uid:
                _refuse_foreign(path, got_uid, uid)
            raise CorruptStoreError(
                path, f"header checksum mismatch: the file is damaged, or it is another file of a store put in the "
                f"place of {bind!r} (each file is bound to the name its manifest gives it)")
    elif fmt == UNBOUND_FORMAT and unbound:
        if crc32(head[: HEADER_SIZE - 4]) != hcrc:
            raise CorruptStoreError(path, "header checksum mismatch")
    elif fmt == UNBOUND_FORMAT:
        raise CorruptStoreError(path, f"format version {fmt} (bound to no name) in a store whose files are all "
                                f"format {FORMAT_VERSION}: a file put here from elsewhere is never read")
    else:
        raise CorruptStoreError(path, f"format version {fmt}; this build reads versions {UNBOUND_FORMAT} and "
                                f"{FORMAT_VERSION}")
    if got_kind.rstrip(b"\0") != kind:
        found = got_kind.rstrip(b"\0").decode("ascii", "replace")
        raise CorruptStoreError(path, f"expected a {kind.decode()!r} file, found {found!r}")
    if uid is not None and got_uid != uid:
        _refuse_foreign(path, got_uid, uid)
    return length, pcrc


def _refuse_foreign(path: object, got_uid: bytes, uid: bytes) -> None:
    raise CorruptStoreError(
        path, f"belongs to another store (uuid {got_uid.hex()}; this store's uuid is {uid.hex()}): "
        "a file copied in from elsewhere is never read as this store's"
    )


def header_uuid(head: bytes) -> bytes:
    return _HEADER.unpack(head[:HEADER_SIZE])[3]


def read_file(path: Path, kind: bytes, uid: bytes | None = ANY_STORE, *, name: str | None = None,
              unbound: bool = True) -> bytes:
    """Read and verify a whole store file (bound to ``name``, default its own); raise
    CorruptStoreError naming it on any damage."""
    data = read_raw(path, what="missing (the store directory is incomplete)")
    return check_file(path, data, kind, uid, name=name, unbound=unbound)


def check_file(path: object, data: bytes, kind: bytes, uid: bytes | None = ANY_STORE, *, name: str | None = None,
               unbound: bool = True) -> bytes:
    """The verified payload of a whole store file's bytes ``data`` (see `read_file`)."""
    length, pcrc = parse_header(path, data, kind, uid, name=name, unbound=unbound)
    payload = memoryview(data)[HEADER_SIZE:]
    if len(payload) != length:
        raise CorruptStoreError(path, f"truncated: payload is {len(payload)} bytes, header says {length}")
    if crc32(payload) != pcrc:
        raise CorruptStoreError(path, "payload checksum mismatch")
    return bytes(payload)


def read_raw(path: Path, what: str = "missing") -> bytes:
    """A whole file's bytes (never through a symlink); named errors for a missing or unreadable file."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        raise CorruptStoreError(path, what) from None
    except OSError as exc:
        raise _read_error(exc, path) from exc
    try:
        with os.fdopen(fd, "rb", closefd=True) as f:
            return f.read()
    except OSError as exc:
        raise _read_error(exc, path) from exc


def _read_error(exc: OSError, path: object) -> StoreError:
    if exc.errno == errno.ELOOP:
        return CorruptStoreError(path, "is a symlink; a store's files are never links (refusing to follow it)")
    if exc.errno in (errno.EISDIR, errno.ENOTDIR):
        return CorruptStoreError(path, "is not a regular file")
    return io_error(exc, "reading", path)



# ---- the I/O calls the fault-injection suite counts ------------------------------------------------
def _before(op: str, name: object) -> None:
    faults = FAULTS
    if faults is not None:
        faults.before(op, name)


def _after(op: str, name: object) -> None:
    faults = FAULTS
    if faults is not None:
        faults.after(op, name)


def fsync(fd: int, name: object) -> None:
    _before("fsync", name)
    os.fsync(fd)
    _after("fsync", name)


def _libc(name: str, argtypes: list) -> Callable[..., int] | None:
    """The C library's ``name`` (Linux only), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_SYNCFS = _libc("syncfs", [ctypes.c_int])
_SYNC_FILE_RANGE = _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start writing ``fd``'s dirty pages to disk without waiting for them (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the ``fsync``/``syncfs`` that makes them
    durable later waits only for what was written since: a flush's segment is streamed in 2 MiB
    blocks, each on its way while the next is gathered; a compaction round's chunk files go out
    while the round folds the next ones, before its one sync. Not a durability step: a failure
    here is left to that sync to report."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


_FALLOCATE = _libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
PAGE = 4096


def held_bytes(st: os.stat_result) -> int:
    """The bytes of a file on disk: its size less the holes punched in it (`punch_holes`), not
    rounded up to whole blocks (so small files count what they hold)."""
    return min(st.st_size, getattr(st, "st_blocks", st.st_size // 512 + 1) * 512)


def punch_supported() -> bool:
    return _FALLOCATE is not None


def punch_holes(fd: int, ranges: list[tuple[int, int]], name: object) -> int:
    """Give the disk blocks of byte ranges ``(offset, length)`` of ``fd`` (open for writing) back
    to the file system, the file keeping its size (Linux ``fallocate(PUNCH_HOLE)``; the ranges
    read as zeros after). Each range shrinks to whole 4 KiB pages inside it: the bytes around it
    stay. Returns the bytes freed; -1 where the platform or file system has no holes (then
    nothing changed). Not a durability step: after a crash a range holds its old bytes or zeros,
    and only ranges nobody reads any more are punched."""
    if _FALLOCATE is None:
        return -1
    freed = 0
    for off, n in ranges:
        a = -(-off // PAGE) * PAGE
        b = (off + n) // PAGE * PAGE
        if b <= a:
            continue
        _before("punch", name)
        if _FALLOCATE(fd, _PUNCH_HOLE, a, b - a) != 0:
            return -1 if not freed else freed  # EOPNOTSUPP (no holes here) and the like: bytes kept
        _after("punch", name)
        freed += b - a
    return freed


def sync_written(dir_fd: int, names: list[str], path: object) -> None:
    """Make files written with ``durable=False`` in folder ``dir_fd`` durable, and their renames.

    On Linux one ``syncfs`` of the file system (one call instead of an ``fsync`` per file for a
    compaction round's chunk files; it reports write-back errors since Linux 5.8); elsewhere a
    ``fsync`` of each file and one of the folder.
    """
    try:
        _before("fsync", path)
        if _SYNCFS is not None:
            if _SYNCFS(dir_fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        else:
            for name in names:
                fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.fsync(dir_fd)
        _after("fsync", path)
    except OSError as exc:
        raise io_error(exc, "syncing", path) from exc


def fsync_files(dir_fd: int, names: list[str], folder: Path) -> None:
    """``fsync`` each of the files ``names`` in folder ``dir_fd`` (``folder``: its path), whose
    names are durable already: a few files changed in place (inplace.py), where a ``syncfs``
    would wait for every other writer of the file system too."""
    for name in names:
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            raise io_error(exc, "syncing", folder / name) from exc
        try:
            fsync(fd, folder / name)
        except OSError as exc:
            raise io_error(exc, "syncing", folder / name) from exc
        finally:
            os.close(fd)


def unlink(name: str, dir_fd: int | None, path: object = None) -> None:
    """Delete ``name`` (in ``dir_fd``); deleting a symlink removes the link, never its target."""
    _before("unlink", path or name)
    os.unlink(name, dir_fd=dir_fd)
    _after("unlink", path or name)


def link(src: str, dst: str, dir_fd: int) -> None:
    """A hard link ``dst`` to ``src``, both in ``dir_fd`` (``dst`` must not exist)."""
    _before("link", dst)
    os.link(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    _after("link", dst)


def rename(src: str, dst: str, dir_fd: int) -> None:
    _before("rename", dst)
    os.replace(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    _after("rename", dst)


def _write_all(fd: int, data: bytes | memoryview, name: object, offset: int | None = None) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        _before("write", name)
        if offset is None:
            done += os.write(fd, view[done:])
        else:
            done += os.pwrite(fd, view[done:], offset + done)
        _after("write", name)
    return done


def overwrite(fd: int, data: bytes | memoryview, name: object, ranges: list[tuple[int, int, int]]) -> int:
    """Write the slices ``data[start:end]`` at file offsets ``offset`` (``ranges`` of ``(start,
    end, offset)``) of an existing file: compaction folding rows in place (inplace.py), the one
    write that changes bytes a version may read. The fault-injection suite and the power-cut
    oracle see the batch as one operation, ``"overwrite"`` (until the file is synced, a power cut
    may leave each of its sectors old or new)."""
    view = memoryview(data).cast("B")
    done = 0
    pwrite = os.pwrite
    _before("overwrite", name)
    for start, end, offset in ranges:
        while start < end:
            n = pwrite(fd, view[start:end], offset)
            start += n
            offset += n
            done += n
    _after("overwrite", name)
    return done


def _write_parts(fd: int, parts: Iterable[bytes | memoryview], name: object) -> int:
    """Write ``parts`` in order: a list in one ``writev`` (each system call of a background thread
    hands the GIL over), the rest of a short write and an iterator of blocks part by part."""
    if isinstance(parts, (list, tuple)) and 1 < len(parts) <= 64:
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(len(v) for v in views)
        _before("write", name)
        done = os.writev(fd, views)
        _after("write", name)
        if done == total:
            return done
        written = 0
        for v in views:  # a short write: finish what is left, part by part
            if done >= len(v):
                done -= len(v)
                written += len(v)
                continue
            written += done + _write_all(fd, v[done:], name)
            done = 0
        return written
    return _write_stream(fd, iter(parts), name)


def _write_out(fd: int, part: bytes | memoryview, name: object) -> int:
    n = _write_all(fd, part, name)
    start_writeback(fd)
    return n


def _write_stream(fd: int, parts: Iterator[bytes | memoryview], name: object) -> int:
    """Write an iterator's blocks in order. A block of `STREAM_THREAD_BYTES` or more is written
    by one helper thread (one per stream, not one per block) while the next is made: making a
    block (a flush gathers its rows) and writing it both let go of the GIL, so the two overlap on
    two cores; smaller ones (an eviction's write-back) are written here, where a thread would
    cost more than the write. Large streamed files start their write-back block by block, their
    first blocks going out while the rest is made.

    The iterator may reuse a block's memory two blocks later: block k is written whole before
    block k + 1 goes to the helper, so it is no longer read once block k + 2 is being made (a
    flush fills two buffers in turn)."""
    written = 0
    pool: ThreadPoolExecutor | None = None
    pending: Future[int] | None = None
    try:
        for part in parts:
            if pending is not None:
                written += pending.result()
                pending = None
            if memoryview(part).nbytes < STREAM_THREAD_BYTES:
                written += _write_all(fd, part, name)
                continue
            if pool is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix="embcache-write")
            pending = pool.submit(_write_out, fd, part, name)
        if pending is not None:
            written += pending.result()
            pending = None
        return written
    finally:
        if pool is not None:
            pool.shutdown(wait=True)  # the caller closes the descriptor: no write may still be running


def open_dir(path: object, dir_fd: int | None = None, *, follow: bool = False) -> int:
    """A descriptor of directory ``path`` (relative to ``dir_fd``); a symlink is refused unless
    ``follow`` (the store's own root may be reached through the user's links, its subfolders not)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC | (0 if follow else _NOFOLLOW)
    try:
        return os.open(path, flags, dir_fd=dir_fd)  # type: ignore[arg-type]  # a str or path-like
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CorruptStoreError(
                path, "is a symlink or not a directory; the store never writes outside its folder"
            ) from None
        raise io_error(exc, "opening", path) from exc


def listdir(dir_fd: int | str | os.PathLike) -> list[str]:
    """Names in a directory held open as ``dir_fd`` (or a path).

    Through a descriptor of its own: ``os.listdir(fd)`` reads through a duplicate of ``fd`` that
    shares its read position, so two threads listing one held descriptor at once (garbage
    collection beside ``versions()``) each see part of the folder, or nothing.
    """
    if not isinstance(dir_fd, int):
        return os.listdir(dir_fd)
    own = os.open(".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC, dir_fd=dir_fd)
    try:
        return os.listdir(own)
    finally:
        os.close(own)


def write_parts(
    path: Path,
    parts: Iterable[bytes | memoryview],
    *,
    durable: bool = True,
    head: Callable[[], bytes] | None = None,
    head_size: int = 0,
    dir_fd: int | None = None,
    reuse: str | None = None,
) -> int:
    """Atomically create ``path`` from ``parts`` (consumed lazily); return bytes written.

    With ``head``, the first ``head_size`` bytes are written last, from ``head()`` called after
    every part: a header can carry checksums of a body that was streamed in bounded blocks.
    ``dir_fd``: the descriptor of ``path``'s folder (the store's own); without it the folder is
    opened here. Any OS error leaves no partial file and raises a named error (DiskFullError on
    ENOSPC/EDQUOT/EFBIG, StoreIOError otherwise).

    ``reuse``: the name (in ``dir_fd``) of a file nobody reads any more, overwritten in place and
    cut to length instead of creating a new file: creating a file and later deleting one costs
    more than writing a chunk's bytes (docs/benchmarks.md), as RocksDB found for its recycled log
    files. A reuse that cannot start falls back to a new file.
    """
    name = path.name
    tmp = f".{name}.tmp{os.getpid()}-{threading.get_ident()}"
    own_dir = dir_fd is None
    written = 0
    created = False
    dfd = -1
    try:
        dfd = open_dir(path.parent, follow=True) if dir_fd is None else dir_fd
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        fd = _reuse(reuse, tmp, dfd, path) if reuse is not None else -1
        if fd < 0:
            try:
                _before("open", path)
                fd = os.open(tmp, flags, 0o644, dir_fd=dfd)
            except FileExistsError:  # a leftover of a crashed write (or something planted): replace it
                unlink(tmp, dfd, path)
                fd = os.open(tmp, flags, 0o644, dir_fd=dfd)
        created = True
        try:
            if head is not None:
                os.lseek(fd, head_size, os.SEEK_SET)
            written += _write_parts(fd, parts, path)
            if head is not None:
                first = head()
                assert len(first) == head_size
                written += _write_all(fd, first, path, 0)
            if reuse is not None:
                os.ftruncate(fd, written)  # a reused file may have been longer
            if durable:
                fsync(fd, path)
            else:
                start_writeback(fd)  # made durable later (a round's sync): most of it is out by then
        finally:
            os.close(fd)
        _before("rename", path)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        created = False
        _after("rename", path)
        if durable:
            fsync(dfd, path.parent)
    except OSError as exc:
        if created:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
        raise io_error(exc, "writing", path) from exc
    finally:
        if own_dir and dfd >= 0:
            os.close(dfd)
    return written


def _reuse(name: str, tmp: str, dfd: int, path: object) -> int:
    """Open the reused file ``name`` as ``tmp`` for overwriting, or -1 (then a new file is made)."""
    try:
        _before("rename", path)
        os.replace(name, tmp, src_dir_fd=dfd, dst_dir_fd=dfd)
        _after("rename", path)
    except OSError:
        return -1
    try:
        _before("open", path)
        return os.open(tmp, os.O_WRONLY | _NOFOLLOW | _CLOEXEC, dir_fd=dfd)
    except OSError:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        return -1


def write_file(
    path: Path, kind: bytes, payload: bytes | memoryview, uid: bytes, *, durable: bool = True, dir_fd: int | None = None
) -> int:
    return write_parts(path, pack(kind, payload, uid, Path(path).name), durable=durable, dir_fd=dir_fd)


def write_plain(path: Path, data: bytes, *, durable: bool = True) -> int:
    """Atomically replace a file outside the store format (e.g. the checkpoint registry) the same
    crash-safe, symlink-proof way."""
    return write_parts(path, [data], durable=durable)
