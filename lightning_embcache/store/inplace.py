"""Folding delta records into a dense raw base chunk where it lies, instead of into a new file.

A compaction round used to write every chunk it folds as a new file of a new generation, so
with updates spread over the table each pass rewrote the whole table whatever share of it had
changed. A dense raw chunk file (kind ``chunkraw``) that no other version on disk reads, and
that no read of this process is reading, is instead changed in place: the changed rows'
records are written at their offsets, then the checksums of the 4 KiB blocks they touch and the
header. A round then writes the rows it folds, not the chunks they lie in.

Crash safety (docs/store-format.md, "Compaction"):

* Every row the fold writes is in a segment that the published manifest lists and whose
  records of that chunk the chunk map does not count as folded yet: a read takes those rows from
  the segment, never from the base file, and those records are never punched out of their
  segment (holes.py). So a file folded in part still gives every version its rows, except that
  the blocks being changed fail their checksums until the fold completes.
* Before the first write the round makes an *intent* durable, the file ``FOLDING``: the round's
  chunk map generation, the files (chunk, generation, newest segment already folded) and the
  segments being applied. The files are made durable before the intent goes, and the intent
  goes before the round publishes its chunk map.
* A writable open that finds the intent redoes it before anything reads (`redo`): it applies the
  same segments' records again (idempotent: the same rows get the same records), recomputes the
  checksums of the blocks they touch (the others are the same before and after, whatever a power
  cut tore) and makes the files durable. An intent whose round got as far as writing any file of
  its generation or later is stale (the folds were durable by then): it is only deleted, since
  later rounds may have punched the records it names.
* A read-only open that finds an intent naming files its version reads refuses with
  `StoreError` until a writable open has redone it (the writer holds those versions' reader
  locks exclusively while it folds, so a live writer's intent is never seen).
"""

from __future__ import annotations

import json
import os

import numpy as np

from . import fileio, idsets
from .blockcrc import BLOCK, first_bad_block
from .disk import _CHUNK_HEAD, FOLDS_RECORDED, Disk, Segment, raw_directory
from .errors import CorruptStoreError, StoreError
from .fileio import HEADER_SIZE, crc32, pack

INTENT = "FOLDING"
_KIND = b"folding"


