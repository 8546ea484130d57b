"""Cold tier: the on-disk, log-structured layout (see docs/store-format.md).

    META                     immutable table description (rows, schema, chunking, init)
    manifest-<version>       one per retained version: chunk map generation + segment list
    chunkmap-<gen>           per chunk, the generation of its base file (0 = never written)
    chunks/c<chunk>-g<gen>   immutable base chunk (raw or LZ4)
    segments/s<seq>          immutable delta segment: the rows one flush (or one write-back) wrote
    PINS                     versions that must never be reclaimed (checkpoints)
    LOCK                     the writer's flock

A flush writes one segment (O(dirty rows)) and one small manifest; background compaction folds
segments into new base chunk files. Every file is checksummed; every replacement is atomic.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import lz4.block
import numpy as np

from .errors import CorruptStoreError, VersionNotFoundError
from .fileio import HEADER_SIZE, crc32, pack, parse_header, read_file, write_file, write_parts
from .warm import MIN_RATIO

_SEG_HEAD = struct.Struct("<QQQI")  # rows, row_bytes, index entries, chunk_rows
_CHUNK_HEAD = struct.Struct("<QQQB")  # chunk, rows, raw length, compressed flag
BLOCK = 4096  # raw chunks: one checksum per block of this many bytes
MANIFEST_RE = re.compile(r"^manifest-(\d{12})$")
SEGMENT_RE = re.compile(r"^s(\d{12})$")
CHUNK_RE = re.compile(r"^c(\d+)-g(\d+)$")


DIRECTORY_CACHE_BYTES = 16 << 20  # verified block checksums of raw chunks kept for sparse reads


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
    # chunk -> (index entry, first row, row count): a miss asks a segment about one chunk at a time,
    # and a dict answers that without numpy's per-call overhead (built on first use)
    _entries: dict[int, tuple[int, int, int]] | None = field(default=None, repr=False)

    def _entry(self, chunk: int) -> tuple[int, int, int] | None:
        entries = self._entries
        if entries is None:
            entries = self._entries = {
                c: (i, a, n) for i, (c, a, n) in enumerate(zip(self.idx_chunk.tolist(), self.idx_start.tolist(),
                                                              self.idx_count.tolist()))
            }
        return entries.get(chunk)

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

    def rows_for(self, chunk: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(mask of ``ids`` this segment holds, their records); None if it holds none of them.

        The first read of a chunk's range verifies the whole range's checksum; later reads of that
        range fetch single records (random access to a large table reads each range in full once
        per open, then only the rows it asks for).
        """
        entry = self._entry(chunk)
        if entry is None:
            return None
        i, start, count = entry
        mine = self.ids[start : start + count]
        pos = mine.searchsorted(ids)
        pos[pos >= count] = count - 1
        hit = mine[pos] == ids
        if not hit.any():
            return None
        rb = self.row_bytes
        if self._verified is None:
            self._verified = np.zeros(len(self.idx_chunk), np.bool_)
        if not self._verified[i]:
            data = self._read(self.records_offset + start * rb, count * rb)
            if crc32(data) != int(self.idx_crc[i]):
                raise CorruptStoreError(self.path, f"records of chunk {chunk} fail their checksum")
            self._verified[i] = True
            return hit, np.frombuffer(data, np.uint8).reshape(count, rb)[pos[hit]]
        out = np.empty((int(hit.sum()), rb), np.uint8)
        for k, p in enumerate(pos[hit].tolist()):
            out[k] = np.frombuffer(self._read(self.records_offset + (start + p) * rb, rb), np.uint8)
        return hit, out

    def _read(self, offset: int, n: int) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise CorruptStoreError(self.path, f"truncated: wanted {n} bytes at offset {offset}, got {len(data)}")
        if self.read_counter is not None:
            self.read_counter[0] += n
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class Manifest:
    version: int
    chunkmap: int  # generation of the chunkmap file; 0 = every chunk unwritten
    segments: list[int]  # segment seqs, oldest first
    parent: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"version": self.version, "chunkmap": self.chunkmap, "segments": self.segments,
             "parent": self.parent, "time": time.time()}
        ).encode()


