"""Check a run of 4 KiB blocks against their stored CRC-32s with one CRC-32 pass over all of them.

Chunk files keep a CRC-32 per 4 KiB block so that a few rows can be verified without reading the
whole chunk. A whole chunk read used to be checked block by block: 128 calls of ``zlib.crc32``
per 512 KiB, each too short for zlib to let go of the GIL (it does above 5 KiB), so a thread
reading chunks in the background took the GIL from the training thread for every block.

CRC-32 is linear: ``crc(A + B) == S_len(B)(crc(A)) ^ crc(B)`` with ``S_m`` a fixed GF(2) map
(zlib's ``crc32_combine``). The CRC of the whole run is therefore the XOR of each stored block
CRC mapped through the shift for the bytes after it; those maps are tabulated once per run length
(one 32-entry column per block). One CRC-32 over the run (`fileio.crc32`: the GIL is let go) plus
a vectorised XOR replaces the loop. The check detects what a CRC-32 of the whole run detects (every burst of
up to 32 bits, any other error but with probability 2^-32); on a mismatch the blocks are checked
one by one to name the bad block.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np

from .fileio import crc32

BLOCK = 4096
_BITS = np.arange(32, dtype=np.uint32)


def _shift_columns(nbytes: int) -> np.ndarray:
    """The 32 columns of ``S_nbytes``: the CRC state carried over ``nbytes`` zero bytes."""
    zeros = bytes(nbytes)
    base = zlib.crc32(zeros, 0)
    return np.array([zlib.crc32(zeros, 1 << j) ^ base for j in range(32)], np.uint32)


def _apply(columns: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The GF(2) map given by ``columns`` applied to each of ``values``."""
    bits = ((values[:, None] >> _BITS) & 1).astype(np.bool_)
    return np.bitwise_xor.reduce(np.where(bits, columns[None, :], np.uint32(0)), axis=1)


def _compose_all(maps: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Each of the maps ``maps`` (k, 32 columns) composed with the map ``q`` (32 columns)."""
    bits = ((q[:, None] >> _BITS) & 1).astype(np.bool_)  # (column, bit)
    return np.bitwise_xor.reduce(np.where(bits[None], maps[:, None, :], np.uint32(0)), axis=2)


@lru_cache(maxsize=4)
def _table(nblocks: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """(nblocks, 4, 256), flat, and where each of its rows starts: entry [i, k, b] is what byte k
    (little-endian) of block i's CRC, of value b, becomes carried over the bytes after block i -
    for ``nblocks`` blocks of which the last has ``last`` bytes (512 KiB for a 512 KiB chunk; a
    store has one or two shapes). Built in ~1.3 ms for 128 blocks (the first chunk a handle
    verifies waits for it): the shifts over 0..n-2 blocks by doubling, the byte tables by
    doubling over the byte's bits."""
    columns = np.empty((nblocks, 32), np.uint32)
    columns[-1] = np.left_shift(np.uint32(1), _BITS)  # the identity: nothing follows the last block
    if nblocks > 1:
        m = nblocks - 1
        powers = np.empty((m, 32), np.uint32)  # the shift over j full blocks, j = 0..m-1
        powers[0] = columns[-1]
        one = _shift_columns(BLOCK)
        have = 1
        while have < m:  # powers of one map commute: P[have + j] = P[j] o P[have]
            k = min(have, m - have)
            powers[have : have + k] = _compose_all(powers[:k], _apply(powers[have - 1], one))
            have += k
        # after block i: n-2-i full blocks, then the last one's bytes
        columns[:-1] = _apply(_shift_columns(last), powers[::-1].reshape(-1)).reshape(m, 32)
    per_bit = columns.reshape(nblocks, 4, 8)  # bit j of byte k is column 8 k + j
    table: np.ndarray = np.zeros((nblocks, 4, 256), np.uint32)
    for j in range(8):  # values with bit j as their highest: those below it, XOR bit j's column
        table[:, :, 1 << j : 2 << j] = table[:, :, : 1 << j] ^ per_bit[:, :, j : j + 1]
    table = table.reshape(-1)
    table.flags.writeable = False
    return table, np.arange(0, len(table), 256, dtype=np.intp)


def combined(crcs: np.ndarray, nbytes: int) -> int:
    """The CRC-32 of ``nbytes`` bytes made of blocks of 4 KiB (the last shorter) whose own CRC-32s
    are ``crcs``."""
    n = len(crcs)
    if n != -(-nbytes // BLOCK) or n == 0:
        raise ValueError(f"{nbytes} bytes are {-(-nbytes // BLOCK)} blocks of {BLOCK}; got {n} checksums")
    table, starts = _table(n, nbytes - (n - 1) * BLOCK)
    b = np.ascontiguousarray(crcs, dtype="<u4").view(np.uint8)  # byte k of block i at 4 i + k
    return int(np.bitwise_xor.reduce(table.take(starts + b)))


def first_bad_block(data: bytes | bytearray | memoryview | np.ndarray, crcs: np.ndarray) -> int:
    """-1 if every 4 KiB block of ``data`` matches its CRC-32 in ``crcs``, else the first block
    that does not."""
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    n = -(-len(view) // BLOCK)
    if len(crcs) != n:
        return min(len(crcs), n)  # a block missing or one checksum too many
    if n == 0 or crc32(view) == combined(crcs, len(view)):
        return -1
    for i, crc in enumerate(np.asarray(crcs, np.uint32).tolist()):
        if crc32(view[i * BLOCK : (i + 1) * BLOCK]) != crc:
            return i
    return -1  # every block matches: the bytes changed between the two passes (not a file's fault)
