"""Cold tier: the on-disk, log-structured layout (see docs/store-format.md).

    META                     immutable table description (rows, schema, chunking, init)
    manifest-<version>       one per retained version: chunk map generation + segment list
    chunkmap-<gen>           per chunk, the generation of its base file (0 = never written)
    chunks/c<chunk>-g<gen>   base chunk (raw, LZ4, or sparse: only the rows ever written); a raw one
                             only the writer's version reads is folded in place (inplace.py)
    segments/s<seq>          immutable delta segment: the rows one flush (or one write-back) wrote
    PINS                     versions that must never be reclaimed (checkpoints)
    LOCK                     the writer's flock

A flush writes one segment (O(dirty rows)) and one small manifest; background compaction folds
segments into base chunk files (new ones, or in place: inplace.py). Every file is checksummed;
every replacement is atomic.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeGuard, cast

import lz4.block
import numpy as np

from . import fileio
from .blockcrc import BLOCK, first_bad_block  # raw chunks: one checksum per block of BLOCK bytes
from .errors import CorruptStoreError, StoreError, VersionNotFoundError, io_error
from .fileio import ANY_STORE, HEADER_SIZE, crc32, open_dir, pack, parse_header, read_file, write_file, write_parts
from .limits import MAX_ROWS
from .recycle import FilePool
from .segpool import SegmentPool
from .warm import MIN_RATIO

_SEG_HEAD = struct.Struct("<QQQI")  # rows, row_bytes, index entries, chunk_rows
# chunk, rows, a length, a flag: the flag 1 is an LZ4 chunk (the length is its records' raw
# length), 0 a raw chunk written before raw files recorded what they hold (the raw length), and
# FOLDS_RECORDED a raw chunk whose third field is the newest segment folded into it (its raw
# length is rows x row bytes): what binds a file folded in place, which keeps its name, to the
# chunk map that names it (`check_folded`)
_CHUNK_HEAD = struct.Struct("<QQQB")
FOLDS_RECORDED = 2
_SPARSE_HEAD = struct.Struct("<QQQQ")  # chunk, rows, rows present, length of their records
SPARSE_KIND = b"sparse"  # a base chunk holding only its rows ever written (the rest are `init`)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MANIFEST_RE = re.compile(r"^manifest-(\d{12})$")
SEGMENT_RE = re.compile(r"^s(\d{12})$")
CHUNK_RE = re.compile(r"^c(\d+)-g(\d+)$")
CHUNKMAP_RE = re.compile(r"^chunkmap-(\d{8,})$")


def _json(path: Path, data: bytes) -> object:
    """A checksummed file's JSON; a crafted one that does not parse is a named corruption."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptStoreError(path, f"is not valid JSON ({type(exc).__name__})") from None


def _is_count(v: object) -> TypeGuard[int]:
    """A non-negative int from JSON (not a bool, not a float)."""
    return type(v) is int and 0 <= v < 1 << 62


def _block_crcs(raw: bytes | memoryview) -> np.ndarray:
    """A crc32 per 4 KiB block of a chunk's records (raw and sparse files): a miss verifies
    just the blocks it reads."""
    view = memoryview(raw)
    return np.array([crc32(view[i : i + BLOCK]) for i in range(0, len(raw), BLOCK)], np.uint32)


def raw_head(path: object, directory: bytes | memoryview, row_bytes: int) -> tuple[int, int, int, int | None]:
    """(chunk, rows, raw length, newest segment folded into it or None where the file does not
    record it) of a raw chunk file's directory."""
    c, rows, third, flag = _CHUNK_HEAD.unpack_from(directory)
    if flag == FOLDS_RECORDED:
        return c, rows, rows * row_bytes, third
    if flag == 0:
        return c, rows, third, None
    raise CorruptStoreError(path, f"raw chunk directory has layout flag {flag}; this build reads 0 and "
                                  f"{FOLDS_RECORDED}")


def raw_directory(chunk: int, rows: int, crcs: np.ndarray, folded: int) -> bytes:
    """The directory of a raw chunk file of ``rows`` rows holding the segments up to ``folded``."""
    return _CHUNK_HEAD.pack(chunk, rows, folded, FOLDS_RECORDED) + crcs.tobytes()


