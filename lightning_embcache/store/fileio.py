"""Checksummed, crash-safe file primitives: every store file goes through here.

A store file is ``header | payload``. The header names the file kind, so a foreign or truncated
file is reported as such instead of being misread. Files are written to a temporary name, fsynced,
renamed into place and the directory fsynced (the SQLite/LMDB recipe), so after a crash a file
either exists whole or not at all.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from pathlib import Path
from typing import Callable, Iterable

from .errors import CorruptStoreError, StoreError

MAGIC = b"EMBCACHE"
# magic, kind (8 bytes), format version, payload length, payload crc32, header crc32
_HEADER = struct.Struct("<8s8sIQII")
HEADER_SIZE = _HEADER.size
FORMAT_VERSION = 1


class DiskFullError(StoreError, OSError):
    """The disk filled up while writing; the previous version is intact."""


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def pack(kind: bytes, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The parts of a file of ``kind`` holding ``payload`` (not joined, to avoid a copy)."""
    head = _HEADER.pack(MAGIC, kind.ljust(8, b"\0"), FORMAT_VERSION, len(payload), crc32(payload), 0)
    head = head[:-4] + struct.pack("<I", crc32(head[:-4]))
    return [head, payload]


def parse_header(path: Path, head: bytes, kind: bytes) -> tuple[int, int]:
    """Validate a header; return (payload length, payload crc)."""
    if len(head) < HEADER_SIZE:
        raise CorruptStoreError(path, f"truncated: {len(head)} bytes, a store file has at least {HEADER_SIZE}")
    magic, got_kind, fmt, length, pcrc, hcrc = _HEADER.unpack(head[:HEADER_SIZE])
    if magic != MAGIC:
        raise CorruptStoreError(path, "not a lightning_embcache store file (bad magic)")
    if crc32(head[: HEADER_SIZE - 4]) != hcrc:
        raise CorruptStoreError(path, "header checksum mismatch")
    if got_kind.rstrip(b"\0") != kind:
        raise CorruptStoreError(path, f"expected a {kind.decode()!r} file, found {got_kind.rstrip(bytes(1)).decode()!r}")
    if fmt != FORMAT_VERSION:
        raise CorruptStoreError(path, f"format version {fmt}; this build reads version {FORMAT_VERSION}")
    return length, pcrc


def read_file(path: Path, kind: bytes) -> bytes:
    """Read and verify a whole store file; raise CorruptStoreError naming it on any damage."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CorruptStoreError(path, "missing (the store directory is incomplete)") from None
    length, pcrc = parse_header(path, data, kind)
    payload = memoryview(data)[HEADER_SIZE:]
    if len(payload) != length:
        raise CorruptStoreError(path, f"truncated: payload is {len(payload)} bytes, header says {length}")
    if crc32(payload) != pcrc:
        raise CorruptStoreError(path, "payload checksum mismatch")
    return bytes(payload)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        if offset is None:
            done += os.write(fd, view[done:])
        else:
            done += os.pwrite(fd, view[done:], offset + done)
    return done


def write_parts(
    path: Path,
    parts: Iterable[bytes | memoryview],
    *,
    durable: bool = True,
    head: Callable[[], bytes] | None = None,
    head_size: int = 0,
) -> int:
    """Atomically create ``path`` from ``parts`` (consumed lazily); return bytes written.

    With ``head``, the first ``head_size`` bytes are written last, from ``head()`` called after
    every part: a header can carry checksums of a body that was streamed in bounded blocks.
    A full disk raises DiskFullError and leaves no partial file behind.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    written = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if head is not None:
                os.lseek(fd, head_size, os.SEEK_SET)
            for part in parts:
                written += _write_all(fd, part)
            if head is not None:
                first = head()
                assert len(first) == head_size
                written += _write_all(fd, first, 0)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(exc.errno, f"disk full while writing {path}; the previous version is intact") from exc
        raise
    return written


def write_file(path: Path, kind: bytes, payload: bytes | memoryview, *, durable: bool = True) -> int:
    return write_parts(path, pack(kind, payload), durable=durable)
