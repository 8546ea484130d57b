"""A chunk's 4 KiB block checksums checked in one pass: the same verdict as checking each block
with zlib, and the bad block named."""

from __future__ import annotations

import array
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_embcache.store import fileio
from lightning_embcache.store.blockcrc import BLOCK, combined, first_bad_block


def _block_crcs(data: bytes) -> np.ndarray:  # the reference: zlib, block by block
    return np.array([zlib.crc32(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)], np.uint32)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12 * BLOCK + 7), st.data())
def test_one_pass_agrees_with_zlib_block_by_block(n, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    crcs = _block_crcs(raw)
    assert combined(crcs, n) == zlib.crc32(raw)
    assert combined(array.array("I", crcs.tobytes()), n) == zlib.crc32(raw)  # as ChunkRows keeps them
    assert first_bad_block(raw, crcs) == -1
    damaged = bytearray(raw)
    flips = sorted(set(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4))))
    for i in flips:
        damaged[i] ^= data.draw(st.integers(1, 255))
    bad = [k for k, c in enumerate(_block_crcs(bytes(damaged))) if c != crcs[k]]
    assert first_bad_block(damaged, crcs) == (bad[0] if bad else -1)


def test_a_missing_or_extra_checksum_is_a_bad_block():
    raw = bytes(range(256)) * 40  # 10,240 bytes: 3 blocks
    crcs = _block_crcs(raw)
    assert first_bad_block(raw, crcs[:2]) == 2
    assert first_bad_block(raw, np.r_[crcs, crcs[:1]]) == 3
    assert first_bad_block(b"", crcs[:0]) == -1


def test_the_store_checksum_is_zlibs_crc32():
    """Files written with one implementation are read with the other: the values must agree."""
    raw = np.random.default_rng(1).integers(0, 256, 3 * BLOCK + 11, dtype=np.uint8).tobytes()
    assert fileio.crc32(raw) == zlib.crc32(raw)
    assert fileio.crc32(memoryview(raw)[5:900]) == zlib.crc32(raw[5:900])


@pytest.mark.parametrize("n", [128 * BLOCK, 127 * BLOCK + 1, 300 * BLOCK - 5])
def test_chunk_sized_runs_agree_with_zlib(n):
    """The sizes of real chunks (512 KiB and beyond): the tables are built by doubling, so runs
    past a power of two of blocks take other paths than the short ones above."""
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert combined(_block_crcs(raw), n) == zlib.crc32(raw)
