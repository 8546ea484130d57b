"""Batched positional reads (store/uring.py) give exactly what one ``os.pread`` per read gives.

Calls of any size, one after another, so the ring's slots wrap around; short reads at a file's end;
a read of a closed descriptor reports its error.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from fastpaths import skip_unless
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache.store import uring

pytestmark = skip_unless(uring.available(), "io_uring")

SIZES = [5000, 70_000, 4096, 123]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("uring")
    rng = np.random.default_rng(1)
    fds, datas = [], []
    for i, n in enumerate(SIZES):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        (root / f"f{i}").write_bytes(data)
        fds.append(os.open(root / f"f{i}", os.O_RDONLY))
        datas.append(data)
    yield fds, datas
    for fd in fds:
        os.close(fd)


reads = st.lists(st.tuples(st.integers(0, len(SIZES) - 1), st.integers(0, 71_000), st.integers(1, 700)),
                 min_size=2, max_size=2500)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(reads, min_size=1, max_size=4))
def test_reads_match_pread(files, calls):
    fds, datas = files
    for batch in calls:
        which = np.array([w for w, _, _ in batch], np.int64)
        offs = np.array([o for _, o, _ in batch], np.int64)
        lens = np.array([n for _, _, n in batch], np.int64)
        dst = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        out = np.zeros(int(lens.sum()), np.uint8)
        got = uring.read_into(out, dst, np.array(fds, np.int32)[which], lens, offs)
        for k, (w, o, n) in enumerate(batch):
            want = datas[w][o : o + n]
            assert got[k] == len(want)
            assert out[dst[k] : dst[k] + len(want)].tobytes() == want


def test_a_read_of_a_closed_descriptor_raises(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"abc" * 100)
    fd = os.open(p, os.O_RDONLY)
    os.close(fd)
    out = np.zeros(10, np.uint8)
    with pytest.raises(OSError):
        uring.read_into(out, np.array([0, 5]), np.array([fd, fd], np.int32), np.array([5, 5]), np.array([0, 5]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(reads, min_size=1, max_size=4), skip=st.integers(0, 1023))
def test_the_ring_completes_every_request_of_a_call(files, calls, skip):
    """One ring call (no retry behind it) answers each request exactly, wherever in the ring the
    call's slots begin and however they wrap."""
    fds, datas = files
    ring = uring._ring()
    scratch = np.zeros(skip + 1, np.uint8)  # move the ring's tail to any slot first
    ring.read(np.full(skip + 1, fds[0], np.int32), np.full(skip + 1, scratch.ctypes.data, np.uint64),
              np.ones(skip + 1, np.uint32), np.zeros(skip + 1, np.uint64))
    for batch in calls:
        which = np.array([w for w, _, _ in batch], np.int64)
        offs = np.array([o for _, o, _ in batch], np.uint64)
        lens = np.array([n for _, _, n in batch], np.uint32)
        dst = np.concatenate([[0], np.cumsum(lens.astype(np.int64))[:-1]]).astype(np.uint64)
        out = np.zeros(int(lens.sum()), np.uint8)
        res = ring.read(np.array(fds, np.int32)[which], out.ctypes.data + dst, lens, offs)
        want = [len(datas[w][o : o + n]) for w, o, n in batch]
        assert res.tolist() == want
        for k, (w, o, n) in enumerate(batch):
            assert out[int(dst[k]) : int(dst[k]) + want[k]].tobytes() == datas[w][o : o + n]