def is_raw(disk: Disk, chunk: int, gen: int) -> bool:
    """Whether chunk file (chunk, gen) is a dense raw file that records the newest segment folded
    into it (its kind and layout flag, unchecked: `fold_chunk` checks everything it reads). A raw
    file written before files recorded it is never folded in place: its name alone then tells
    every copy of it apart, since it never changes under that name."""
    try:
        fd = os.open(disk.chunk_path(chunk, gen), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        head = os.pread(fd, HEADER_SIZE + _CHUNK_HEAD.size, 0)
    finally:
        os.close(fd)
    return len(head) == HEADER_SIZE + _CHUNK_HEAD.size and head[8:16] == b"chunkraw" and head[-1] == FOLDS_RECORDED


def newest_records(chunk: int, disk: Disk, segs: list[Segment], folded: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted chunk-relative rows, their newest records) of the records of ``chunk`` in the
    segments ``segs`` (oldest first) newer than ``folded``."""
    parts = [got for s in segs if s.seq > folded and (got := s.rows_of_chunk(chunk)) is not None]
    if not parts:
        return np.zeros(0, np.int64), np.zeros((0, disk.row_bytes), np.uint8)
    ids = np.concatenate([p[0] for p in parts]) - chunk * disk.chunk_rows
    recs = np.concatenate([p[1] for p in parts])
    # the last record of each row: the first of the reversed order
    rows, first = np.unique(ids[::-1], return_index=True)
    return rows, recs[len(ids) - 1 - first]


def distinct_rows(chunk: int, segs: list[Segment], folded: int) -> int:
    """How many rows of ``chunk`` the segments ``segs`` newer than ``folded`` hold (their ids
    only, no records read): the rows a fold of the chunk writes."""
    parts = []
    for s in segs:
        if s.seq > folded and (e := s._entry(chunk)) is not None:
            parts.append(s.ids[e[1] : e[1] + e[2]])
    if len(parts) <= 1:
        return len(parts[0]) if parts else 0
    return len(idsets.unique(np.concatenate(parts)))


# A fold in place writes runs of changed rows, one system call each; two runs a few unchanged rows
# apart are written as one (those rows' bytes again) while the rows written this way stay under
# this share of the changed ones: at a third of the rows changed at random, half the calls.
GAP_SHARE = 0.5


def _runs(rows: np.ndarray, gap_share: float = GAP_SHARE) -> list[tuple[int, int]]:
    """[start, end) ranges covering ``rows`` (sorted, unique), one write each: runs of consecutive
    rows, the shortest gaps between them closed while the unchanged rows they add stay within
    ``gap_share`` of ``len(rows)``."""
    if not len(rows):
        return []
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.concatenate([[0], cut])]
    ends = rows[np.concatenate([cut - 1, [len(rows) - 1]])] + 1
    if len(starts) > 1:
        gaps = starts[1:] - ends[:-1]
        order = np.argsort(gaps, kind="stable")
        close = np.zeros(len(gaps), np.bool_)
        close[order[np.cumsum(gaps[order]) <= gap_share * len(rows)]] = True
        keep = np.concatenate([[True], ~close])  # a run whose gap before it is closed joins the one before
        first = np.flatnonzero(keep)
        last = np.concatenate([first[1:] - 1, [len(starts) - 1]])
        starts, ends = starts[first], ends[last]
    return list(zip(starts.tolist(), ends.tolist()))


def fold_chunk(
    disk: Disk, chunk: int, gen: int, rows: np.ndarray, records: np.ndarray, *, verify: bool, newest: int,
    redo: bool = False,
) -> int:
    """Write ``records`` of chunk-relative ``rows`` into raw chunk file (chunk, gen) where they
    lie, with the checksums of the blocks they touch and a new header recording that the file
    holds the segments up to ``newest`` (the round's newest segment: the chunk map it publishes
    says so); return the bytes written. Not durable (the caller syncs). ``verify``: check the
    file's blocks first (a damaged block must fail its checksum after the fold too, never be
    given a fresh one). ``redo``: the file may be torn by a crash in an earlier fold of the same
    records: its header and directory are rebuilt, the blocks these rows touch get checksums of
    what they hold after the writes, the others keep theirs (the same before and after that
    fold)."""
    path = disk.chunk_path(chunk, gen)
    rb = disk.row_bytes
    n = disk.chunk_rows_of(chunk)
    raw_len = n * rb
    nblocks = -(-raw_len // BLOCK)
    data_off = disk.raw_chunk_data_offset(chunk)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CorruptStoreError(path, "missing: the chunk map lists it but it is gone") from None
    except OSError as exc:
        raise fileio.io_error(exc, "opening", path) from exc
    try:
        head = os.pread(fd, data_off, 0)
        if len(head) != data_off:
            raise CorruptStoreError(path, "truncated: shorter than its header")
        if redo:
            if head[:16] != fileio.MAGIC + b"chunkraw":
                raise CorruptStoreError(path, "is not a raw chunk file (an interrupted fold cannot be redone)")
            crcs = np.frombuffer(head, np.uint32, nblocks, HEADER_SIZE + _CHUNK_HEAD.size).copy()
        else:
            # (refuses an older copy of the file than the chunk map says: `Disk.check_folded`)
            crcs = disk.raw_chunk_checksums(chunk, gen, head).copy()
            held = _CHUNK_HEAD.unpack_from(head, HEADER_SIZE)
            if held[3] != FOLDS_RECORDED:  # `is_raw` chose it: it was replaced meanwhile
                raise StoreError(f"{path}: does not record what it holds, so it is never folded in place")
            newest = max(newest, held[2])  # (it never records holding less than it did)
        data = np.empty(raw_len, np.uint8)
        got = os.preadv(fd, [memoryview(data)], data_off)  # type: ignore[arg-type]
        if got != raw_len:
            raise CorruptStoreError(path, f"truncated: wanted {raw_len} bytes at offset {data_off}, got {got}")
        disk.bytes_read += data_off + raw_len
        if verify and not redo:
            bad = first_bad_block(data, crcs)
            if bad >= 0:
                raise CorruptStoreError(path, f"block {bad} of chunk {chunk} fails its checksum")
        table = data.reshape(n, rb)
        table[rows] = records
        touched = idsets.unique(np.concatenate([(rows * rb) // BLOCK, (rows * rb + rb - 1) // BLOCK]))
        view = memoryview(data)  # type: ignore[arg-type]
        for b in touched.tolist():
            crcs[b] = crc32(view[b * BLOCK : (b + 1) * BLOCK])
        directory = raw_directory(chunk, n, crcs, newest)
        header = b"".join(bytes(p) for p in pack(b"chunkraw", directory, disk.uid, path.name))
        disk.pool.note_folded(chunk, gen)  # (background reads of it begun before are useless)
        runs = [(a * rb, b * rb, data_off + a * rb) for a, b in _runs(rows)]
        written = fileio.overwrite(fd, view, path, runs)
        written += fileio.overwrite(fd, header, path, [(0, len(header), 0)])
        fileio.start_writeback(fd)
        return written
    except OSError as exc:
        raise fileio.io_error(exc, "writing", path) from exc
    finally:
        os.close(fd)


# ---- the intent ------------------------------------------------------------------------------
def write_intent(disk: Disk, gen: int, files: list[tuple[int, int, int]], segs: list[int]) -> int:
    """Make the intent of a round of generation ``gen`` durable: it folds segments ``segs`` into
    files (chunk, generation, newest segment the file already holds) in place."""
    body = json.dumps({"gen": gen, "files": [list(f) for f in files], "segments": segs}).encode()
    return disk._write(disk.root / INTENT, _KIND, body)


def drop_intent(disk: Disk, *, durable: bool = False) -> None:
    """The round's in-place files are durable: its intent goes (``durable``: for sure, a redo's)."""
    disk.delete_file(disk.root / INTENT)
    if durable:
        fileio.fsync(disk._root_fd, disk.root)


def read_intent(disk: Disk) -> dict | None:
    """The intent left by an in-place fold (None: none); CorruptStoreError if damaged."""
    path = disk.root / INTENT
    if not path.exists():
        return None
    data = disk._read_file(path, _KIND)
    try:
        body = json.loads(data)
        gen, files, segs = int(body["gen"]), [tuple(int(x) for x in f) for f in body["files"]], body["segments"]
        segs = [int(s) for s in segs]
    except (ValueError, KeyError, TypeError):
        raise CorruptStoreError(path, "is not a valid fold intent") from None
    if any(len(f) != 3 or min(f) < 0 for f in files):
        raise CorruptStoreError(path, "names an invalid chunk file")
    return {"gen": gen, "files": files, "segments": segs}


def stale(disk: Disk, intent: dict) -> bool:
    """Whether the round that left ``intent`` got past its in-place folds (then durable): a file
    of its generation or a later one exists."""
    _, gen = disk.max_seq_and_gen()
    return gen >= intent["gen"]


def files_named(intent: dict, cmap: np.ndarray) -> list[tuple[int, int]]:
    """The intent's files that chunk map ``cmap`` names."""
    return [(c, g) for c, g, _ in intent["files"] if c < len(cmap) and int(cmap[c]) == g]


