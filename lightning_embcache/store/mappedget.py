"""A disk-mode get over page-cached chunk files in one C loop (native/gather.c).

Without it (`Tiers._mapped_get`, the numpy reference) a get over chunk files mapped and verified
whole costs some 20 numpy calls of 1-3 us each, and a get wanting a block not verified yet - every
call of a fresh handle's first passes over a table - takes the general miss path (a plan, a
Python call per block checked, hot slots). Here one loop does a call's work with the interpreter
lock let go: each id's hot slot or its row in the maps (store/mapped.py), each 4 KiB block's
CRC-32 checked against the file's directory the first time a row of it is read (ISA-L's CRC
function, called from C), the copy. A call that meets a chunk file not mapped yet maps it (header
and checksum directory read and checked by `ChunkRows` as ever) and runs again. Whatever else the
loop cannot serve (a row with a delta record, a sparse or LZ4 file, a block failing its check)
goes to the general path, which reads, verifies and names damage as before; nothing is counted
for a call it hands over.

This module reads `ChunkRows`' per-chunk arrays directly (its bookkeeping, under its rules: the
store's lock held, a read begun with ``_enter``), as `Tiers._mapped_get` does through
`ChunkRows.gather_verified`.
"""

from __future__ import annotations

import ctypes
import os
import time
import weakref
import zlib
from typing import Any

import numpy as np
import torch

from ..native import library as native_library
from . import chunkrows as chunkrows_mod
from . import idsets
from .blockcrc import BLOCK
from .disk import _CHUNK_HEAD
from .fileio import HEADER_SIZE
from .mapped import PAGE

# context slots, in native/gather.c's order
(CX_NUM_ROWS, CX_CHUNK_ROWS, CX_ROW_BYTES, CX_BLOCK, CX_BPC, CX_STRIDE, CX_SLOT_OF, CX_POOL, CX_REF, CX_BITS,
 CX_CMAP, CX_FAST_GEN, CX_FAST_BASE, CX_MAP_GEN, CX_FILE_GEN, CX_OK_GEN, CX_SPARSE, CX_OFF, CX_LEN, CX_OK,
 CX_CRC, CX_MAPS, CX_CRC_FN, CX_STAMP, CX_CALL, CX_PAGE, CX_REGION, CX_RPC, CX_SEEN_GEN, CX_COLD, CX_ASKED,
 CX_FIRST_READS, CX_FIRST_STAMP, CX_WHOLE_AFTER,
 CX_HOT, CX_CHUNKS, CX_BLOCKS, CX_AT, CX_BAD_CHUNK, CX_BAD_BLOCK, CX_ASKS, CX_SIZE) = range(42)
#: bytes asked around a row of a file not in the page cache (as the kernel's read-around of a
#: memmap's page fault, 128 KiB by default; here asked for a whole batch at once)
ASK_BYTES = 128 << 10
DONE, GENERAL, DELTA = 0, 1, 2
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)

_crc_fn: int | None = None
_crc_tried = False


def crc32_function() -> int | None:
    """Address of ISA-L's ``crc32_gzip_refl`` (zlib's CRC-32), exported by the isal package's
    extension module, checked against zlib once; None without isal (gets then verify blocks
    through the general path)."""
    global _crc_fn, _crc_tried
    if not _crc_tried:
        _crc_tried = True
        try:
            from isal import isal_zlib

            fn = ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl
            fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint64]
            probe = bytes(range(256)) * 17
            if fn(0, probe, len(probe)) == zlib.crc32(probe):
                _crc_fn = ctypes.cast(fn, ctypes.c_void_p).value
        except (ImportError, OSError, AttributeError):
            _crc_fn = None
    return _crc_fn


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


