"""Rows of base chunk files for a whole batch of misses, through long-lived descriptors.

A raw base chunk (kind ``chunkraw``) is ``header | directory (a crc32 per 4 KiB block) | records``
and changes only when compaction folds rows into it in place (inplace.py: no read of this
process runs meanwhile, and `forget` drops what is kept of it). Its descriptor and block
checksums are kept after the first read
(no ``open``/``close`` per read), a batch's rows are grouped by file and offset, adjacent rows
are read with one ``preadv`` straight into the output, and verification stays per 4 KiB block:
a block's checksum is checked the first time a row in it is read through this handle, and a flag
per block (one byte per 4 KiB of table) remembers it, so checking a whole batch is a few
vectorised array operations. LZ4 chunks are read and decompressed whole.

A sparse base chunk (kind ``sparse``) holds only the rows ever written, packed in row order after
a bitmap of them: it is read like a raw chunk of those rows (a row's offset is its rank among
them, kept per row while the file is known), and the rows it does not hold get their initial
values, computed per row as for a never-written chunk.

Reads go through ``pread`` rather than maps of the files on purpose: a mapped file's pages count
in the process's RSS (a kernel with large page-cache folios maps up to 2 MiB per fault: 1,000
random rows of a 64 MiB file made RSS grow by 64 MiB), which would break the memory budget, and
``preadv`` of a cached row costs about the same (~1.2 us) as faulting it in.
"""

from __future__ import annotations

import array
import os
import resource
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import idsets, uring
from .blockcrc import BLOCK, first_bad_block
from .disk import _CHUNK_HEAD, SPARSE_KIND
from .errors import CorruptStoreError
from .fileio import HEADER_SIZE, crc32
from .mapped import MAX_MAPPED, PAGE, MappedFiles
from .memory import zeros

WHOLE_AFTER = 4  # block-wise first reads of a chunk before a cached chunk is verified whole
DENSE_SHARE = 8  # a call wanting first reads of >= 1/8 of a chunk's blocks (and >= 2) reads the chunk whole
DENSE_ROWS = 64  # ... or of >= 1/64 of its rows (rows of a few KiB: 32 of a 1,024-row chunk are 1/16 of its blocks)
_FADV_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux: a read that fails instead of waiting for the disk
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux: this thread's page faults
#: gathers of rows through maps of the chunk files (mapped.py) where they can; tests turn it off
MAPPED_READS = True


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _chunk_name(chunk: int, gen: int) -> str:
    """A base chunk file's name in ``chunks/`` (as `Disk.chunk_path` names it)."""
    return f"c{chunk:08d}-g{gen:08d}"