def redo(disk: Disk, only: set[int] | None = None) -> int:
    """Redo the in-place folds an interrupted round left (see the module's docstring), make them
    durable and delete the intent; return the files redone. Called by a writable open before
    anything reads the chunk files, and by a round whose write failed half-way (``only``: the
    chunks it may have written)."""
    intent = read_intent(disk)
    if intent is None:
        return 0
    if only is None and stale(disk, intent):
        drop_intent(disk, durable=True)
        return 0
    listed, named = _on_disk(disk)
    if not set(intent["segments"]) <= listed:
        raise CorruptStoreError(disk.root / INTENT, "names segments that no version on disk lists")
    segs = []
    for seq in intent["segments"]:
        try:
            segs.append(disk.open_segment(seq))
        except CorruptStoreError as exc:
            raise CorruptStoreError(disk.root / INTENT, f"names segment {seq}, which cannot be read to redo "
                                                        f"an interrupted fold: {exc}") from None
    done = []
    newest = max(intent["segments"], default=0)  # the round's: what its folds record
    try:
        for c, g, folded in intent["files"]:
            if only is not None and c not in only:
                continue
            if c >= disk.num_chunks or (c, g) not in named or not disk.chunk_path(c, g).exists():
                continue  # a file no version reads: nothing to redo
            rows, recs = newest_records(c, disk, segs, folded)
            if len(rows):
                disk.bytes_written += fold_chunk(disk, c, g, rows, recs, verify=False, newest=newest, redo=True)
                done.append(disk.chunk_path(c, g).name)
        if done:
            fileio.sync_written(disk._chunks_fd, done, disk.root / "chunks")
    finally:
        for s in segs:
            s.close()
    drop_intent(disk, durable=True)
    return len(done)


def _on_disk(disk: Disk) -> tuple[set[int], set[tuple[int, int]]]:
    """The segments the versions on disk list and the chunk files their chunk maps name."""
    segs: set[int] = set()
    files: set[tuple[int, int]] = set()
    gens = set()
    for v in disk.list_versions():
        m = disk.read_manifest(v)
        segs.update(m.segments)
        if m.chunkmap and m.chunkmap not in gens:
            gens.add(m.chunkmap)
            cmap = disk.read_chunkmap(m.chunkmap, m.num_rows or disk.created_rows)
            used = np.flatnonzero(cmap)
            files.update(zip(used.tolist(), cmap[used].tolist()))
    return segs, files


def refuse_if_interrupted(disk: Disk, cmap: np.ndarray) -> None:
    """For a read-only open: StoreError if an interrupted in-place fold left files of chunk map
    ``cmap`` to redo (a writable open redoes it)."""
    try:
        intent = read_intent(disk)
    except CorruptStoreError:
        intent = None  # a writable open names it
    if intent is None or stale(disk, intent) or not files_named(intent, cmap):
        return
    raise StoreError(
        f"{disk.root / INTENT}: compaction was folding chunk files of this version in place when its writer "
        f"stopped; open the store for writing once (EmbeddingStore.open(path)) to finish it, then read it"
    )