class NativeGet:
    """The C get of `Tiers._mapped_get`'s case (see the module docstring). `ready` says whether it
    applies now; a call then returns the call's records, or None where the general path must
    serve it (nothing done, nothing counted)."""

    def __init__(self, tiers: Any) -> None:
        self._t = weakref.proxy(tiers)  # (the tiers hold this)
        self._fn: Any = None  # the C function, looked up at the first disk-mode get (a build)
        self._looked_up = False
        self._key: tuple = ()
        self._cx: np.ndarray | None = None
        self._cx_ptr = 0
        self._stamp: np.ndarray | None = None
        self._first_stamp = np.zeros(0, np.int64)
        # per chunk: the generation last seen, whether its file was then not all in the page
        # cache, and which ASK_BYTES regions of it were asked for (gather.c `em_ask_cold`)
        self._seen: tuple | None = None
        #: regions asked for so far (what tests count)
        self.asks = 0

    def ready(self) -> bool:
        """Whether a get may go through `__call__` (caller holds the store's lock)."""
        if not self._looked_up:
            self._looked_up = True
            lib = native_library()  # (built by the system's C compiler the first time in a process)
            self._fn = lib.em_gather_mapped if lib is not None else None
        if self._fn is None or not chunkrows_mod.MAPPED_READS:
            return False
        t = self._t
        hot, v = t.hot, t._v
        reader = v.chunkrows
        rows = v.rows
        bits = rows._bits if rows is not None and len(rows) else None
        k = self._key
        if (k and k[0] is hot.slot_of and k[1] is hot.pool_np and k[2] is hot.ref and k[3] is v.cmap
                and k[4] is bits and k[5] is reader and k[6] is reader._maps and k[7] is rows):
            return self._cx is not None
        return self._build(bits)

    def _build(self, bits: np.ndarray | None) -> bool:
        t = self._t
        hot, v = t.hot, t._v
        reader, rows = v.chunkrows, v.rows
        maps = reader._maps
        self._key = (hot.slot_of, hot.pool_np, hot.ref, v.cmap, bits, reader, maps, rows)
        self._cx = None
        c = t._c
        pool = hot.pool_np
        usable = (
            (bits is not None or rows is None or not len(rows)) and v.cmap.dtype == np.int32
            and hot.slot_of.dtype == np.int32 and pool is not None and pool.dtype == np.uint8
            and pool.flags.c_contiguous and pool.ndim == 2 and pool.shape[1] == c.row_bytes
            and reader.rb == c.row_bytes and reader.cr == c.chunk_rows and crc32_function() is not None
        )
        if not usable or maps is not None and not maps.usable:
            return False
        cx = np.zeros(CX_SIZE, np.int64)
        if maps is not None:
            nc = len(reader._fd)
            if self._stamp is None or len(self._stamp) < nc:
                self._stamp = np.zeros(nc, np.int64)
                self._first_stamp = np.zeros(nc, np.int64)
            cx[CX_NUM_ROWS], cx[CX_CHUNK_ROWS], cx[CX_ROW_BYTES] = c.num_rows, reader.cr, reader.rb
            cx[CX_BLOCK], cx[CX_BPC], cx[CX_STRIDE] = BLOCK, reader.bpc, maps.stride
            cx[CX_SLOT_OF], cx[CX_POOL], cx[CX_REF] = _ptr(hot.slot_of), _ptr(pool), _ptr(hot.ref)
            cx[CX_BITS] = _ptr(bits) if bits is not None else 0
            cx[CX_CMAP] = _ptr(v.cmap)
            cx[CX_FAST_GEN], cx[CX_FAST_BASE] = _ptr(reader._fast_gen), _ptr(reader._fast_base)
            cx[CX_MAP_GEN], cx[CX_FILE_GEN], cx[CX_OK_GEN] = (_ptr(reader._map_gen), _ptr(reader._gen),
                                                              _ptr(reader._ok_gen))
            cx[CX_SPARSE], cx[CX_OFF], cx[CX_LEN] = _ptr(reader._sparse), _ptr(reader._off), _ptr(reader._len)
            cx[CX_OK], cx[CX_CRC], cx[CX_MAPS] = _ptr(reader._ok), _ptr(reader._crc_flat), maps._base
            cx[CX_CRC_FN], cx[CX_STAMP] = crc32_function() or 0, _ptr(self._stamp)
            if self._seen is None or len(self._seen[0]) < nc or self._seen[2] != maps.stride:
                rpc = -(-maps.stride // ASK_BYTES)
                self._seen = (np.zeros(nc, np.int64), np.zeros(nc, np.uint8), maps.stride,
                              np.zeros(nc * rpc, np.uint8), rpc)
            seen_gen, cold, _, asked, rpc = self._seen
            cx[CX_PAGE], cx[CX_REGION], cx[CX_RPC] = PAGE, ASK_BYTES, rpc
            cx[CX_SEEN_GEN], cx[CX_COLD], cx[CX_ASKED] = _ptr(seen_gen), _ptr(cold), _ptr(asked)
            # (`ChunkRows`' count of calls with first reads per chunk: after WHOLE_AFTER the
            # chunk is checked whole, as the general path does)
            cx[CX_FIRST_READS], cx[CX_FIRST_STAMP] = _ptr(reader._first_reads), _ptr(self._first_stamp)
            cx[CX_WHOLE_AFTER] = chunkrows_mod.WHOLE_AFTER
        # else: no map yet (a fresh handle); CX_MAPS 0 makes the first call map its chunks
        self._cx = cx
        self._cx_ptr = _ptr(cx)
        return True

    def __call__(self, idx: np.ndarray) -> np.ndarray | None:
        """Records of ``idx`` (validated ids), or None: the general path serves the call."""
        t = self._t
        reader = t._v.chunkrows
        n = len(idx)
        out = np.empty((n, reader.rb), np.uint8)
        ids_ptr, out_ptr = torch.from_numpy(idx).data_ptr(), torch.from_numpy(out).data_ptr()
        t0 = time.perf_counter()
        prepared = bits_checked = False
        while True:
            cx = self._cx
            assert cx is not None
            if cx[CX_MAPS]:
                status = self._run(reader, ids_ptr, n, out_ptr, skip_bits=bits_checked)
                hot, chunks, blocks, _, _, _, asks = cx[CX_HOT : CX_ASKS + 1].tolist()
                reader.map_counts[1] += blocks
                self.asks += asks
            else:
                status = GENERAL
            if status == DONE:
                break
            if status == GENERAL and not prepared:
                prepared = True
                if self._map_chunks(idx) and self.ready():
                    continue
            elif status == DELTA and not bits_checked:
                # a row whose bit is set may have a record in a delta segment (or had one, since
                # compacted): the row index decides, as `_mapped_get` asks it
                bits_checked = True
                if not t._v.rows.any_of(idx[t.hot.slot_of[idx] == 0]):
                    continue
            return None
        took = time.perf_counter() - t0
        n_miss = n - hot
        stats = t._c.stats
        stats.stall_seconds += took
        t.readahead.note_read(took, n_miss)
        stats.hot_misses += n_miss
        stats.hot_hits += hot
        stats.cold_reads += chunks
        reader.map_counts[0] += n_miss
        reader.cache_counts[0] += n_miss
        reader.disk.bytes_read += n_miss * reader.rb
        return out

    def _run(self, reader: Any, ids_ptr: int, n: int, out_ptr: int, *, skip_bits: bool) -> int:
        cx = self._cx
        assert cx is not None and self._fn is not None
        pool = reader.disk.pool
        epoch = pool.begin_read()  # no file this read may reach is reused meanwhile
        reader._enter()  # no map goes away meanwhile
        bits = int(cx[CX_BITS]) if skip_bits else 0
        try:
            if skip_bits:
                cx[CX_BITS] = 0
            return int(self._fn(self._cx_ptr, ids_ptr, n, out_ptr, self._t.hot.used))
        finally:
            if skip_bits:
                cx[CX_BITS] = bits
            reader._leave()
            pool.end_read(epoch)

    def _map_chunks(self, idx: np.ndarray) -> bool:
        """Open and map the raw files of the chunks of ``idx``'s rows not hot that are not mapped
        here yet, their block flags taken to the generation wanted (none verified); False if
        there were none (the general path serves the call)."""
        t = self._t
        reader, cmap = t._v.chunkrows, t._v.cmap
        below = idx[t.hot.slot_of[idx] == 0]
        chunks = below // reader.cr
        gens = cmap[chunks].astype(np.int64)
        need = ((gens > 0) & (reader._fast_gen[chunks] != gens)
                & ((reader._map_gen[chunks] != gens) | (reader._ok_gen[chunks] != gens)))
        if not need.any():
            return False
        c = idsets.unique(chunks[need])  # (one generation per chunk: the chunk map's)
        g = cmap[c].astype(np.int64)
        if len(c) > 1:
            _ask_heads(reader, c, g)
        pool = reader.disk.pool
        epoch = pool.begin_read()
        reader._enter()
        try:
            reader._ensure_open(c, g)
            with reader._lock:
                reader._map_files(c, g)
                bpc = reader.bpc
                for ch, gen in zip(c.tolist(), g.tolist()):
                    if reader._map_gen[ch] == gen and reader._ok_gen[ch] != gen:
                        reader._ok[ch * bpc : (ch + 1) * bpc] = 0
                        reader._ok_gen[ch] = gen
        finally:
            reader._leave()
            pool.end_read(epoch)
        return True


def _ask_heads(reader: Any, chunks: np.ndarray, gens: np.ndarray) -> None:
    """Files about to be opened (``chunks`` at ``gens``) whose first one's head is not in the page
    cache: ask the kernel for every head at once (header and checksum directory), so the opens
    that follow wait for reads running together, not for one read each. A hint: a file that
    cannot be opened here is left to the open, which names it."""
    head = HEADER_SIZE + _CHUNK_HEAD.size + 4 * reader.bpc
    dir_fd = reader.disk._chunks_fd
    for k, (c, g) in enumerate(zip(chunks.tolist(), gens.tolist())):
        try:
            fd = os.open(chunkrows_mod._chunk_name(c, g), _OPEN_FLAGS, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            if k == 0:
                try:
                    os.preadv(fd, [bytearray(head)], 0, _RWF_NOWAIT)
                    return  # cached: the opens read it from memory
                except BlockingIOError:
                    pass
            os.posix_fadvise(fd, 0, head, os.POSIX_FADV_WILLNEED)
        except OSError:
            return  # (RWF_NOWAIT or fadvise not supported here)
        finally:
            os.close(fd)