def sparse_rows_held(path: Path) -> int | None:
    """Rows a sparse base chunk file holds (the count its header names, unchecked: for summaries,
    not for reading rows); None for a dense file or one that cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE + _SPARSE_HEAD.size)
    except OSError:
        return None
    if head[8:16].rstrip(b"\0") != SPARSE_KIND or len(head) < HEADER_SIZE + _SPARSE_HEAD.size:
        return None
    return _SPARSE_HEAD.unpack_from(head, HEADER_SIZE)[2]


DIRECTORY_CACHE_BYTES = 16 << 20  # verified block checksums of raw chunks kept for sparse reads


#: a segment is written in blocks of about this many bytes (a flush holds two in memory): small
#: enough that the first ones are on their way to the disk early and the last one, written after
#: everything is gathered, is short; large enough that a block costs few system calls
SEGMENT_BLOCK_BYTES = 2 << 20


class RecordsInto(Protocol):
    """Records of ``ids[a:b]`` written into a buffer the caller gives (`snapshot.Snapshot`)."""

    def read_into(self, a: int, b: int, out: np.ndarray) -> np.ndarray: ...


def _block_source(
    records: np.ndarray | Callable[[int, int], np.ndarray] | RecordsInto, rb: int, max_rows: int
) -> Callable[[int, int, int], np.ndarray]:
    """``fetch(k, a, b)``: the records of block k, rows [a, b) of the segment."""
    if isinstance(records, np.ndarray):
        return lambda k, a, b: records[a:b]
    reader = getattr(records, "read_into", None)
    if reader is None:
        fn = cast("Callable[[int, int], np.ndarray]", records)
        return lambda k, a, b: fn(a, b)
    buffers: list[np.ndarray] = []

    def fetch(k: int, a: int, b: int) -> np.ndarray:
        if len(buffers) <= k % 2:  # allocated on first use: a one-block segment needs one
            buffers.append(np.empty((max_rows, rb), np.uint8))
        return cast("np.ndarray", reader(a, b, buffers[k % 2]))

    return fetch


@dataclass
class Segment:
    """An immutable delta segment: sorted unique ids and their records, indexed by chunk."""

    seq: int
    path: Path
    ids: np.ndarray  # int64, sorted
    idx_chunk: np.ndarray  # int64 chunk of each index entry
    idx_start: np.ndarray  # first row position in the segment
    idx_count: np.ndarray
    idx_crc: np.ndarray
    records_offset: int
    row_bytes: int
    nbytes: int = 0
    _fd: int | None = field(default=None, repr=False)
    _verified: np.ndarray | None = field(default=None, repr=False)  # index entries checksum-verified
    read_counter: list[int] | None = field(default=None, repr=False)  # the store's, shared: [bytes]
    # chunk -> index entry: a miss asks a segment about one chunk at a time, and a dict answers
    # that without numpy's per-call overhead (built on first use). Ints only: a dict of them is
    # not tracked by the garbage collector, where a tuple per entry would be, and building many of
    # those sets off full collections in the middle of a compaction pass.
    _entries: dict[int, int] | None = field(default=None, repr=False)
    _starts: list[int] | None = field(default=None, repr=False)
    _counts: list[int] | None = field(default=None, repr=False)
    _open_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Index entries whose records base chunks hold (holes.py): queued to be punched, punched, and
    # the bytes of whole pages given back so far (disk use and thresholds count the rest).
    doomed: np.ndarray | None = field(default=None, repr=False)
    punched: np.ndarray | None = field(default=None, repr=False)
    freed: int = 0

    @property
    def live_bytes(self) -> int:
        return self.nbytes - self.freed

    def _entry(self, chunk: int) -> tuple[int, int, int] | None:
        """(index entry, first row, row count) of ``chunk`` in this segment; None if it has none."""
        entries = self._entries
        if entries is None:
            self._starts, self._counts = self.idx_start.tolist(), self.idx_count.tolist()
            entries = self._entries = dict(zip(self.idx_chunk.tolist(), range(len(self.idx_chunk))))
        i = entries.get(chunk)
        if i is None:
            return None
        assert self._starts is not None and self._counts is not None  # set with the entries
        return i, self._starts[i], self._counts[i]

    def rows_of_chunk(self, chunk: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, records) this segment holds for ``chunk``, checksum-verified; None if none."""
        entry = self._entry(chunk)
        if entry is None:
            return None
        i, start, count = entry
        data = self._read(self.records_offset + start * self.row_bytes, count * self.row_bytes)
        if crc32(data) != int(self.idx_crc[i]):
            raise CorruptStoreError(self.path, f"records of chunk {chunk} fail their checksum")
        return self.ids[start : start + count], np.frombuffer(data, np.uint8).reshape(count, self.row_bytes)

    def _read(self, offset: int, n: int) -> bytes:
        fd = self._fd
        if fd is None:
            with self._open_lock:  # two readers (a get and a prefetch) may ask first at once
                if self._fd is None:
                    try:
                        self._fd = os.open(self.path, os.O_RDONLY | _NOFOLLOW)
                    except FileNotFoundError:
                        raise CorruptStoreError(self.path, "missing: a manifest lists it but it is gone") from None
                    except OSError as exc:
                        raise io_error(exc, "reading", self.path) from exc
                fd = self._fd
        data = os.pread(fd, n, offset)
        if len(data) != n:
            raise CorruptStoreError(self.path, f"truncated: wanted {n} bytes at offset {offset}, got {len(data)}")
        if self.read_counter is not None:
            self.read_counter[0] += n
        return data

    def close(self) -> None:
        """Close the descriptor; only when no other thread can read this segment any more (the
        store closes its segments at close(); a segment dropped from the layout, e.g. folded by
        compaction, closes when the last reader lets go of it, see __del__)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


@dataclass
class Manifest:
    version: int
    chunkmap: int  # generation of the chunkmap file; 0 = every chunk unwritten
    segments: list[int]  # segment seqs, oldest first
    parent: int = 0
    # A compaction rewrites a version's manifest with a new layout of the same rows; the rewrite
    # keeps the identity (`Disk.manifest_checksum`) of the manifest its flush wrote.
    ident: str = ""
    # Rows of the table at this version (a store grows: `EmbeddingStore.grow`); 0 = as META
    # says (manifests of versions before any growth, and of stores older than growing).
    num_rows: int = 0
    # Rows of the whole table when this store is one rank's shard of a row-sharded table
    # (`ShardedStore`): its size at this version. 0 = not recorded (not a shard, or never flushed).
    table_rows: int = 0

    def to_bytes(self) -> bytes:
        obj = {"version": self.version, "chunkmap": self.chunkmap, "segments": self.segments,
               "parent": self.parent, "time": time.time()}
        if self.ident:
            obj["ident"] = self.ident
        if self.num_rows:
            obj["num_rows"] = self.num_rows
        if self.table_rows:
            obj["table_rows"] = self.table_rows
        return json.dumps(obj).encode()


class Disk:
    """Reads and writes the files of one store directory. Not thread-safe: the store serialises."""

    def __init__(self, root: Path, num_rows: int, chunk_rows: int, row_bytes: int, uid: bytes, *,
                 unbound: bool = True) -> None:
        self.root = root
        self.uid = uid  # every file's header names this store (a foreign file is refused)
        # Whether files bound to no name (format 2) may be read: only in stores created before
        # names were bound (META's "names_bound" absent); see fileio.FORMAT_VERSION.
        self.unbound = unbound
        # Writes, renames and deletes go through these descriptors: a symlink swapped in for a
        # subfolder is refused, never followed out of the store.
        self._root_fd = open_dir(root, follow=True)
        try:
            self._segments_fd = open_dir("segments", self._root_fd)
            self._chunks_fd = open_dir("chunks", self._root_fd)
        except BaseException:
            os.close(self._root_fd)
            raise
        self.num_rows = num_rows
        self.created_rows = num_rows  # META's: the size of a version whose manifest names none
        self.chunk_rows = chunk_rows
        self.row_bytes = row_bytes
        self.num_chunks = (num_rows + chunk_rows - 1) // chunk_rows
        self.bytes_written = 0
        # of that, by compaction: chunk files and chunk maps here, the rest counted by the rounds
        # (write-back of evicted rows writes segments meanwhile: not compaction's)
        self.compaction_bytes_written = 0
        self.write_back_seconds = 0.0  # segments written with durable=False (evicted, cleaned rows)
        self.bytes_read = 0  # of chunk files and segment directories; see total_bytes_read
        self.segment_reads = [0]  # bytes of segment records, counted by the segments themselves
        # (chunk, gen) -> verified per-block checksums of a raw base chunk (None: an LZ4 chunk)
        self._directories: dict[tuple[int, int], np.ndarray | None] = {}
        # bounded by bytes: at most ~16 MiB of checksums (4 bytes per 4 KiB block plus ~112 bytes
        # per entry), whatever the table's size
        per_entry = 4 * -(-chunk_rows * row_bytes // BLOCK) + 112
        self._directories_max = max(64, min(2 * self.num_chunks + 64, DIRECTORY_CACHE_BYTES // per_entry))
        self._chunks_dir = str(root / "chunks")
        # replaced chunk files a compaction round overwrites instead of creating new ones; every
        # read of a chunk file registers with it (see recycle.py)
        self.pool = FilePool(self._chunks_fd)
        # a dropped segment file the next flush overwrites instead of creating one (segpool.py)
        self.segment_pool = SegmentPool(self._segments_fd, self.pool)
        # Records of never-written rows: the store's `_init_rows` (see `set_init_rows`)
        self._init_rows: Callable[[], Callable[[np.ndarray], np.ndarray] | None] = lambda: None
        # (generation, newest segment folded) per chunk of the chunk map this handle reads
        # (`bind_chunkmap`): what a raw chunk file read here must hold at least (`check_folded`);
        # and for a handle whose version never changes, the newest segment it lists
        self._folds: tuple[np.ndarray, np.ndarray] | None = None
        self._folds_newest: int | None = None

    def resize(self, num_rows: int) -> None:
        """Rows of the table this handle reads and writes now: a version's size (`Manifest.num_rows`)
        or a grown table's. Chunk ``num_chunks - 1`` may be short; its files hold that many rows."""
        self.num_rows = num_rows
        self.num_chunks = (num_rows + self.chunk_rows - 1) // self.chunk_rows
        self._directories.clear()  # the short last chunk's directory size follows its rows
        per_entry = 4 * -(-self.chunk_rows * self.row_bytes // BLOCK) + 112
        self._directories_max = max(64, min(2 * self.num_chunks + 64, DIRECTORY_CACHE_BYTES // per_entry))

    def set_init_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> None:
        """``fn(ids)``: records of never-written sorted ``ids``. A sparse chunk file holds only
        the rows ever written; its other rows come from this. A store's own method is held
        weakly: a reference cycle would keep a store dropped without close() (and its writer
        lock) alive until the cycle collector ran."""
        self._init_rows = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)  # type: ignore[assignment]

    def init_rows(self, ids: np.ndarray) -> np.ndarray:
        fn = self._init_rows()
        if fn is None:  # a Disk used without its store (internal tools, tests)
            raise StoreError(f"the rows {ids[:4].tolist()}... of a sparse chunk need the store's initial values")
        return fn(ids)

    def close(self) -> None:
        if getattr(self, "pool", None) is not None:
            self.pool.close()  # before the folders' descriptors go
            self.segment_pool.close()
        for name in ("_root_fd", "_segments_fd", "_chunks_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                setattr(self, name, None)
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _dir_fd(self, path: Path) -> int:
        parent = path.parent.name
        return self._segments_fd if parent == "segments" else self._chunks_fd if parent == "chunks" else self._root_fd

    def _write(self, path: Path, kind: bytes, payload: bytes | memoryview, *, durable: bool = True) -> int:
        return write_file(path, kind, payload, self.uid, durable=durable, dir_fd=self._dir_fd(path))

    def _read_file(self, path: Path, kind: bytes, *, name: str | None = None) -> bytes:
        return read_file(path, kind, self.uid, name=name, unbound=self.unbound)

    # ---- paths -------------------------------------------------------------------------------
    def manifest_path(self, version: int) -> Path:
        return self.root / f"manifest-{version:012d}"

    def segment_path(self, seq: int) -> Path:
        return self.root / "segments" / f"s{seq:012d}"

    def chunk_path(self, chunk: int, gen: int) -> Path:
        return self.root / "chunks" / f"c{chunk:08d}-g{gen:08d}"

    def chunkmap_path(self, gen: int) -> Path:
        return self.root / f"chunkmap-{gen:08d}"

    # ---- meta, pins --------------------------------------------------------------------------
    @staticmethod
    def write_meta(root: Path, meta: dict) -> None:
        for sub in ("segments", "chunks"):
            try:
                os.mkdir(root / sub)
            except FileExistsError:
                pass
        write_file(root / "META", b"meta", json.dumps(meta).encode(), fileio.uuid_bytes(meta["uuid"]))

    @staticmethod
    def read_meta(root: Path) -> dict:
        """META's JSON, checked: the uuid in its header is the one it names (see validate.check_meta)."""
        path = root / "META"
        data = fileio.read_raw(path, "missing (not a lightning_embcache store?)")
        length, _ = parse_header(path, data, b"meta", ANY_STORE)
        meta = _json(path, read_file(path, b"meta", fileio.header_uuid(data)))
        if not isinstance(meta, dict) or not isinstance(meta.get("uuid"), str):
            raise CorruptStoreError(path, "is not a store description (no uuid)")
        try:
            uid = fileio.uuid_bytes(meta["uuid"])
        except ValueError as exc:
            raise CorruptStoreError(path, str(exc)) from None
        if uid != fileio.header_uuid(data):
            raise CorruptStoreError(path, "names a different uuid than its header")
        return meta

    def read_pins(self) -> set[int]:
        p = self.root / "PINS"
        if not p.exists():
            return set()
        obj = _json(p, self._read_file(p, b"pins"))
        pins = obj.get("pinned") if isinstance(obj, dict) else None
        if not isinstance(pins, list) or not all(_is_count(v) for v in pins):
            raise CorruptStoreError(p, "is not a list of pinned versions")
        return set(pins)

    def write_pins(self, pins: set[int]) -> None:
        self.bytes_written += self._write(self.root / "PINS", b"pins", json.dumps({"pinned": sorted(pins)}).encode())

    # ---- the newest published version: a monotone record ---------------------------------------
    def read_latest(self, newest: int) -> int:
        """The newest version ever published here (0 if none recorded), given the ``newest``
        manifest on disk: open() refuses a store whose newest manifest is gone instead of silently
        rolling back to an older one. ``LATEST`` is a hard link to the newest manifest, so it
        usually is that very file and need not be read."""
        try:
            st = os.stat("LATEST", dir_fd=self._root_fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        try:
            m = os.stat(self.manifest_path(newest).name, dir_fd=self._root_fd, follow_symlinks=False)
            if (m.st_ino, m.st_dev) == (st.st_ino, st.st_dev):
                return newest
        except FileNotFoundError:
            pass
        p = self.root / "LATEST"
        data = fileio.read_raw(p)
        # LATEST is bound to the name of the manifest it links to, which its payload names: that
        # payload is checked against the header's payload checksum first, then the header with it.
        payload = memoryview(data)[HEADER_SIZE:]
        v = None
        if len(data) >= HEADER_SIZE and crc32(payload) == int.from_bytes(data[44:48], "little"):
            try:
                obj = json.loads(bytes(payload))
                v = obj.get("version") if isinstance(obj, dict) else None
            except ValueError:
                pass
        if not _is_count(v):
            raise CorruptStoreError(p, "does not hold a version number (damaged, or not a manifest)")
        # the bytes already read, not LATEST again: a writer may have moved it on meanwhile, and a
        # second read would check the next manifest's bytes against this one's name
        fileio.check_file(p, data, b"manifest", self.uid, name=self.manifest_path(v).name, unbound=self.unbound)
        return v

    def write_latest(self, version: int) -> None:
        """Record ``version`` as the newest published: ``LATEST`` becomes a hard link to its
        manifest (no data written, nothing to tear). Called after the manifest's rename and
        directory fsync (the commit point), so it never names a version that is not durable; its
        own rename is made durable by the next flush's directory fsync (lagging by one after a
        crash only weakens the check, never fails it)."""
        tmp = f".LATEST.tmp{os.getpid()}-{threading.get_ident()}"
        src = self.manifest_path(version).name
        try:
            fileio.link(src, tmp, self._root_fd)
            fileio.rename(tmp, "LATEST", self._root_fd)
        except OSError as exc:
            try:
                os.unlink(tmp, dir_fd=self._root_fd)
            except OSError:
                pass
            raise io_error(exc, "recording the newest version in", self.root / "LATEST") from exc

    # ---- readers ------------------------------------------------------------------------------
    def reader_lock_path(self, version: int) -> Path:
        return self.root / f"readers-{version:012d}"

    def _open_reader_lock(self, version: int) -> int | None:
        """A descriptor of ``version``'s reader-lock file (created if missing); None where it
        cannot be (a read-only directory: nobody can reclaim or rewrite anything there either)."""
        try:
            return os.open(self.reader_lock_path(version).name, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644,
                           dir_fd=self._root_fd)
        except OSError:
            return None

    def lock_reader(self, version: int) -> int | None:
        """Hold a shared flock that keeps ``version`` from being reclaimed; None if not permitted."""
        fd = self._open_reader_lock(version)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    @staticmethod
    def unlock_reader(fd: int | None) -> None:
        if fd is not None:
            try:
                os.close(fd)  # closing drops the flock
            except OSError:
                pass

    def drop_version_unless_read(self, version: int) -> bool:
        """Delete ``version``'s manifest unless a reader holds it; True if deleted."""
        lock = self.reader_lock_path(version)
        fd = None
        try:
            fd = os.open(lock.name, os.O_RDWR | _NOFOLLOW, dir_fd=self._root_fd)
        except FileNotFoundError:
            pass
        except OSError:  # a symlink planted there: not ours, keep the version
            return False
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
        try:
            fileio.unlink(self.manifest_path(version).name, self._root_fd, self.manifest_path(version))
        except FileNotFoundError:
            pass
        except OSError:  # refused: the version stays (retention tries again at the next flush)
            if fd is not None:
                os.close(fd)
            return False
        if fd is not None:
            try:
                fileio.unlink(lock.name, self._root_fd, lock)
            except OSError:
                pass
            os.close(fd)
        return True

    # ---- manifests ---------------------------------------------------------------------------
    def list_versions(self) -> list[int]:
        where = self._root_fd if self._root_fd is not None else self.root  # after close(): by path
        return sorted(int(m.group(1)) for p in fileio.listdir(where) if (m := MANIFEST_RE.match(p)))

    def _manifest_bytes(self, version: int) -> tuple[Path, bytes]:
        """The bytes of ``version``'s manifest, read once: a manifest that retention drops at
        this moment is a VersionNotFoundError, never a half-checked file or a raw OSError."""
        path = self.manifest_path(version)
        try:
            where = (path.name, self._root_fd) if self._root_fd is not None else (str(path), None)  # after close()
            fd = os.open(where[0], os.O_RDONLY | _NOFOLLOW | os.O_CLOEXEC, dir_fd=where[1])
        except FileNotFoundError:
            raise VersionNotFoundError(f"version={version} of store {self.root} is not retained; retained versions: "
                                       f"{self.list_versions()}") from None
        except OSError as exc:
            raise io_error(exc, "reading", path) from exc
        try:
            with os.fdopen(fd, "rb", closefd=True) as f:
                return path, f.read()
        except OSError as exc:
            raise io_error(exc, "reading", path) from exc

    def read_manifest(self, version: int) -> Manifest:
        return self._parse_manifest(version, *self._manifest_bytes(version))

    def _parse_manifest(self, version: int, path: Path, data: bytes) -> Manifest:
        obj = _json(path, fileio.check_file(path, data, b"manifest", self.uid, unbound=self.unbound))
        if not isinstance(obj, dict):
            raise CorruptStoreError(path, "is not a manifest")
        v, cm, segs, parent = obj.get("version"), obj.get("chunkmap"), obj.get("segments"), obj.get("parent", 0)
        if not (_is_count(v) and _is_count(cm) and _is_count(parent) and isinstance(segs, list)
                and all(_is_count(s) and s > 0 for s in segs) and len(set(segs)) == len(segs)):
            raise CorruptStoreError(path, "manifest fields are not the expected non-negative integers")
        if v != version:
            raise CorruptStoreError(path, f"names version {v}, expected {version}")
        ident = obj.get("ident", "")
        if not isinstance(ident, str) or len(ident) > 64:
            raise CorruptStoreError(path, "manifest identity is not a short string")
        rows = obj.get("num_rows", 0)
        if not _is_count(rows) or rows > MAX_ROWS:
            raise CorruptStoreError(path, f"num_rows={rows!r} is not a row count")
        table = obj.get("table_rows", 0)
        if not _is_count(table) or table > MAX_ROWS:
            raise CorruptStoreError(path, f"table_rows={table!r} is not a row count")
        return Manifest(v, cm, list(segs), parent, ident, rows, table)

    def manifest_checksum(self, version: int) -> str:
        """Identity of ``version`` as its flush wrote it (a checkpoint records it to detect a store
        recreated at the same path): the checksum of that manifest, kept by compaction rewrites."""
        path, data = self._manifest_bytes(version)  # one read: header and identity of the same file
        ident = self._parse_manifest(version, path, data).ident
        _, pcrc = parse_header(path, data, b"manifest", self.uid, unbound=self.unbound)
        return ident or f"{pcrc:08x}"

    def lock_version_alone(self, version: int) -> int | None:
        """An exclusive flock on ``version``'s reader lock, so no reader opens it meanwhile
        (readers wait); None if a reader holds it now. Release with `unlock_reader`."""
        fd = self._open_reader_lock(version)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def write_manifest(self, m: Manifest) -> int:
        n = self._write(self.manifest_path(m.version), b"manifest", m.to_bytes())
        self.bytes_written += n
        return n

    # ---- chunk map ---------------------------------------------------------------------------
    def read_chunkmap(self, gen: int, num_rows: int = 0) -> np.ndarray:
        return self.read_chunkmap_folded(gen, num_rows)[0]

    def read_chunkmap_folded(self, gen: int, num_rows: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(generation of each chunk's base file, newest segment folded into it) of chunkmap
        ``gen``, of a table of ``num_rows`` rows (0: the rows this handle reads now). A chunkmap
        written before compaction recorded the latter holds only the former: then nothing counts
        as folded (re-folding a kept segment gives the same rows)."""
        nc = self.num_chunks if not num_rows else (num_rows + self.chunk_rows - 1) // self.chunk_rows
        if gen == 0:
            return np.zeros(nc, np.int32), np.zeros(nc, np.int64)
        path = self.chunkmap_path(gen)
        data = self._read_file(path, b"chunkmap")
        if len(data) not in (4 * nc, 12 * nc):
            raise CorruptStoreError(path, f"has {len(data)} bytes, expected 4 or 12 per chunk x {nc}")
        arr = np.frombuffer(data, np.int32, nc).copy()
        if len(arr) and (arr.min() < 0 or arr.max() > gen):
            raise CorruptStoreError(path, f"lists generations outside [0, {gen}]")
        folded = np.frombuffer(data, np.int64, nc, 4 * nc).copy() if len(data) == 12 * nc else np.zeros(nc, np.int64)
        if len(folded) and folded.min() < 0:
            raise CorruptStoreError(path, "lists negative segment numbers")
        return arr, folded

    def write_chunkmap(self, gen: int, cmap: np.ndarray, folded: np.ndarray | None = None) -> None:
        """Write chunk map ``gen``; the writer reads by it from here on (`bind_chunkmap`): it is
        written by a round or a growth about to publish it, and until then every file it names
        holds at least what it says (a file folded in place was before it is written; a new one
        has a new generation, which reads of the old layout do not ask for)."""
        payload = cmap.astype(np.int32).tobytes()
        if folded is not None:
            payload += folded.astype(np.int64).tobytes()
        n = self._write(self.chunkmap_path(gen), b"chunkmap", payload)
        self.bytes_written += n
        self.compaction_bytes_written += n
        self.bind_chunkmap(cmap, folded if folded is not None else np.zeros(len(cmap), np.int64))

    def bind_chunkmap(self, cmap: np.ndarray, folded: np.ndarray, newest: int | None = None) -> None:
        """Reads of this handle are of chunk map ``cmap`` (generation of each chunk's base file)
        and ``folded`` (newest segment folded into it): a raw chunk file that records holding an
        older segment than that is an older copy of the file put in its place, and is refused.
        ``newest``: a read-only handle's version lists no segment newer than this (and nobody
        folds its files meanwhile): a file recording a newer one than this and ``folded`` both
        is a copy from a later state of the store, and is refused too."""
        self._folds = (np.asarray(cmap, np.int64).copy(), np.asarray(folded, np.int64).copy())
        self._folds_newest = newest

    def check_folded(self, path: object, chunk: int, gen: int, held: int | None, folded: int | None = None) -> None:
        """CorruptStoreError if raw chunk file (chunk, gen), recording that it holds the segments
        up to ``held`` (None: a file from before raw files recorded it, never folded in place),
        holds fewer than a chunk map naming it says: ``folded``, or where None the chunk map this
        handle reads (`bind_chunkmap`; a generation it does not name is not checked). A file
        folded in place keeps its name: this is what tells a copy of it from before a fold."""
        if held is None:
            return
        if folded is None:
            folds = self._folds
            if folds is None or chunk >= len(folds[0]) or folds[0][chunk] != gen:
                return
            folded = int(folds[1][chunk])
            newest = self._folds_newest
            if newest is not None and held > max(folded, newest):
                raise CorruptStoreError(
                    path, f"holds the rows of chunk {chunk} up to segment {held}, newer than any segment of the "
                    f"version read (up to {max(folded, newest)}): a copy of this file from a later state of the "
                    f"store was put in its place (it would serve newer rows). Put the store's own file back, or "
                    f"restore the whole store from a backup")
        if held < folded:
            raise CorruptStoreError(
                path, f"holds the rows of chunk {chunk} up to segment {held}, but the chunk map naming it says "
                f"segment {folded} was folded into it: an older copy of this file was put in its place (it would "
                f"serve older rows). Put the store's own file back, or restore the whole store from a backup")

    # ---- base chunks -------------------------------------------------------------------------
    def chunk_rows_of(self, chunk: int) -> int:
        return min(self.chunk_rows, self.num_rows - chunk * self.chunk_rows)

    def read_chunk(self, chunk: int, gen: int, *, verify: bool = True) -> np.ndarray:
        """A whole base chunk, every byte checksum-verified; the rows a sparse file does not hold
        are filled in with their initial values (`init_rows`)."""
        present, recs = self.read_chunk_present(chunk, gen, verify=verify)
        if present is None:
            return recs
        rows = self.chunk_rows_of(chunk)
        dense = np.empty((rows, self.row_bytes), np.uint8)
        absent = np.ones(rows, np.bool_)
        absent[present] = False
        rest = np.flatnonzero(absent)
        if len(rest):
            dense[rest] = self.init_rows(rest + chunk * self.chunk_rows)
        dense[present] = recs
        return dense

    def read_chunk_present(self, chunk: int, gen: int, *, verify: bool = True,
                           folded: int | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """(rows held, their records) of a base chunk file, every byte checksum-verified: rows
        held is None for a dense file (raw or LZ4: every row, in order), else the sorted
        chunk-relative rows of a sparse file, whose records are those rows' only.

        A raw or sparse chunk is read through one descriptor (header, directory, records):
        compaction reads thousands of chunks from a background thread, and each system call there
        is a hand-over of the GIL with the training thread (four opens per chunk cost more than
        its bytes). ``verify=False``: a file this handle wrote (the caller knows). ``folded``: the
        newest segment the chunk map naming the file says it holds (`check_folded`; None: the
        chunk map this handle reads)."""
        epoch = self.pool.begin_read()
        try:
            return self._read_chunk_present(chunk, gen, verify, folded)
        finally:
            self.pool.end_read(epoch)

    def _read_chunk_present(self, chunk: int, gen: int, verify: bool,
                            folded: int | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        path = self.chunk_path(chunk, gen)
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except FileNotFoundError:
            raise CorruptStoreError(path, "missing: the chunk map lists it but it is gone") from None
        except OSError as exc:
            raise io_error(exc, "reading", path) from exc
        present = None
        try:
            head = os.pread(fd, HEADER_SIZE, 0)
            kind = head[8:16].rstrip(b"\0")
            data = None
            if kind in (b"chunkraw", SPARSE_KIND):
                if kind == b"chunkraw":
                    rows, crcs, data_off = self._raw_chunk_directory(path, chunk, fd=fd, head=head, gen=gen,
                                                                     folded=folded)
                else:
                    present, crcs, data_off = self._sparse_chunk_directory(path, chunk, fd=fd, head=head)
                    rows = len(present)
                data = self._pread_into(path, data_off, rows * self.row_bytes, fd)
                self.bytes_read += HEADER_SIZE
        finally:
            os.close(fd)
        if data is None:  # LZ4 (or damaged: read_file names what is wrong)
            payload = self._read_file(path, b"chunk")
            if len(payload) < _CHUNK_HEAD.size:
                raise CorruptStoreError(path, "chunk header is truncated")
            c, rows, raw_len, _ = _CHUNK_HEAD.unpack_from(payload)
            self._check_chunk_head(path, chunk, c, rows, raw_len)
            try:
                raw = lz4.block.decompress(memoryview(payload)[_CHUNK_HEAD.size :], uncompressed_size=raw_len)
            except lz4.block.LZ4BlockError as exc:
                raise CorruptStoreError(path, f"LZ4 data does not decompress: {exc}") from None
            if len(raw) != raw_len:
                raise CorruptStoreError(path, f"LZ4 data decompresses to {len(raw)} bytes, expected {raw_len}")
            self.bytes_read += len(payload) + HEADER_SIZE
            return None, np.frombuffer(bytearray(raw), np.uint8).reshape(rows, self.row_bytes)
        if verify:
            bad = first_bad_block(data, crcs)  # one GIL-free pass over the chunk
            if bad >= 0:
                raise CorruptStoreError(path, f"block {bad} of chunk {chunk} fails its checksum")
        return present, data.reshape(rows, self.row_bytes)

    def read_chunk_rows(self, chunk: int, gen: int, local: np.ndarray) -> np.ndarray | None:
        """Only rows ``local`` (chunk-relative) of a raw base chunk, reading and verifying just the
        4 KiB blocks that hold them; None for an LZ4 or sparse chunk (read it whole: `read_chunk`).

        The per-miss path of random access to a table larger than RAM: one pread per row after the
        chunk's checksummed directory, which is read and verified once and then kept (a few bytes
        per block; dropped when compaction folds the file in place: `Versioning._forget_chunk_file`).
        """
        epoch = self.pool.begin_read()
        try:
            return self._read_chunk_rows(chunk, gen, local)
        finally:
            self.pool.end_read(epoch)

    def _read_chunk_rows(self, chunk: int, gen: int, local: np.ndarray) -> np.ndarray | None:
        path = f"{self._chunks_dir}/c{chunk:08d}-g{gen:08d}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptStoreError(path, "missing: the chunk map lists it but it is gone") from None
        try:
            rb = self.row_bytes
            rows = self.chunk_rows_of(chunk)
            raw_len = rows * rb
            nblocks = -(-raw_len // BLOCK)
            dlen = _CHUNK_HEAD.size + 4 * nblocks
            base = HEADER_SIZE + dlen
            key = (chunk, gen)
            crcs = self._directories.get(key, False)
            if crcs is False:
                # One pread of header + directory, parsed inline: routing this through
                # _raw_chunk_directory (two preads, Path objects) cost 30% on random gets.
                hd = os.pread(fd, HEADER_SIZE + dlen, 0)
                self.bytes_read += len(hd)
                if hd[8:16] != b"chunkraw":
                    self._remember_directory(key, None)
                    return None
                length, pcrc = parse_header(path, hd[:HEADER_SIZE], b"chunkraw", self.uid, unbound=self.unbound)  # type: ignore[arg-type]
                if length != dlen or len(hd) != HEADER_SIZE + dlen or crc32(hd[HEADER_SIZE:]) != pcrc:
                    raise CorruptStoreError(path, "chunk directory is truncated or fails its checksum")
                c, r, rl, held = raw_head(path, memoryview(hd)[HEADER_SIZE:], rb)
                self._check_chunk_head(path, chunk, c, r, rl)  # type: ignore[arg-type]
                self.check_folded(path, chunk, gen, held)
                # kept as 4 bytes per block (a list of ints would cost ~36)
                crcs = np.frombuffer(hd, np.uint32, nblocks, HEADER_SIZE + _CHUNK_HEAD.size).copy()
                self._remember_directory(key, crcs)
            elif crcs is None:
                return None
            assert isinstance(crcs, np.ndarray)
            out = np.empty((len(local), rb), np.uint8)
            for i, row in enumerate(local.tolist()):
                off = row * rb
                b0, b1 = off // BLOCK, (off + rb - 1) // BLOCK
                lo, hi = b0 * BLOCK, min((b1 + 1) * BLOCK, raw_len)
                data = os.pread(fd, hi - lo, base + lo)
                if len(data) != hi - lo:
                    raise CorruptStoreError(path, f"truncated: block {b0} of chunk {chunk} is short")
                for b in range(b0, b1 + 1):
                    if crc32(data[(b - b0) * BLOCK : (b - b0 + 1) * BLOCK]) != crcs[b]:
                        raise CorruptStoreError(path, f"block {b} of chunk {chunk} fails its checksum")
                out[i] = np.frombuffer(data, np.uint8, rb, off - lo)
                self.bytes_read += hi - lo
            return out
        finally:
            os.close(fd)

    def write_chunk(self, chunk: int, gen: int, records: np.ndarray, compress: bool, *, durable: bool = True,
                    present: np.ndarray | None = None, folded: int = 0) -> None:
        """Write base chunk ``chunk`` of generation ``gen``: every row's ``records`` (raw, or LZ4
        when ``compress`` and it pays), or with ``present`` (sorted chunk-relative rows) a sparse
        file holding just those rows' ``records``: the others keep their initial values.
        ``durable=False``: no fsync (a compaction round makes its files durable at once with
        `sync_chunks` before it publishes them). ``folded``: the newest segment whose records
        ``records`` hold (the chunk map's for this file), recorded in a raw file."""
        if present is not None:
            self._write_sparse_chunk(chunk, gen, present, records, durable)
            return
        raw = np.ascontiguousarray(records).data.cast("B")  # the records' bytes, not a copy
        if compress:
            packed = lz4.block.compress(raw, store_size=False)
            if len(raw) >= MIN_RATIO * len(packed):
                head = _CHUNK_HEAD.pack(chunk, len(records), len(raw), 1)
                parts = pack(b"chunk", head + packed, self.uid, self.chunk_path(chunk, gen).name)
                self._write_chunk_file(chunk, gen, parts, durable)
                return
        # Raw chunks carry a checksum per 4 KiB block, so a miss can read just the rows it needs.
        directory = raw_directory(chunk, len(records), _block_crcs(raw), folded)
        self._write_chunk_file(
            chunk, gen, pack(b"chunkraw", directory, self.uid, self.chunk_path(chunk, gen).name) + [raw], durable
        )

    def _write_sparse_chunk(
        self, chunk: int, gen: int, present: np.ndarray, records: np.ndarray, durable: bool
    ) -> None:
        """``header | directory (chunk, rows, count, length; a bitmap of the rows held; a crc32 per
        4 KiB block of their records) | their records, packed in row order``: the file offset of a
        row held is its rank among the rows held, so a miss reads just its blocks, as in a raw chunk."""
        rows = self.chunk_rows_of(chunk)
        held = np.zeros(-(-rows // 64) * 64, np.bool_)
        held[present] = True
        raw = np.ascontiguousarray(records).data.cast("B")
        crcs = _block_crcs(raw)
        directory = (
            _SPARSE_HEAD.pack(chunk, rows, len(present), len(raw))
            + np.packbits(held, bitorder="little").tobytes()
            + crcs.tobytes()
        )
        self._write_chunk_file(
            chunk, gen, pack(SPARSE_KIND, directory, self.uid, self.chunk_path(chunk, gen).name) + [raw], durable
        )

    def _write_chunk_file(self, chunk: int, gen: int, parts: list, durable: bool) -> None:
        """Create chunk file ``(chunk, gen)`` from ``parts``, overwriting a pooled replaced file
        where one may be reused (recycle.py)."""
        n = write_parts(self.chunk_path(chunk, gen), parts, dir_fd=self._chunks_fd, durable=durable,
                        reuse=self.pool.take())
        self.bytes_written += n
        self.compaction_bytes_written += n

    def sync_chunks(self, chunks: list[int], gen: int) -> None:
        """Make chunk files written with ``durable=False`` durable (before a manifest names them)."""
        if chunks:
            fileio.sync_written(self._chunks_fd, [self.chunk_path(c, gen).name for c in chunks], self.root / "chunks")

    def raw_chunk_data_offset(self, chunk: int) -> int:
        """Where a dense raw chunk file of ``chunk`` has its records: after its header and
        directory, whose size the chunk's shape fixes (a read of a whole file can be asked for
        before its header was read: `ChunkLoader`)."""
        return HEADER_SIZE + _CHUNK_HEAD.size + 4 * -(-self.chunk_rows_of(chunk) * self.row_bytes // BLOCK)

    def raw_chunk_checksums(self, chunk: int, gen: int, head: bytes, folded: int | None = None) -> np.ndarray:
        """The block checksums in ``head`` (the first `raw_chunk_data_offset` bytes of chunk file
        (chunk, gen)), everything in it checked (``folded``: see `check_folded`); CorruptStoreError
        if it is not a dense raw chunk of this store's ``chunk`` (a sparse or LZ4 file too)."""
        path = self.chunk_path(chunk, gen)
        if len(head) != self.raw_chunk_data_offset(chunk):
            raise CorruptStoreError(path, "truncated: shorter than its header")
        return self._raw_chunk_directory(
            path, chunk, head=bytes(head[:HEADER_SIZE]), directory=bytes(head[HEADER_SIZE:]), gen=gen, folded=folded
        )[1]

    def _raw_chunk_directory(
        self,
        path: Path,
        chunk: int,
        *,
        fd: int | None = None,
        head: bytes | None = None,
        directory: bytes | None = None,
        gen: int = 0,
        folded: int | None = None,
    ) -> tuple[int, np.ndarray, int]:
        """(rows, block checksums, offset of the records) of raw chunk file ``path`` of ``chunk``
        (generation ``gen``), its directory checked: checksum, chunk, rows, and that it holds what
        the chunk map naming it says (`check_folded`)."""
        head = head if head is not None else self._pread(path, 0, HEADER_SIZE, fd=fd)
        length, pcrc = parse_header(path, head, b"chunkraw", self.uid, unbound=self.unbound)
        if length != _CHUNK_HEAD.size + 4 * -(-self.chunk_rows_of(chunk) * self.row_bytes // BLOCK):
            raise CorruptStoreError(path, f"chunk directory of {length} bytes does not fit chunk {chunk}")
        if directory is None:
            directory = self._pread(path, HEADER_SIZE, length, fd=fd)
        if crc32(directory) != pcrc:
            raise CorruptStoreError(path, "chunk directory fails its checksum")
        c, rows, raw_len, held = raw_head(path, directory, self.row_bytes)
        self._check_chunk_head(path, chunk, c, rows, raw_len)
        self.check_folded(path, chunk, gen, held, folded)
        crcs = np.frombuffer(directory, np.uint32, offset=_CHUNK_HEAD.size)
        if len(crcs) != -(-raw_len // BLOCK):
            raise CorruptStoreError(path, "chunk directory has the wrong number of block checksums")
        return rows, crcs, HEADER_SIZE + length

    def _sparse_chunk_directory(
        self, path: Path, chunk: int, *, fd: int | None = None, head: bytes | None = None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """(sorted chunk-relative rows held, block checksums of their records, offset of the
        records) of a sparse chunk file, its directory checked: checksum, chunk, row count, a
        bitmap whose bits match the count, one checksum per block."""
        head = head if head is not None else self._pread(path, 0, HEADER_SIZE, fd=fd)
        length, pcrc = parse_header(path, head, SPARSE_KIND, self.uid, unbound=self.unbound)
        rows = self.chunk_rows_of(chunk)
        bitmap = -(-rows // 64) * 8
        if (
            length < _SPARSE_HEAD.size + bitmap
            or length > _SPARSE_HEAD.size + bitmap + 4 * -(-rows * self.row_bytes // BLOCK)
            or (length - _SPARSE_HEAD.size - bitmap) % 4
        ):
            raise CorruptStoreError(path, f"sparse chunk directory of {length} bytes does not fit chunk {chunk}")
        directory = self._pread(path, HEADER_SIZE, length, fd=fd)
        if crc32(directory) != pcrc:
            raise CorruptStoreError(path, "chunk directory fails its checksum")
        c, r, count, data_len = _SPARSE_HEAD.unpack_from(directory)
        if c != chunk or r != rows or count > rows or data_len != count * self.row_bytes:
            raise CorruptStoreError(
                path, f"describes chunk {c} with {count} of {r} rows; expected chunk {chunk} with at most {rows}"
            )
        held = np.unpackbits(np.frombuffer(directory, np.uint8, bitmap, _SPARSE_HEAD.size), bitorder="little")
        present = np.flatnonzero(held)
        if len(present) != count or (count and present[-1] >= rows):
            raise CorruptStoreError(path, f"sparse chunk bitmap lists {len(present)} rows, its header {count}")
        crcs = np.frombuffer(directory, np.uint32, offset=_SPARSE_HEAD.size + bitmap)
        if len(crcs) != -(-data_len // BLOCK):
            raise CorruptStoreError(path, "chunk directory has the wrong number of block checksums")
        return present, crcs, HEADER_SIZE + length

    def _check_chunk_head(self, path: Path, chunk: int, c: int, rows: int, raw_len: int) -> None:
        if c != chunk or rows != self.chunk_rows_of(chunk) or raw_len != rows * self.row_bytes:
            raise CorruptStoreError(path, f"describes chunk {c} with {rows} rows; expected chunk {chunk}")

    def _pread_into(self, path: Path, offset: int, n: int, fd: int) -> np.ndarray:
        """``n`` bytes at ``offset`` into a new writable array (callers change the records they
        get): one copy out of the page cache, where bytes made writable took a second."""
        buf = np.empty(n, np.uint8)
        got = os.preadv(fd, [buf.data], offset) if n else 0
        if got != n:
            raise CorruptStoreError(path, f"truncated: wanted {n} bytes at offset {offset}, got {got}")
        self.bytes_read += n
        return buf

    def _pread(self, path: Path, offset: int, n: int, fd: int | None = None) -> bytes:
        if fd is not None:
            data = os.pread(fd, n, offset)
        else:
            try:
                own = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptStoreError(path, "missing: the chunk map lists it but it is gone") from None
            try:
                data = os.pread(own, n, offset)
            finally:
                os.close(own)
        if len(data) != n:
            raise CorruptStoreError(path, f"truncated: wanted {n} bytes at offset {offset}, got {len(data)}")
        self.bytes_read += n
        return data

    # ---- segments ----------------------------------------------------------------------------
    def write_segment(
        self,
        seq: int,
        ids: np.ndarray,
        records: np.ndarray | Callable[[int, int], np.ndarray] | RecordsInto,
        *,
        durable: bool = True,
        block_bytes: int | None = None,
        reuse: bool = False,
    ) -> Segment:
        """Write sorted unique ``ids`` and their records as segment ``seq``.

        ``records`` is an array, or a function ``(a, b) -> records of ids[a:b]`` called for blocks
        of about ``block_bytes`` (default `SEGMENT_BLOCK_BYTES`): a flush of many dirty rows then
        holds two blocks in memory, not a copy of every dirty row. A `RecordsInto` (a flush's
        snapshot) gathers each block into one of two buffers used in turn (`fileio._write_stream`
        has written block k before block k + 2 is made). ``durable=False`` (write-back of evicted
        rows) skips the fsync; the flush that first lists the segment in a manifest syncs it
        before publishing. ``reuse``: overwrite a dropped segment file kept for it (segpool.py;
        a flush, which holds the writer lock) if there is one, instead of creating a file.
        """
        rb = self.row_bytes
        n = len(ids)
        chunks = ids // self.chunk_rows
        starts = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1]]) if n else np.zeros(0, np.int64)
        counts = np.diff(np.r_[starts, n]).astype(np.int64)
        index = np.zeros((4, len(starts)), np.int64)
        index[0], index[1], index[2] = chunks[starts], starts, counts
        # Blocks end on index-entry boundaries so each entry's checksum is computed in one piece.
        per_block = max(1, (block_bytes or SEGMENT_BLOCK_BYTES) // max(rb, 1))
        bounds = [0]
        for e, (st, ct) in enumerate(zip(starts.tolist(), counts.tolist())):
            if st + ct - int(starts[bounds[-1]]) >= per_block or e == len(starts) - 1:
                bounds.append(e + 1)
        blocks = [(e0, e1, int(starts[e0]), int(starts[e1 - 1] + counts[e1 - 1]))
                  for e0, e1 in zip(bounds[:-1], bounds[1:])]
        directory_size = _SEG_HEAD.size + 8 * n + index.nbytes
        fetch = _block_source(records, rb, max((b - a for _, _, a, b in blocks), default=0))

        def body() -> Iterator[memoryview]:
            for k, (e0, e1, a, b) in enumerate(blocks):
                block = np.ascontiguousarray(fetch(k, a, b)).reshape(-1)
                for e in range(e0, e1):
                    lo = (int(starts[e]) - a) * rb
                    index[3, e] = crc32(block[lo : lo + int(counts[e]) * rb].data)
                yield block.data

        def head() -> bytes:
            directory = (
                _SEG_HEAD.pack(n, rb, index.shape[1], self.chunk_rows)
                + ids.astype(np.int64).tobytes()
                + index.tobytes()
            )
            return b"".join(bytes(p) for p in pack(b"segment", directory, self.uid, self.segment_path(seq).name))

        path = self.segment_path(seq)
        t0 = time.perf_counter()
        pooled = self.segment_pool.take(HEADER_SIZE + directory_size + n * rb) if reuse else None
        size = write_parts(path, body(), durable=durable, head=head, head_size=HEADER_SIZE + directory_size,
                           dir_fd=self._segments_fd, reuse=pooled)
        if not durable:
            self.write_back_seconds += time.perf_counter() - t0
        self.bytes_written += size
        return Segment(
            seq,
            path,
            ids.astype(np.int64),
            index[0],
            index[1],
            index[2],
            index[3],
            HEADER_SIZE + directory_size,
            rb,
            size,
            read_counter=self.segment_reads,
        )

    def _remember_directory(self, key: tuple[int, int], crcs: np.ndarray | None) -> None:
        if len(self._directories) >= self._directories_max:
            self._directories.clear()  # bounded: a few bytes per block of the chunks recently read
        self._directories[key] = crcs

    @property
    def total_bytes_read(self) -> int:
        """Bytes read from every store file: chunks, manifests, maps and segments."""
        return self.bytes_read + self.segment_reads[0]

    def sync_segments(self, segs: list[Segment]) -> None:
        """Make segments written with ``durable=False`` durable before a manifest lists them: their
        bytes (an fsync each) and their names (one fsync of ``segments/``; a flush that writes no
        segment of its own would otherwise leave their renames in the page cache)."""
        for seg in segs:
            self.sync_segment(seg)
        if segs:
            try:
                fileio.fsync(self._segments_fd, self.root / "segments")
            except OSError as exc:
                raise io_error(exc, "syncing", self.root / "segments") from exc

    def sync_segment(self, seg: Segment) -> None:
        try:
            fd = os.open(seg.path.name, os.O_RDONLY | _NOFOLLOW, dir_fd=self._segments_fd)
            try:
                fileio.fsync(fd, seg.path)
            finally:
                os.close(fd)
        except OSError as exc:
            raise io_error(exc, "syncing", seg.path) from exc

    def open_segment(self, seq: int) -> Segment:
        path = self.segment_path(seq)
        try:
            fd = os.open(path.name, os.O_RDONLY | _NOFOLLOW, dir_fd=self._segments_fd)
        except FileNotFoundError:
            raise CorruptStoreError(path, "missing: a manifest lists it but it is gone") from None
        except OSError as exc:
            raise io_error(exc, "reading", path) from exc
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEADER_SIZE, 0)
            length, pcrc = parse_header(path, head, b"segment", self.uid, unbound=self.unbound)
            if length > size - HEADER_SIZE:  # never allocate what a crafted header claims
                raise CorruptStoreError(path, f"truncated: header says {length} bytes of directory, file has {size}")
            directory = os.pread(fd, length, HEADER_SIZE)
        finally:
            os.close(fd)
        if len(directory) != length or crc32(directory) != pcrc:
            raise CorruptStoreError(path, "segment directory is truncated or fails its checksum")
        if length < _SEG_HEAD.size:
            raise CorruptStoreError(path, "segment directory is too short")
        n, rb, entries, chunk_rows = _SEG_HEAD.unpack_from(directory)
        if rb != self.row_bytes or chunk_rows != self.chunk_rows:
            raise CorruptStoreError(path, f"row size {rb}/chunk rows {chunk_rows} do not match the store")
        off = _SEG_HEAD.size
        if length != off + 8 * n + 32 * entries:
            raise CorruptStoreError(
                path, f"directory of {length} bytes does not hold {n} ids and {entries} index entries"
            )
        ids = np.frombuffer(directory, np.int64, n, off)
        index = np.frombuffer(directory, np.int64, 4 * entries, off + 8 * n).reshape(4, entries)
        records_offset = HEADER_SIZE + length
        if size != records_offset + n * rb:
            raise CorruptStoreError(path, f"truncated: {size} bytes, expected {records_offset + n * rb}")
        self._check_segment_index(path, ids, index)
        self.bytes_read += records_offset
        return Segment(
            seq,
            path,
            ids.copy(),
            index[0].copy(),
            index[1].copy(),
            index[2].copy(),
            index[3].copy(),
            records_offset,
            rb,
            size,
            read_counter=self.segment_reads,
        )

    def _check_segment_index(self, path: Path, ids: np.ndarray, index: np.ndarray) -> None:
        """A checksummed directory can still be crafted: its ids must be sorted, unique, in range,
        and its index must cover them chunk by chunk, or a read could serve a row as another's."""
        n = len(ids)
        if n and (ids[0] < 0 or ids[-1] >= self.num_rows or (n > 1 and not (ids[1:] > ids[:-1]).all())):
            raise CorruptStoreError(path, f"lists ids that are not sorted, unique and in [0, {self.num_rows})")
        chunk, start, count, crc = index
        chunks = ids // self.chunk_rows
        want_starts = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1]]) if n else np.zeros(0, np.int64)
        if (
            len(start) != len(want_starts)
            or not np.array_equal(start, want_starts)
            or not np.array_equal(count, np.diff(np.r_[want_starts, n]))
            or not np.array_equal(chunk, chunks[want_starts])
            or (len(crc) and (crc.min() < 0 or crc.max() > 0xFFFFFFFF))
        ):
            raise CorruptStoreError(path, "segment index does not match its ids")

    # ---- garbage -----------------------------------------------------------------------------
    def referenced(self, versions: list[int]) -> tuple[set[int], set[int], set[tuple[int, int]]]:
        """(segments, chunkmap generations, (chunk, gen) base files) used by ``versions``."""
        segs: set[int] = set()
        gens: set[int] = set()
        files: set[tuple[int, int]] = set()
        for v in versions:
            try:
                m = self.read_manifest(v)
            except (VersionNotFoundError, CorruptStoreError):
                if self.manifest_path(v).exists():
                    raise
                continue  # dropped by retention since it was listed: nothing of it to keep
            segs.update(m.segments)
            if m.chunkmap not in gens:
                gens.add(m.chunkmap)
                cmap = self.read_chunkmap(m.chunkmap, m.num_rows or self.created_rows)
                nz = np.flatnonzero(cmap)
                files.update(zip(nz.tolist(), cmap[nz].tolist()))
        return segs, gens, files

    def collect_garbage(
        self,
        keep_versions: list[int],
        keep_segments: set[int],
        keep_gens: set[int],
        new_seq: int,
        new_gen: int,
        *,
        remove_temp: bool,
        keep_files: Set[tuple[int, int]] = frozenset(),
        pool: bool = False,
        stop: Callable[[], bool] = lambda: False,
    ) -> list[tuple[int, int]]:
        """Delete files no kept version uses (crash leftovers, compacted deltas); return the
        (chunk, gen) base files moved into `pool` for reuse instead (``pool``: while it has room).
        ``stop()`` is asked before each file goes: once it says True nothing more is deleted (a
        store that met damage keeps every file from that moment, even mid-collection).

        ``keep_segments``/``keep_gens``/``keep_files`` ((chunk, gen) pairs) protect what the live
        store uses or is writing right now; temporary files are only removed when no write of this
        process can be in progress. The caller makes pooled files unreachable by its cached
        descriptors, then calls ``pool.seal()``.
        """
        segs, gens, files = self.referenced(keep_versions)
        segs |= keep_segments
        gens |= keep_gens
        files = files | set(keep_files)
        pooled: list[tuple[int, int]] = []

        def drop(p: Path) -> None:
            if stop():
                return
            try:  # a symlink is removed itself, never its target
                fileio.unlink(p.name, self._dir_fd(p), p)
            except OSError:  # deleted concurrently, or refused: garbage stays for the next collection
                pass

        def is_temp(name: str) -> bool:
            return name.startswith(".") and ".tmp" in name

        for d, dfd in (
            (self.root, self._root_fd),
            (self.root / "segments", self._segments_fd),
            (self.root / "chunks", self._chunks_fd),
        ):
            # names only (a Path per name cost more than the listing on a table of 15K chunk files)
            for name in fileio.listdir(dfd):  # the folder we hold open, not whatever the path names now
                if is_temp(name):
                    if remove_temp:
                        drop(d / name)
                elif d.name == "segments":
                    m = SEGMENT_RE.match(name)
                    if m and int(m.group(1)) < new_seq and int(m.group(1)) not in segs and not stop():
                        self.retire_segment(d / name)
                elif d.name == "chunks":
                    m = CHUNK_RE.match(name)
                    if m is None:
                        continue  # not a store file: never ours to delete
                    gen = int(m.group(2))
                    key = (int(m.group(1)), gen)
                    if (gen < new_gen and gen not in gens and key not in files and not stop()
                            and self.retire_chunk(*key, pool=pool)):
                        pooled.append(key)
                elif (m := CHUNKMAP_RE.match(name)) is not None:
                    gen = int(m.group(1))
                    if gen < new_gen and gen not in gens:
                        drop(d / name)
        return pooled

    def retire_segment(self, path: Path) -> None:
        """Dropped segment file ``path`` goes: into `segment_pool` for the next flush to
        overwrite, where it has room, else deleted. Caller has published a layout without it."""
        if not self.segment_pool.put(path.name):
            self.delete_file(path)

    def retire_chunk(self, chunk: int, gen: int, *, pool: bool) -> bool:
        """Garbage chunk file ``(chunk, gen)`` goes: into `pool` for reuse (``pool``: while it has
        room; True) or deleted (False). A symlink planted there is deleted, never reused."""
        name = self.chunk_path(chunk, gen).name
        if pool and self.pool.room() and self._regular(name) and self.pool.put(name):
            return True
        self.delete_file(self.chunk_path(chunk, gen))
        return False

    def delete_file(self, path: Path) -> None:
        """Delete one store file (a symlink is removed itself, never its target); one already
        gone, or refused, stays for the next full collection."""
        try:
            fileio.unlink(path.name, self._dir_fd(path), path)
        except OSError:
            pass

    def _regular(self, name: str) -> bool:
        """``name`` in ``chunks/`` is a plain file (a symlink planted there is deleted, never reused)."""
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self._chunks_fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def disk_bytes(self) -> int:
        total = 0
        for d in (self.root, self.root / "segments", self.root / "chunks"):
            with os.scandir(d) as it:
                for e in it:
                    try:
                        if e.is_file():
                            total += fileio.held_bytes(e.stat())  # holes punched in segments excluded
                    except FileNotFoundError:  # a temp file renamed by a background write
                        pass
        return total

    def max_seq_and_gen(self) -> tuple[int, int]:
        seq = max((int(m.group(1)) for p in fileio.listdir(self._segments_fd) if (m := SEGMENT_RE.match(p))), default=0)
        gen = max((int(m.group(1)) for p in fileio.listdir(self._root_fd) if (m := CHUNKMAP_RE.match(p))), default=0)
        cgen = max((int(m.group(2)) for p in fileio.listdir(self._chunks_fd) if (m := CHUNK_RE.match(p))), default=0)
        return seq, max(gen, cgen)