def _max_files() -> int:
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(64, min(4096, soft // 4))


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class ChunkRows:
    """Batched, verified reads of rows of base chunk files (a helper of the store's miss path).

    Thread-safe: the training thread and the prefetch thread read at once. A descriptor leaves
    the bounded set of open files only when no read is in progress, so no read ever uses a
    descriptor number that was closed (and perhaps reused) under it.
    """

    def __init__(self, disk) -> None:
        self.disk = disk
        self.rb = disk.row_bytes
        self.cr = disk.chunk_rows
        self.bpc = -(-disk.chunk_rows * self.rb // BLOCK)  # blocks per (full) chunk
        self._chunks_dir = os.path.join(os.fspath(disk.root), "chunks")
        self.max_files = _max_files()
        nc = disk.num_chunks
        # per chunk: open descriptor (-1: none, -2: an LZ4 chunk), its generation, data offset
        self._fd = np.full(nc, -1, np.int64)
        self._gen = np.zeros(nc, np.int64)
        self._off = np.zeros(nc, np.int64)
        self._len = np.zeros(nc, np.int64)  # bytes of records in the file (fewer in a sparse chunk)
        self._sparse = np.zeros(nc, np.bool_)  # the file held open is a sparse chunk
        # per table row of a sparse chunk known here: 1 + its rank among the rows the file holds,
        # 0 if it holds none (lazily zeroed: only sparse chunks' pages cost memory)
        self._slot = zeros(disk.num_rows, np.uint16 if disk.chunk_rows < 0xFFFF else np.uint32)
        # chunk -> block checksums of its generation in ``_gen``, kept while the file is closed by
        # the open-file bound (4 bytes per 4 KiB of table touched) so that reopening reads nothing
        self._crcs: dict[int, array.array] = {}
        self._order: list[int] = []  # chunks in the order they were opened (closing oldest first)
        self._ok = zeros(nc * self.bpc, np.uint8)  # block verified (for _ok_gen)
        self._ok_gen = zeros(nc, np.int32)  # generation the chunk's flags are for
        self._crc_flat = zeros(nc * self.bpc, np.uint32)  # the block checksums of ``_crcs``, for gathers
        self._first_reads = zeros(nc, np.int64)  # block-wise first reads per chunk so far
        # chunk files of this generation or newer were written by this handle (its compactions):
        # the page cache holds exactly what was checksummed, so they are not verified again
        self.trusted_from_gen = 1 << 62
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._active = 0
        self._retired: list[int] = []  # descriptors to close once no read is in progress
        self._replaced: list[int] = []  # the same, of files a compaction replaced (closed in the background)
        self._closers: list[threading.Thread] = []
        # [row reads, those the page cache did not hold] through this reader and the store's
        # segments (`uring.read_into`): whether lookahead reads in the background (tiers.upcoming)
        self.cache_counts = [0, 0]
        # (chunk, gen) -> rows of it announced lately (-1: asked for whole), oldest first
        self._advised: dict[tuple[int, int], int] = {}
        # how many chunks it remembers: a pass over the table (an epoch) announces every chunk,
        # so a chunk of a table with fewer chunks than this would never be asked for again
        self._advised_max = min(512, max(64, nc // 2))
        self._adviser: ThreadPoolExecutor | None = None  # asks for whole chunks (`_advise_whole_later`)
        self._asked_gen = zeros(nc, np.int32)  # generation asked for whole lately (in ``_advised``), else 0
        # Maps of the files (mapped.py), made at the first gather: per chunk the generation whose
        # map may serve rows (0: none; a map being replaced or forgotten stops serving at once and
        # is unmapped once no read is in progress), the chunks in the order mapped, those to unmap
        self._maps: MappedFiles | None = None
        self._map_gen = zeros(nc, np.int64)
        # per chunk: the generation of a raw file mapped here whose every block is verified (-1:
        # none; never 0, the generation of a chunk without a file): its rows need no check at
        # all, only the gather (`gather_verified`); and where its row ``id`` lies in the maps less
        # ``id * row_bytes`` (one gather and one add give a batch's addresses)
        self._fast_gen = np.full(nc, -1, np.int64)
        self._fast_base = zeros(nc, np.int64)
        self._map_order: dict[int, None] = {}  # (ordered: oldest first)
        self._unmaps: list[int] = []
        # [rows gathered through maps, block checks made through maps] (what tests count)
        self.map_counts = [0, 0]

    # ---- files -----------------------------------------------------------------------------
    def _open(self, chunk: int, gen: int) -> None:
        disk = self.disk
        if self._fd[chunk] == -1 and self._gen[chunk] == gen and chunk in self._crcs:
            # Closed by `_trim` and wanted again: the same file (a fold in place `forget`s it), whose header and block
            # checksums this handle already read and checked. One openat, no re-reading: a table
            # of more chunk files than the descriptor bound reopens files on most misses.
            try:
                fd = os.open(_chunk_name(chunk, gen), _OPEN_FLAGS, dir_fd=disk._chunks_fd)
            except FileNotFoundError:
                raise CorruptStoreError(
                    disk.chunk_path(chunk, gen), "missing: the chunk map lists it but it is gone"
                ) from None
            if _FADV_WILLNEED is not None:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            with self._lock:
                if self._fd[chunk] == -1 and self._gen[chunk] == gen:
                    self._order.append(chunk)
                    self._fd[chunk] = fd
                    return
            os.close(fd)  # another thread opened this chunk (or a newer generation) meanwhile
            return
        # (a plain string: a first read opens every file of the table, and Path objects cost
        # more than the open)
        name = _chunk_name(chunk, gen)
        path = os.path.join(self._chunks_dir, name)
        try:
            fd = os.open(name, _OPEN_FLAGS, dir_fd=disk._chunks_fd)
        except FileNotFoundError:
            raise CorruptStoreError(path, "missing: the chunk map lists it but it is gone") from None
        off, crcs, present, nbytes = 0, None, None, 0
        try:
            if _FADV_WILLNEED is not None:
                # A miss wants its block, not readahead around it; advised before the header is
                # read, or that first read pulls the file's first 128 KiB or more into the cache.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            # the header and a raw chunk's directory in one read
            raw_dir = _CHUNK_HEAD.size + 4 * -(-disk.chunk_rows_of(chunk) * self.rb // BLOCK)
            got = os.pread(fd, HEADER_SIZE + raw_dir, 0)
            head = got[:HEADER_SIZE]
            kind = head[8:16].rstrip(b"\0")
            if kind == b"chunkraw":
                directory = got[HEADER_SIZE:] if len(got) == HEADER_SIZE + raw_dir else None
                rows, crcs, off = disk._raw_chunk_directory(path, chunk, fd=fd, head=head, directory=directory,
                                                            gen=gen)
            elif kind == SPARSE_KIND:
                present, crcs, off = disk._sparse_chunk_directory(path, chunk, fd=fd, head=head)
                rows = len(present)
            else:  # LZ4 (or damaged): read whole, read_chunk verifies it
                os.close(fd)
                fd = -2
            if fd >= 0:
                nbytes = rows * self.rb
                if os.fstat(fd).st_size < off + nbytes:
                    raise CorruptStoreError(path, f"truncated: shorter than its {rows} rows")
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        with self._lock:
            old = int(self._fd[chunk])
            if old >= 0:  # a generation a compaction replaced: its file is likely deleted
                self._replaced.append(old)
            else:
                self._order.append(chunk)
            if self._map_gen[chunk] and self._map_gen[chunk] != gen:
                self._drop_map(chunk)
            if fd >= 0:
                assert crcs is not None  # read with the file's directory
                self._crcs[chunk] = array.array("I", crcs.astype(np.uint32).tobytes())
                self._crc_flat[chunk * self.bpc : chunk * self.bpc + len(crcs)] = crcs
            else:
                self._crcs.pop(chunk, None)
            self._fd[chunk], self._gen[chunk], self._off[chunk], self._len[chunk] = fd, gen, off, nbytes
            self._sparse[chunk] = present is not None
            if present is not None:
                lo = chunk * self.cr
                slots = self._slot[lo : lo + disk.chunk_rows_of(chunk)]
                slots[:] = 0
                slots[present] = np.arange(1, len(present) + 1, dtype=slots.dtype)

    def _trim(self, keep: set) -> None:
        """Over the bound: close the oldest quarter of the open files (once reads end), never one
        that the batch being read (``keep``) needs."""
        with self._lock:
            if len(self._order) <= self.max_files:
                return
            quota = len(self._order) - self.max_files + self.max_files // 4
            drop: list[int] = []
            stay: list[int] = []
            for c in self._order:
                (drop if len(drop) < quota and c not in keep else stay).append(c)
            self._order = stay
            for c in drop:
                if self._fd[c] >= 0:
                    self._retired.append(int(self._fd[c]))
                self._fd[c] = -1  # its generation, data offset and checksums stay known (`_open`)

    def _enter(self) -> None:
        with self._lock:
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active:
                return
            if self._unmaps and self._maps is not None:  # no gather is in progress: stopped maps go
                for c in self._unmaps:
                    if not self._map_gen[c]:
                        self._maps.unmap(c)
                self._unmaps = []
            if not (self._retired or self._replaced):
                return
            retired, self._retired = self._retired, []
            replaced, self._replaced = self._replaced, []
        _close_all(retired)
        if replaced:
            # The last close of a file that compaction replaced and deleted frees its blocks, a
            # file-system operation: off the training thread.
            t = threading.Thread(target=_close_all, args=(replaced,), name="embcache-close", daemon=True)
            t.start()
            self._closers = [c for c in self._closers if c.is_alive()] + [t]

    def close(self) -> None:
        """Close every descriptor (the store is closing: no read is in progress).

        In a forked child (a DataLoader worker) this does nothing: the lock may have been held
        by a thread of the parent at the fork, and the descriptors are the parent's to close."""
        if os.getpid() != self._pid:
            return
        if self._adviser is not None:
            self._adviser.shutdown(wait=True)
            self._adviser = None
        with self._lock:
            fds = [int(x) for x in self._fd[self._fd >= 0]] + self._retired + self._replaced
            self._fd[:] = -1
            self._order, self._retired, self._replaced, self._crcs = [], [], [], {}
            if self._maps is not None:
                self._map_gen[:] = 0
                self._map_order, self._unmaps = {}, []
                self._maps.close()
        for t in self._closers:
            t.join()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- reads -------------------------------------------------------------------------------
    def read(self, chunks: np.ndarray, local: np.ndarray, gens: np.ndarray, *, mapped: bool = True) -> np.ndarray:
        """Records of rows ``local`` of chunks ``chunks`` (sorted by chunk, then row) at
        generations ``gens``, every 4 KiB block checksum-verified once per handle.

        ``mapped``: gather rows of raw and sparse chunk files through maps of them (mapped.py:
        a copy per row from the page cache; a row not cached waits for its page fault). False
        reads them with io_uring, many in flight at once: for a background read of rows likely
        on disk (the prefetch thread)."""
        epoch = self.disk.pool.begin_read()  # no file this read may reach is reused meanwhile
        self._enter()
        try:
            return self._read(chunks, local, gens, mapped and MAPPED_READS)
        finally:
            self._leave()
            self.disk.pool.end_read(epoch)

    def gather_verified(self, ids: np.ndarray, chunks: np.ndarray, gens: np.ndarray,
                        skip: np.ndarray | None = None, stand_in: int = 0) -> np.ndarray | None:
        """Records of table rows ``ids`` (any order; ``chunks``: ``ids // chunk_rows``) at ``gens``
        in one gather from the maps, if every one lies in a raw file mapped here whose blocks are
        all verified (the steady state of reads over a page-cached table); else None and nothing
        is read. ``skip``: positions whose rows the caller has elsewhere (hot): they get a copy of
        the row at position ``stand_in`` (not skipped) instead, to overwrite. A few array
        operations a batch: no per-row or per-chunk Python."""
        maps = self._maps
        if maps is None or not maps.usable:
            return None
        pool = self.disk.pool
        epoch = pool.begin_read()  # no file this read may reach is reused meanwhile
        # No map goes away meanwhile (`_enter`): not the lock itself, which a gather faulting
        # pages in from the disk would hold against the prefetch thread.
        self._enter()
        try:
            # (a chunk never written, generation 0, has no file and is never fast: its rows are
            # computed)
            bad = self._fast_gen[chunks] != gens
            if skip is not None:
                bad[skip] = False
            if np.count_nonzero(bad):
                return None
            addr = ids * self.rb
            addr += self._fast_base[chunks]
            if skip is not None:
                addr[skip] = addr[stand_in]
            got = maps.rows[addr].view(np.uint8).reshape(-1, self.rb)
        finally:
            self._leave()
            pool.end_read(epoch)
        n = len(ids) - (0 if skip is None else len(skip))
        self.map_counts[0] += n
        self.cache_counts[0] += n
        self.disk.bytes_read += n * self.rb
        return got

    def forget(self, files: list[tuple[int, int]]) -> None:
        """Files (chunk, gen) that are about to be overwritten for reuse (recycle.py): close their
        descriptors and forget their checksums, so a read planned before they were replaced (a
        prefetch) finds them gone, as if deleted, instead of reading another chunk's bytes."""
        with self._lock:
            for c, g in files:
                if self._gen[c] == g:
                    self._drop_file(c, g)
            if self._active or not (self._retired or self._unmaps):
                return
            retired, self._retired = self._retired, []
        self._enter()
        self._leave()  # (unmaps what stopped serving: no read is in progress)
        _close_all(retired)

    def invalidate(self, chunk: int) -> None:
        """Forget what this handle verified of ``chunk``'s file, whatever its generation, and stop
        serving rows through its map: the file's bytes are about to change in place (a fold into
        the same generation). Its next read reads the file's header and checksums again and
        verifies every block it reads anew. Safe at any time: a read in progress keeps the map
        it is gathering from until it ends (no map is unmapped under a read). So that no `get` is
        copying from the file when it changes, call it holding the store's lock (every `get`
        reads under it); the prefetch thread reads without that lock, through descriptors: a
        change in place must also wait for its reads (``disk.pool`` read epochs)."""
        with self._lock:
            self._drop_file(chunk, int(self._gen[chunk]))
        self._enter()
        self._leave()

    def _drop_file(self, chunk: int, gen: int) -> None:
        """(Caller holds the lock.) Retire ``chunk``'s descriptor, checksums, verified blocks and map."""
        if self._fd[chunk] >= 0:
            self._retired.append(int(self._fd[chunk]))
        if self._fd[chunk] != -1 and chunk in self._order:
            self._order.remove(chunk)
        self._fd[chunk], self._gen[chunk] = -1, 0
        self._crcs.pop(chunk, None)
        self._advised.pop((chunk, gen), None)
        self._forget_blocks(chunk)

    def _forget_blocks(self, chunk: int) -> None:
        """(Caller holds the lock.) No block of ``chunk`` counts as verified, its map serves no row."""
        self._ok_gen[chunk] = 0
        self._fast_gen[chunk] = -1
        self._ok[chunk * self.bpc : (chunk + 1) * self.bpc] = 0
        self._first_reads[chunk] = 0
        if self._map_gen[chunk]:
            self._drop_map(chunk)

    def _drop_map(self, chunk: int) -> None:
        """(Caller holds the lock.) ``chunk``'s map stops serving now; it is unmapped once no read
        is in progress (`_leave`)."""
        self._map_gen[chunk] = 0
        self._fast_gen[chunk] = -1
        del self._map_order[chunk]
        self._unmaps.append(chunk)

    def _ensure_open(self, chunks: np.ndarray, gens: np.ndarray) -> None:
        # Never replace a newer generation by an older one: a prefetch planned before a compaction
        # still asks for the old file while the training thread reads the new one. Rows whose
        # generation is not the one held open are read through a descriptor of their own (`_read`).
        # (a chunk served through its map needs no descriptor)
        stale = ((self._fd[chunks] == -1) & (self._map_gen[chunks] != gens)) | (self._gen[chunks] < gens)
        if stale.any():
            for c, g in set(zip(chunks[stale].tolist(), gens[stale].tolist())):
                self._open(c, g)
            if len(self._order) > self.max_files:
                self._trim(set(idsets.unique(chunks).tolist()))

    def _to_file_rows(self, chunks: np.ndarray, local: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows in the files held open, rows of ``local`` a sparse file does not hold): in a
        sparse chunk a row's place in the file is its rank among the rows the file holds
        (caller holds the lock; ``other`` rows are not read through the files held open)."""
        sparse = self._sparse[chunks] & ~other
        absent = np.zeros(len(chunks), np.bool_)
        if not sparse.any():
            return local, absent
        local = local.copy()
        at = np.flatnonzero(sparse)
        slot = self._slot[chunks[at] * self.cr + local[at]].astype(np.int64) - 1
        absent[at[slot < 0]] = True
        local[at] = np.maximum(slot, 0)
        return local, absent

    def _read(self, chunks, local, gens, mapped: bool = False) -> np.ndarray:
        n, rb = len(chunks), self.rb
        out = np.empty((n, rb), np.uint8)
        if not n:
            return out
        self._ensure_open(chunks, gens)
        asked = local
        with self._lock:  # one consistent view of the descriptors, maps and verified blocks
            fds = self._fd[chunks]
            if mapped:
                self._map_files(chunks, gens)
                via_map = self._map_gen[chunks] == gens
            else:
                via_map = np.zeros(n, np.bool_)
            # Another thread may have opened another generation of a chunk, or closed it, since
            # `_ensure_open`: those rows are read from the generation asked for, on their own.
            other = (self._gen[chunks] != gens) | ((fds == -1) & ~via_map)
            local, absent = self._to_file_rows(chunks, local, other)
            base = self._off[chunks]
            nbytes = self._len[chunks]
            off = local * rb
            g0 = chunks * self.bpc + off // BLOCK
            g1 = chunks * self.bpc + (off + rb - 1) // BLOCK
            ok = ((self._ok_gen[chunks] == gens) & (self._ok[g0] != 0) & (self._ok[g1] != 0)) | (
                gens >= self.trusted_from_gen
            )
            # the checksums of the generations held now (a later `_open` replaces, never mutates)
            crcs = {c: self._crcs[c] for c in idsets.unique(chunks[~ok & ~other]).tolist() if c in self._crcs}
        todo = ~other
        if other.any():
            self._read_other(out, np.flatnonzero(other), chunks, asked, gens)
        if absent.any():  # rows a sparse chunk does not hold: never written, computed per row
            sel = np.flatnonzero(absent)
            out[sel] = self.disk.init_rows(chunks[sel] * self.cr + asked[sel])
            todo &= ~absent
        via_map &= todo
        if via_map.any():
            self._gather_mapped(out, np.flatnonzero(via_map), chunks, local, gens, base, ok, crcs, nbytes)
            todo &= ~via_map
        lz4 = (fds == -2) & todo
        if lz4.any():  # LZ4 chunks: whole, decompressed
            for i in np.flatnonzero(lz4).tolist():
                c = int(chunks[i])
                out[i] = self.disk.read_chunk(c, int(gens[i]))[local[i]]
            todo &= ~lz4
        first = todo & ~ok
        if first.any():
            self._read_verifying(out, np.flatnonzero(first), chunks, local, gens, fds, base, crcs, nbytes)
            todo &= ok
        sel = np.flatnonzero(todo)
        if len(sel):
            ids = chunks[sel] * self.cr + local[sel]
            # a run is adjacent in the file and in ``out`` (in a sparse chunk rows the file does
            # not hold lie between rows adjacent in the file)
            brk = np.flatnonzero(
                np.r_[
                    True, (ids[1:] != ids[:-1] + 1) | (sel[1:] != sel[:-1] + 1) | (fds[sel][1:] != fds[sel][:-1]), True
                ]
            )
            starts = brk[:-1]
            at = sel[starts]
            lens = np.diff(brk) * rb
            # One read per run of adjacent rows straight into ``out``; the batch's reads go to the
            # kernel in one call with the GIL released (see uring.py).
            got = uring.read_into(out, at * rb, fds[at], lens, base[at] + off[at], self.cache_counts)
            if not np.array_equal(got, lens):
                raise CorruptStoreError(self.disk.root / "chunks", "a chunk file is shorter than its rows")
            self.disk.bytes_read += len(sel) * rb
        return out

    def mapped_resident_bytes(self) -> int:
        """Bytes of the chunk files' maps now in this process's RSS (`MappedFiles.resident_bytes`)."""
        maps = self._maps
        return maps.resident_bytes() if maps is not None else 0

    def _map_files(self, chunks: np.ndarray, gens: np.ndarray) -> None:
        """Map the raw and sparse files of ``chunks`` held open at ``gens`` that have no map yet
        (caller holds the lock). Once per file: a batch of files already mapped costs a few
        array operations. Over `mapped.MAX_MAPPED` maps the oldest quarter stops serving."""
        new = (self._map_gen[chunks] != gens) & (self._gen[chunks] == gens) & (self._fd[chunks] >= 0)
        if not new.any():
            return
        maps = self._maps
        if maps is None:
            stride = -(-(HEADER_SIZE + 64 + self.cr // 8 + 8 + 4 * self.bpc + self.cr * self.rb) // PAGE) * PAGE
            maps = self._maps = MappedFiles(len(self._fd), stride, self.rb)
        if not maps.usable:
            return
        for c in idsets.unique(chunks[new]).tolist():
            if maps.mapped[c]:  # an older generation's map, not unmapped yet (a read was in progress)
                continue
            if len(self._map_order) >= MAX_MAPPED:
                for old in list(self._map_order)[: MAX_MAPPED // 4]:
                    self._drop_map(old)
            g = int(self._gen[c])
            if maps.map(c, int(self._fd[c]), int(self._off[c] + self._len[c]), g):
                self._map_gen[c] = g
                self._map_order[c] = None
                if g >= self.trusted_from_gen and not self._sparse[c]:
                    self._set_fast(c, g)

    def _set_fast(self, chunk: int, gen: int) -> None:
        """(Caller holds the lock.) Rows of ``chunk``'s raw file ``gen``, mapped and verified
        whole, are served by `gather_verified`: row ``id`` at ``id * row_bytes + _fast_base``."""
        maps = self._maps
        assert maps is not None
        self._fast_base[chunk] = chunk * maps.stride + int(self._off[chunk]) - chunk * self.cr * self.rb
        self._fast_gen[chunk] = gen

    def _gather_mapped(self, out, rows, chunks, local, gens, base, ok, crcs, nbytes) -> None:
        """Rows ``rows`` through the maps of their files: blocks not verified yet are checked in
        the map first (block by block, or the whole chunk once it keeps needing first reads or
        the call wants much of it), then every row is copied in one gather. The page faults it
        took for rows not cached count as reads the page cache did not hold (``cache_counts``)."""
        maps = self._maps
        assert maps is not None
        rb = self.rb
        faults = resource.getrusage(_RUSAGE_THREAD).ru_majflt if _RUSAGE_THREAD is not None else 0
        addr = chunks[rows] * maps.stride + base[rows] + local[rows] * rb
        first = rows[~ok[rows]]
        if len(first):
            self._verify_mapped(first, chunks, local, gens, base, crcs, nbytes)
        # (fancy indexing, not `take`: take first copies a non-contiguous array whole)
        got = maps.rows[addr].view(np.uint8).reshape(-1, rb)
        if len(rows) == len(out):
            out[:] = got
        else:
            out[rows] = got
        self.map_counts[0] += len(rows)
        self.disk.bytes_read += len(rows) * rb
        if _RUSAGE_THREAD is not None:
            faults = resource.getrusage(_RUSAGE_THREAD).ru_majflt - faults
            self.cache_counts[0] += len(rows)
            self.cache_counts[1] += min(len(rows), faults)

    def _verify_mapped(self, rows, chunks, local, gens, base, crcs, nbytes) -> None:
        """Check in the maps the blocks of ``rows`` (sorted by chunk) not verified yet, and
        remember them verified; raises `CorruptStoreError` naming the first bad block. Whole
        chunks (one that keeps needing first reads: `WHOLE_AFTER` calls; or of which the call
        wants much) are checked in one pass each; the other blocks with one CRC-32 each, their
        expected values taken with one gather: no per-row Python."""
        maps = self._maps
        assert maps is not None
        rb, bpc = self.rb, self.bpc
        c = chunks[rows]
        off = local[rows] * rb
        bounds = idsets.runs(c)
        at = rows[bounds[:-1]]
        uc, ug, counts = chunks[at], gens[at], np.diff(bounds)
        keys = idsets.unique(np.concatenate([c * bpc + off // BLOCK, c * bpc + (off + rb - 1) // BLOCK]))
        with self._lock:
            stale = self._ok_gen[uc] != ug
            for ch, gen in zip(uc[stale].tolist(), ug[stale].tolist()):  # flags of another generation
                self._ok[ch * bpc : (ch + 1) * bpc] = 0
                self._ok_gen[ch] = gen
            keys = keys[self._ok[keys] == 0]
        which = np.searchsorted(uc, keys // bpc)  # each block's chunk among ``uc``
        file_bytes = nbytes[at]
        in_file = -(-file_bytes // BLOCK)
        blocks = np.bincount(which, minlength=len(uc))
        whole = ((self._first_reads[uc] >= WHOLE_AFTER) | (counts * DENSE_ROWS >= file_bytes // rb)
                 | ((blocks * DENSE_SHARE >= in_file) & (blocks >= 2)))
        self._first_reads[uc] += 1
        start = uc * maps.stride + base[at]  # each chunk's records in the maps
        total, uncached = self.cache_counts
        if _FADV_WILLNEED is not None and uncached * 10 > total:
            # Reads lately waited for the disk: ask for every block this call checks at once
            # (the checks below then fault on pages already being read), not one fault's read at
            # a time. Over the page cache this is skipped (a system call per block or chunk).
            self._ask_blocks(uc, whole, keys, which, base[at])
        for i in np.flatnonzero(whole).tolist():
            ch, a, n = int(uc[i]), int(start[i]), int(file_bytes[i])
            bad = first_bad_block(maps.bytes[a : a + n], crcs[ch])
            self.map_counts[1] += int(in_file[i])
            if bad >= 0:
                raise CorruptStoreError(self.disk.chunk_path(ch, int(ug[i])),
                                        f"block {bad} of chunk {ch} fails its checksum")
        if whole.any():
            part = ~whole[which]
            keys, which = keys[part], which[part]
        if len(keys):
            lo = start[which] + keys % bpc * BLOCK
            hi = np.minimum(lo + BLOCK, start[which] + file_bytes[which])
            view = maps.view
            got = np.fromiter((crc32(view[a:z]) for a, z in zip(lo.tolist(), hi.tolist())), np.uint32, len(keys))
            self.map_counts[1] += len(keys)
            for k in np.flatnonzero(got != self._crc_flat[keys]).tolist():
                ch, b = divmod(int(keys[k]), bpc)
                if int(got[k]) != crcs[ch][b]:  # (the flat copy may already hold a newer generation's)
                    raise CorruptStoreError(self.disk.chunk_path(ch, int(ug[which[k]])),
                                            f"block {b} of chunk {ch} fails its checksum")
        with self._lock:
            keep = self._ok_gen[uc] == ug  # (unless another thread moved a chunk to another generation)
            for i in np.flatnonzero(whole & keep).tolist():
                ch = int(uc[i])
                self._ok[ch * bpc : ch * bpc + int(in_file[i])] = 1
                if self._map_gen[ch] == ug[i] and not self._sparse[ch]:
                    self._set_fast(ch, int(ug[i]))
            if len(keys):
                self._ok[keys[keep[which]]] = 1

    def _ask_blocks(self, uc, whole, keys, which, base) -> None:
        """``posix_fadvise(WILLNEED)`` of the chunks ``uc[whole]`` whole and of blocks ``keys``
        (of chunks ``uc[which]``) of the others; a hint: a file closed meanwhile is skipped."""
        for i in np.flatnonzero(whole).tolist():
            fd = int(self._fd[uc[i]])
            if fd >= 0:
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
        rest = ~whole[which]
        for k, i in zip(keys[rest].tolist(), which[rest].tolist()):
            fd = int(self._fd[uc[i]])
            if fd >= 0:
                try:
                    os.posix_fadvise(fd, int(base[i]) + k % self.bpc * BLOCK, BLOCK, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass

    def _read_other(
        self, out: np.ndarray, rows: np.ndarray, chunks: np.ndarray, local: np.ndarray, gens: np.ndarray
    ) -> None:
        """Rows of a generation other than the one held open (a race with another thread's
        `_open` or `_trim`): verified block-wise through a descriptor of their own. Rare."""
        c, g = chunks[rows], gens[rows]
        bounds = np.flatnonzero(np.r_[True, (c[1:] != c[:-1]) | (g[1:] != g[:-1]), True])
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            ch, gen = int(c[a]), int(g[a])
            sel = rows[a:b]
            got = self.disk.read_chunk_rows(ch, gen, local[sel])
            if got is None:  # an LZ4 chunk: read whole
                got = self.disk.read_chunk(ch, gen)[local[sel]]
            out[sel] = got

    def _verify_cached_chunks(
        self, out, rows, chunks, local, gens, fds, base, crcs, nbytes, *, wait: bool = False
    ) -> np.ndarray:
        """Chunks whose every page is in the page cache are read and verified whole, in one read
        and one pass of checksums (``RWF_NOWAIT`` fails rather than wait for the disk, so a cold
        chunk is never read whole for a few rows). ``wait``: read them whole even from the disk
        (one sequential read; for chunks a call wants many blocks of). Returns the rows still to
        read block-wise."""
        c = chunks[rows]
        bounds = idsets.runs(c)
        left = np.ones(len(rows), np.bool_)
        rb = self.rb
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            ch = int(c[a])
            n = int(nbytes[rows[a]])
            buf = bytearray(n)
            try:
                got = os.preadv(int(fds[rows[a]]), [buf], int(base[rows[a]]), 0 if wait else _RWF_NOWAIT)
            except OSError:  # not cached (EAGAIN), or unsupported here: block-wise
                got = -1
            if got != n:
                continue
            cl = crcs[ch]
            bad = first_bad_block(buf, cl)  # one GIL-free pass over the chunk
            if bad >= 0:
                raise CorruptStoreError(
                    self.disk.chunk_path(ch, int(gens[rows[a]])), f"block {bad} of chunk {ch} fails its checksum"
                )
            recs = np.frombuffer(buf, np.uint8).reshape(-1, rb)
            out[rows[a:b]] = recs[local[rows[a:b]]]
            left[a:b] = False
            self.disk.bytes_read += n
            gen = int(gens[rows[a]])
            with self._lock:
                self._ok_gen[ch] = gen
                self._ok[ch * self.bpc : ch * self.bpc + len(cl)] = 1
        return rows[left]

    def _read_verifying(self, out, rows, chunks, local, gens, fds, base, crcs, nbytes) -> None:
        """Rows whose blocks were not verified yet: read their blocks whole and check them.

        A chunk this call wants at least 1/8 of the blocks or 1/64 of the rows of (an epoch in
        `ChunkShuffleSampler` order) is read whole in one sequential read, cached or not: on a
        cold disk one read of 512 KiB costs less than a few dozen random 4 KiB ones, and the
        chunk's later rows then come verified from the page cache (in that order, block-wise
        reads were ~40 us of disk wait each, 7,800 of them in 300 batches). A random batch asks
        a few rows of each chunk and stays block-wise. The share of rows matters for wide rows:
        32 rows of 2 KiB are 1/16 of a 1,024-row chunk's blocks, and reading them block-wise
        cold ran the sampler's order at 0.45x the disk's sequential bandwidth."""
        where = (chunks, local, gens, fds, base, crcs, nbytes)
        rows = self._verify_dense_chunks(out, rows, *where)
        if len(rows) and _RWF_NOWAIT:
            rows = self._verify_busy_chunks(out, rows, *where)
        if not len(rows):
            return
        c, b0, b1 = self._read_blocks(out, rows, *where)
        self._mark_verified(c, gens[rows], b0, b1)

    def _verify_dense_chunks(self, out, rows, chunks, local, gens, fds, base, crcs, nbytes) -> np.ndarray:
        """Read whole and verify the chunks ``rows`` want a good share of (see `_read_verifying`);
        returns the rows left to read block-wise."""
        c = chunks[rows]
        bounds = idsets.runs(c)
        if len(bounds) <= 1:
            return rows
        first_block = local[rows] * self.rb // BLOCK
        new_block = np.r_[True, (c[1:] != c[:-1]) | (first_block[1:] != first_block[:-1])]
        blocks = np.add.reduceat(new_block.astype(np.int64), bounds[:-1])
        file_bytes = nbytes[rows[bounds[:-1]]]
        in_file = -(-file_bytes // BLOCK)  # fewer than bpc in a sparse chunk
        wanted = np.diff(bounds)
        dense = (blocks * DENSE_SHARE >= in_file) | (wanted * DENSE_ROWS >= file_bytes // self.rb)
        dense = np.repeat(dense & (blocks >= 2), wanted)
        if not dense.any():
            return rows
        rest = self._verify_cached_chunks(out, rows[dense], chunks, local, gens, fds, base, crcs, nbytes, wait=True)
        return np.sort(np.concatenate([rows[~dense], rest]))

    def _verify_busy_chunks(self, out, rows, chunks, local, gens, fds, base, crcs, nbytes) -> np.ndarray:
        """A chunk that keeps needing first reads of its blocks (an epoch over the table) is
        verified whole once it is cached; a few random rows still read only their blocks. Returns
        the rows left to read block-wise."""
        c = chunks[rows]
        seen = self._first_reads[c]
        np.add.at(self._first_reads, c, 1)
        busy = seen >= WHOLE_AFTER
        if not busy.any():
            return rows
        rest = self._verify_cached_chunks(out, rows[busy], chunks, local, gens, fds, base, crcs, nbytes)
        return np.sort(np.concatenate([rows[~busy], rest]))

    def _read_blocks(self, out, rows, chunks, local, gens, fds, base, crcs, nbytes) -> tuple:
        """Read the blocks each of ``rows`` lies in, check them against ``crcs`` and copy the
        rows into ``out``; returns (chunk, first block, last block) per row. A short read or a
        block failing its checksum raises CorruptStoreError naming the file."""
        rb = self.rb
        c = chunks[rows]
        off = local[rows] * rb
        b0, b1 = off // BLOCK, (off + rb - 1) // BLOCK
        raw_len = nbytes[rows]
        lo = b0 * BLOCK
        hi = np.minimum((b1 + 1) * BLOCK, raw_len)
        mv = memoryview(out.reshape(-1))
        nread = 0
        for i, ch, fd, start, a, z, x0, x1, o in zip(
            rows.tolist(),
            c.tolist(),
            fds[rows].tolist(),
            base[rows].tolist(),
            lo.tolist(),
            hi.tolist(),
            b0.tolist(),
            b1.tolist(),
            off.tolist(),
        ):
            data = os.pread(fd, z - a, start + a)
            if len(data) != z - a:
                raise CorruptStoreError(
                    self.disk.chunk_path(ch, int(gens[i])), f"truncated: block {x0} of chunk {ch} is short"
                )
            cl = crcs[ch]
            if x0 == x1:
                if crc32(data) != cl[x0]:
                    raise CorruptStoreError(
                        self.disk.chunk_path(ch, int(gens[i])), f"block {x0} of chunk {ch} fails its checksum"
                    )
            else:
                for b in range(x0, x1 + 1):
                    if crc32(data[(b - x0) * BLOCK : (b - x0 + 1) * BLOCK]) != cl[b]:
                        raise CorruptStoreError(
                            self.disk.chunk_path(ch, int(gens[i])), f"block {b} of chunk {ch} fails its checksum"
                        )
            mv[i * rb : (i + 1) * rb] = data[o - a : o - a + rb]
            nread += z - a
        self.disk.bytes_read += nread
        return c, b0, b1

    def _mark_verified(self, c: np.ndarray, g: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> None:
        """Blocks ``b0..b1`` of chunks ``c`` (generations ``g``) were read and checked: later
        reads of them skip the check (flags of another generation of a chunk start over)."""
        with self._lock:
            for ch in idsets.unique(c).tolist():
                gen = int(g[c == ch][0])
                if self._ok_gen[ch] != gen:  # flags of another generation of this chunk: start over
                    self._ok[ch * self.bpc : (ch + 1) * self.bpc] = 0
                    self._ok_gen[ch] = gen
            keep = self._ok_gen[c] == g
            first = c * self.bpc
            self._ok[(first + b0)[keep]] = 1
            self._ok[(first + b1)[keep]] = 1
            span = keep & (b1 - b0 > 1)
            for f, x0, x1 in zip(first[span].tolist(), b0[span].tolist(), b1[span].tolist()):
                self._ok[f + x0 : f + x1 + 1] = 1

    def _advise_whole_later(self, chunks: list[tuple[int, int]]) -> None:
        """Ask the kernel for whole chunk files from a helper thread: the kernel's part of
        ``posix_fadvise(WILLNEED)`` (allocating the page cache pages and queueing the reads, ~150
        us per 512 KiB here) then runs beside the training thread instead of in it. The thread
        holds the GIL only between its system calls."""
        if os.getpid() != self._pid:  # a forked child has no helper thread (nor the parent's lock)
            return
        if self._adviser is None:
            self._adviser = ThreadPoolExecutor(1, thread_name_prefix="embcache-advise")
        self._enter()  # descriptors open here stay open until the helper is done
        try:
            self._adviser.submit(self._advise_each, chunks)
        except BaseException:
            self._leave()
            raise

    def _advise_each(self, chunks: list[tuple[int, int]]) -> None:
        try:
            for c, g in chunks:
                try:
                    self._advise_whole(c, g)
                except OSError:
                    pass  # a hint (a compaction replaced the file meanwhile: the miss reads the new one)
        finally:
            self._leave()

    def _advise_whole(self, c: int, g: int) -> None:
        assert _FADV_WILLNEED is not None  # (`_advise_whole_later` is called only where it exists)
        if self._fd[c] >= 0 and self._gen[c] == g:  # (`_enter`: it stays open meanwhile)
            os.posix_fadvise(int(self._fd[c]), 0, 0, _FADV_WILLNEED)
            return
        # not open here, or an LZ4 chunk (read whole by the miss)
        fd = os.open(_chunk_name(c, g), _OPEN_FLAGS, dir_fd=self.disk._chunks_fd)
        try:
            os.posix_fadvise(fd, 0, 0, _FADV_WILLNEED)
        finally:
            os.close(fd)

    def asked_whole(self, chunks: np.ndarray, gens: np.ndarray) -> bool:
        """Whether each of ``chunks`` (at ``gens``) was asked for whole lately (`will_need`)."""
        return bool((self._asked_gen[chunks] == gens).all())

    def will_need(self, chunks: np.ndarray, local: np.ndarray, gens: np.ndarray) -> bool:
        """Ask the kernel to start reading these rows' blocks now (asynchronously; a hint).
        True if it could ask for every row (none asked block by block lies in an LZ4 chunk, no
        call failed).

        ``chunks`` sorted (rows of sorted ids). A chunk of which at least 1/64 of the rows were
        announced over the last calls is asked for whole, once per generation while it stays
        among the chunks announced lately (half the table's or 512, whichever is fewer, at least
        64: a table of more chunks is asked for again each epoch; `ChunkShuffleSampler` order announces each
        chunk in every batch of its window), by a helper thread (`_advise_whole_later`), through
        a descriptor opened just for that if none is open: its header is not read (a disk read
        the caller would wait for). Other rows
        by their blocks (one request for their span where they lie close together or are four
        or more: a system call costs about as much as the kernel's reading a few blocks more)."""
        if _FADV_WILLNEED is None:
            return False
        if not len(chunks):
            return True
        bounds = idsets.runs(chunks)
        starts = bounds[:-1]
        counts = np.diff(bounds).tolist()
        advised = self._advised
        sparse_rows = []  # (first, end) positions of the chunks asked block by block
        whole_chunks: list[tuple[int, int]] = []
        self._enter()
        try:
            for i, a in enumerate(starts.tolist()):
                c, g = int(chunks[a]), int(gens[a])
                seen = advised.get((c, g), 0)
                if seen < 0:  # asked for whole lately
                    continue
                seen += counts[i]  # rows of it announced lately, this call's included
                whole = seen * DENSE_ROWS >= self.disk.chunk_rows_of(c)
                advised[(c, g)] = -1 if whole else seen
                if whole:
                    self._asked_gen[c] = g
                if len(advised) > self._advised_max:
                    (oc, og), was = next(iter(advised.items()))
                    del advised[(oc, og)]
                    if was < 0 and self._asked_gen[oc] == og:
                        self._asked_gen[oc] = 0
                if not whole:
                    sparse_rows.append((a, int(bounds[i + 1])))
                else:
                    whole_chunks.append((c, g))
            if whole_chunks:
                self._advise_whole_later(whole_chunks)
            if not sparse_rows:
                return True
            sel = np.concatenate([np.arange(a, b) for a, b in sparse_rows])
            chunks, local, gens = chunks[sel], local[sel], gens[sel]
            self._ensure_open(chunks, gens)
            with self._lock:
                fds, base = self._fd[chunks], self._off[chunks]
                local, absent = self._to_file_rows(chunks, local, self._gen[chunks] != gens)
            raw = (fds >= 0) & ~absent
            everything = bool(raw.all())
            c, fds, base = chunks[raw], fds[raw], base[raw]
            block = local[raw] * self.rb // BLOCK * BLOCK
            bounds = idsets.runs(c)
            for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                fd = int(fds[a])
                blocks = idsets.unique(block[a:b])
                span = int(blocks[-1]) - int(blocks[0]) + BLOCK
                if len(blocks) >= 4 or span <= 4 * BLOCK * len(blocks):  # one request for the span
                    os.posix_fadvise(fd, int(base[a]) + int(blocks[0]), span, _FADV_WILLNEED)
                    continue
                for pos in blocks.tolist():
                    os.posix_fadvise(fd, int(base[a]) + pos, BLOCK, _FADV_WILLNEED)
            return everything
        except FileNotFoundError:
            return False  # a compaction replaced the file meanwhile: the miss reads the new one
        except (CorruptStoreError, OSError):
            return False
        finally:
            self._leave()