class Disk:
    """Reads and writes the files of one store directory. Not thread-safe: the store serialises."""

    def __init__(self, root: Path, num_rows: int, chunk_rows: int, row_bytes: int) -> None:
        self.root = root
        self.num_rows = num_rows
        self.chunk_rows = chunk_rows
        self.row_bytes = row_bytes
        self.num_chunks = (num_rows + chunk_rows - 1) // chunk_rows
        self.bytes_written = 0
        self.bytes_read = 0  # of chunk files and segment directories; see total_bytes_read
        self.segment_reads = [0]  # bytes of segment records, counted by the segments themselves
        # (chunk, gen) -> verified per-block checksums of a raw base chunk (None: an LZ4 chunk)
        self._directories: dict[tuple[int, int], np.ndarray | None] = {}
        # bounded by bytes: at most ~16 MiB of checksums (4 bytes per 4 KiB block plus ~112 bytes
        # per entry), whatever the table's size
        per_entry = 4 * -(-chunk_rows * row_bytes // BLOCK) + 112
        self._directories_max = max(64, min(2 * self.num_chunks + 64, DIRECTORY_CACHE_BYTES // per_entry))
        self._chunks_dir = str(root / "chunks")

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
        (root / "segments").mkdir(parents=True, exist_ok=True)
        (root / "chunks").mkdir(exist_ok=True)
        write_file(root / "META", b"meta", json.dumps(meta).encode())

    @staticmethod
    def read_meta(root: Path) -> dict:
        return json.loads(read_file(root / "META", b"meta"))

    def read_pins(self) -> set[int]:
        p = self.root / "PINS"
        if not p.exists():
            return set()
        return set(json.loads(read_file(p, b"pins"))["pinned"])

    def write_pins(self, pins: set[int]) -> None:
        self.bytes_written += write_file(self.root / "PINS", b"pins", json.dumps({"pinned": sorted(pins)}).encode())

    # ---- readers ------------------------------------------------------------------------------
    def reader_lock_path(self, version: int) -> Path:
        return self.root / f"readers-{version:012d}"

    def lock_reader(self, version: int) -> int | None:
        """Hold a shared flock that keeps ``version`` from being reclaimed; None if not permitted."""
        try:
            fd = os.open(self.reader_lock_path(version), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # a read-only directory: nobody can reclaim anything there either
            return None
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
        if lock.exists():
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
        try:
            self.manifest_path(version).unlink()
        except FileNotFoundError:
            pass
        finally:
            if fd is not None:
                try:
                    lock.unlink()
                except FileNotFoundError:
                    pass
                os.close(fd)
        return True

    # ---- manifests ---------------------------------------------------------------------------
    def list_versions(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := MANIFEST_RE.match(p.name)))

    def read_manifest(self, version: int) -> Manifest:
        path = self.manifest_path(version)
        if not path.exists():
            have = self.list_versions()
            raise VersionNotFoundError(
                f"version={version} of store {self.root} is not retained; retained versions: {have}"
            )
        obj = json.loads(read_file(path, b"manifest"))
        if obj["version"] != version:
            raise CorruptStoreError(path, f"names version {obj['version']}, expected {version}")
        return Manifest(obj["version"], obj["chunkmap"], list(obj["segments"]), obj.get("parent", 0))

    def manifest_checksum(self, version: int) -> str:
        path = self.manifest_path(version)
        head = path.read_bytes()[:HEADER_SIZE] if path.exists() else b""
        if not head:
            raise VersionNotFoundError(f"version={version} of store {self.root} is not retained")
        _, pcrc = parse_header(path, head, b"manifest")
        return f"{pcrc:08x}"

    def write_manifest(self, m: Manifest) -> None:
        self.bytes_written += write_file(self.manifest_path(m.version), b"manifest", m.to_bytes())

    # ---- chunk map ---------------------------------------------------------------------------
    def read_chunkmap(self, gen: int) -> np.ndarray:
        if gen == 0:
            return np.zeros(self.num_chunks, np.int32)
        data = read_file(self.chunkmap_path(gen), b"chunkmap")
        arr = np.frombuffer(data, np.int32).copy()
        if len(arr) != self.num_chunks:
            raise CorruptStoreError(self.chunkmap_path(gen), f"has {len(arr)} chunks, expected {self.num_chunks}")
        return arr

    def write_chunkmap(self, gen: int, cmap: np.ndarray) -> None:
        self.bytes_written += write_file(self.chunkmap_path(gen), b"chunkmap", cmap.astype(np.int32).tobytes())

    # ---- base chunks -------------------------------------------------------------------------
    def chunk_rows_of(self, chunk: int) -> int:
        return min(self.chunk_rows, self.num_rows - chunk * self.chunk_rows)

    def read_chunk(self, chunk: int, gen: int) -> np.ndarray:
        """A whole base chunk, every byte checksum-verified."""
        path = self.chunk_path(chunk, gen)
        kind = self._chunk_kind(path)
        if kind == b"chunk":  # LZ4: one checksum over the compressed payload
            payload = read_file(path, b"chunk")
            c, rows, raw_len, _ = _CHUNK_HEAD.unpack_from(payload)
            self._check_chunk_head(path, chunk, c, rows, raw_len)
            raw = lz4.block.decompress(memoryview(payload)[_CHUNK_HEAD.size :], uncompressed_size=raw_len)
            self.bytes_read += len(payload) + HEADER_SIZE
            return np.frombuffer(bytearray(raw), np.uint8).reshape(rows, self.row_bytes)
        rows, crcs, data_off = self._raw_chunk_directory(path, chunk)
        data = self._pread(path, data_off, rows * self.row_bytes)
        for i, crc in enumerate(crcs.tolist()):
            if crc32(data[i * BLOCK : (i + 1) * BLOCK]) != crc:
                raise CorruptStoreError(path, f"block {i} of chunk {chunk} fails its checksum")
        return np.frombuffer(bytearray(data), np.uint8).reshape(rows, self.row_bytes)

    def read_chunk_rows(self, chunk: int, gen: int, local: np.ndarray) -> np.ndarray | None:
        """Only rows ``local`` (chunk-relative) of a raw base chunk, reading and verifying just the
        4 KiB blocks that hold them; None for an LZ4 chunk (read it whole).

        The per-miss path of random access to a table larger than RAM: one pread per row after the
        chunk's checksummed directory, which is read and verified once and then kept (files are
        never modified; a few bytes per block).
        """
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
                length, pcrc = parse_header(path, hd[:HEADER_SIZE], b"chunkraw")  # type: ignore[arg-type]
                if length != dlen or len(hd) != HEADER_SIZE + dlen or crc32(hd[HEADER_SIZE:]) != pcrc:
                    raise CorruptStoreError(path, "chunk directory is truncated or fails its checksum")
                c, r, rl, _ = _CHUNK_HEAD.unpack_from(hd, HEADER_SIZE)
                self._check_chunk_head(path, chunk, c, r, rl)  # type: ignore[arg-type]
                # kept as 4 bytes per block (a list of ints would cost ~36)
                crcs = np.frombuffer(hd, np.uint32, nblocks, HEADER_SIZE + _CHUNK_HEAD.size).copy()
                self._remember_directory(key, crcs)
            elif crcs is None:
                return None
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

    def write_chunk(self, chunk: int, gen: int, records: np.ndarray, compress: bool) -> None:
        raw = records.tobytes()
        if compress:
            packed = lz4.block.compress(raw, store_size=False)
            if len(raw) >= MIN_RATIO * len(packed):
                head = _CHUNK_HEAD.pack(chunk, len(records), len(raw), 1)
                self.bytes_written += write_file(self.chunk_path(chunk, gen), b"chunk", head + packed)
                return
        # Raw chunks carry a checksum per 4 KiB block, so a miss can read just the rows it needs.
        view = memoryview(raw)
        crcs = np.array([crc32(view[i : i + BLOCK]) for i in range(0, len(raw), BLOCK)], np.uint32)
        directory = _CHUNK_HEAD.pack(chunk, len(records), len(raw), 0) + crcs.tobytes()
        self.bytes_written += write_parts(self.chunk_path(chunk, gen), pack(b"chunkraw", directory) + [raw])

    def _chunk_kind(self, path: Path) -> bytes:
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER_SIZE)
        except FileNotFoundError:
            raise CorruptStoreError(path, "missing: the chunk map lists it but it is gone") from None
        kind = head[8:16].rstrip(b"\0")
        return kind if kind in (b"chunk", b"chunkraw") else b"chunk"  # parse_header reports the rest

    def _raw_chunk_directory(self, path: Path, chunk: int, *, fd: int | None = None,
                             head: bytes | None = None) -> tuple[int, np.ndarray, int]:
        head = head if head is not None else self._pread(path, 0, HEADER_SIZE, fd=fd)
        length, pcrc = parse_header(path, head, b"chunkraw")
        directory = self._pread(path, HEADER_SIZE, length, fd=fd)
        if crc32(directory) != pcrc:
            raise CorruptStoreError(path, "chunk directory fails its checksum")
        c, rows, raw_len, _ = _CHUNK_HEAD.unpack_from(directory)
        self._check_chunk_head(path, chunk, c, rows, raw_len)
        crcs = np.frombuffer(directory, np.uint32, offset=_CHUNK_HEAD.size)
        if len(crcs) != -(-raw_len // BLOCK):
            raise CorruptStoreError(path, "chunk directory has the wrong number of block checksums")
        return rows, crcs, HEADER_SIZE + length

    def _check_chunk_head(self, path: Path, chunk: int, c: int, rows: int, raw_len: int) -> None:
        if c != chunk or rows != self.chunk_rows_of(chunk) or raw_len != rows * self.row_bytes:
            raise CorruptStoreError(path, f"describes chunk {c} with {rows} rows; expected chunk {chunk}")

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
        records: np.ndarray | Callable[[int, int], np.ndarray],
        *,
        durable: bool = True,
        block_bytes: int = 4 << 20,
    ) -> Segment:
        """Write sorted unique ``ids`` and their records as segment ``seq``.

        ``records`` is an array, or a function ``(a, b) -> records of ids[a:b]`` called for blocks
        of about ``block_bytes``: a flush of many dirty rows then holds one block in memory, not a
        copy of every dirty row. ``durable=False`` (write-back of evicted rows) skips the fsync;
        the flush that first lists the segment in a manifest syncs it before publishing.
        """
        rb = self.row_bytes
        n = len(ids)
        chunks = ids // self.chunk_rows
        starts = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1]]) if n else np.zeros(0, np.int64)
        counts = np.diff(np.r_[starts, n]).astype(np.int64)
        index = np.zeros((4, len(starts)), np.int64)
        index[0], index[1], index[2] = chunks[starts], starts, counts
        fetch = records if callable(records) else (lambda a, b: records[a:b])
        # Blocks end on index-entry boundaries so each entry's checksum is computed in one piece.
        per_block = max(1, block_bytes // max(rb, 1))
        bounds = [0]
        for e, (st, ct) in enumerate(zip(starts.tolist(), counts.tolist())):
            if st + ct - int(starts[bounds[-1]]) >= per_block or e == len(starts) - 1:
                bounds.append(e + 1)
        directory_size = _SEG_HEAD.size + 8 * n + index.nbytes

        def body() -> Iterator[np.ndarray]:
            for e0, e1 in zip(bounds[:-1], bounds[1:]):
                a = int(starts[e0])
                b = int(starts[e1 - 1] + counts[e1 - 1])
                block = np.ascontiguousarray(fetch(a, b)).reshape(-1)
                for e in range(e0, e1):
                    lo = (int(starts[e]) - a) * rb
                    index[3, e] = crc32(block[lo : lo + int(counts[e]) * rb])
                yield block

        def head() -> bytes:
            directory = _SEG_HEAD.pack(n, rb, index.shape[1], self.chunk_rows) + ids.astype(np.int64).tobytes() + index.tobytes()
            return b"".join(bytes(p) for p in pack(b"segment", directory))

        path = self.segment_path(seq)
        size = write_parts(path, body(), durable=durable, head=head, head_size=HEADER_SIZE + directory_size)
        self.bytes_written += size
        return Segment(seq, path, ids.astype(np.int64), index[0], index[1], index[2], index[3],
                       HEADER_SIZE + directory_size, rb, size, read_counter=self.segment_reads)

    def _remember_directory(self, key: tuple[int, int], crcs: np.ndarray | None) -> None:
        if len(self._directories) >= self._directories_max:
            self._directories.clear()  # bounded: a few bytes per block of the chunks recently read
        self._directories[key] = crcs

    @property
    def total_bytes_read(self) -> int:
        """Bytes read from every store file: chunks, manifests, maps and segments."""
        return self.bytes_read + self.segment_reads[0]

    def sync_segment(self, seg: Segment) -> None:
        fd = os.open(seg.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def open_segment(self, seq: int) -> Segment:
        path = self.segment_path(seq)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(HEADER_SIZE)
                length, pcrc = parse_header(path, head, b"segment")
                directory = f.read(length)
        except FileNotFoundError:
            raise CorruptStoreError(path, "missing: a manifest lists it but it is gone") from None
        if len(directory) != length or crc32(directory) != pcrc:
            raise CorruptStoreError(path, "segment directory is truncated or fails its checksum")
        n, rb, entries, chunk_rows = _SEG_HEAD.unpack_from(directory)
        if rb != self.row_bytes or chunk_rows != self.chunk_rows:
            raise CorruptStoreError(path, f"row size {rb}/chunk rows {chunk_rows} do not match the store")
        off = _SEG_HEAD.size
        ids = np.frombuffer(directory, np.int64, n, off)
        index = np.frombuffer(directory, np.int64, 4 * entries, off + 8 * n).reshape(4, entries)
        records_offset = HEADER_SIZE + length
        if size != records_offset + n * rb:
            raise CorruptStoreError(path, f"truncated: {size} bytes, expected {records_offset + n * rb}")
        self.bytes_read += records_offset
        return Segment(seq, path, ids.copy(), index[0].copy(), index[1].copy(), index[2].copy(), index[3].copy(),
                       records_offset, rb, size, read_counter=self.segment_reads)

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
                cmap = self.read_chunkmap(m.chunkmap)
                nz = np.flatnonzero(cmap)
                files.update(zip(nz.tolist(), cmap[nz].tolist()))
        return segs, gens, files

    def collect_garbage(self, keep_versions: list[int], keep_segments: set[int], keep_gens: set[int],
                        new_seq: int, new_gen: int, *, remove_temp: bool,
                        keep_files: set[tuple[int, int]] = frozenset()) -> int:
        """Delete files no kept version uses (crash leftovers, compacted deltas); return bytes freed.

        ``keep_segments``/``keep_gens``/``keep_files`` ((chunk, gen) pairs) protect what the live
        store uses or is writing right now; temporary files are only removed when no write of this
        process can be in progress.
        """
        segs, gens, files = self.referenced(keep_versions)
        segs |= keep_segments
        gens |= keep_gens
        files = files | set(keep_files)
        freed = 0

        def drop(p: Path) -> None:
            nonlocal freed
            try:
                freed += p.stat().st_size
                p.unlink()
            except FileNotFoundError:  # tolerate a concurrent delete
                pass

        def is_temp(name: str) -> bool:
            return name.startswith(".") and ".tmp" in name

        for d in (self.root, self.root / "segments", self.root / "chunks"):
            for p in d.iterdir():
                name = p.name
                if is_temp(name):
                    if remove_temp:
                        drop(p)
                elif d.name == "segments":
                    m = SEGMENT_RE.match(name)
                    if m and int(m.group(1)) < new_seq and int(m.group(1)) not in segs:
                        drop(p)
                elif d.name == "chunks":
                    m = CHUNK_RE.match(name)
                    gen = int(m.group(2)) if m else new_gen
                    if gen < new_gen and gen not in gens and (int(m.group(1)), gen) not in files:
                        drop(p)
                elif name.startswith("chunkmap-"):
                    gen = int(name.split("-")[1])
                    if gen < new_gen and gen not in gens:
                        drop(p)
        return freed

    def disk_bytes(self) -> int:
        total = 0
        for d in (self.root, self.root / "segments", self.root / "chunks"):
            with os.scandir(d) as it:
                for e in it:
                    try:
                        if e.is_file():
                            total += e.stat().st_size
                    except FileNotFoundError:  # a temp file renamed by a background write
                        pass
        return total

    def max_seq_and_gen(self) -> tuple[int, int]:
        seq = max((int(m.group(1)) for p in (self.root / "segments").iterdir() if (m := SEGMENT_RE.match(p.name))), default=0)
        gen = max((int(p.name.split("-")[1]) for p in self.root.iterdir() if p.name.startswith("chunkmap-")), default=0)
        cgen = max((int(m.group(2)) for p in (self.root / "chunks").iterdir() if (m := CHUNK_RE.match(p.name))), default=0)
        return seq, max(gen, cgen)
