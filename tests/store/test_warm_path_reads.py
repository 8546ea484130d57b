"""The warm miss path: batched reads through io_uring (or the preadv fallback) return exactly the
bytes of the files, and the lookahead window never reads a row twice nor changes a value."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import numpy as np
import pytest
import torch
from _store_helpers import compacted_store
from fastpaths import missing

from lightning_embcache import EmbeddingStore, LookaheadSampler
from lightning_embcache.store import uring
from lightning_embcache.store.chunkrows import ChunkRows

N, DIM, CHUNK = 6000, 16, 128
ROW = DIM * 4
SLOTS = 600
HOT = SLOTS * (ROW + 11)


@pytest.fixture(params=["io_uring", "preadv"])
def read_path(request, monkeypatch):
    if request.param == "preadv":
        monkeypatch.setattr(uring, "_disabled", True)
    elif not uring.available():
        missing("io_uring")
    return request.param


def _files(tmp_path, count=5, size=50_000):
    rng = np.random.default_rng(0)
    blobs, fds = [], []
    for i in range(count):
        blob = rng.integers(0, 256, size, dtype=np.uint8)
        p = tmp_path / f"f{i}"
        p.write_bytes(blob.tobytes())
        blobs.append(blob)
        fds.append(os.open(p, os.O_RDONLY))
    return blobs, np.asarray(fds, np.int64)


def _requests(blobs, fds, n, rng, max_len=700):
    which = rng.integers(0, len(fds), n)
    lens = rng.integers(1, max_len, n).astype(np.int64)
    offs = np.asarray([rng.integers(0, len(blobs[w]) - k) for w, k in zip(which, lens)], np.int64)
    dst = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    want = np.concatenate([blobs[w][o : o + k] for w, o, k in zip(which, offs, lens)])
    return fds[which], lens, offs, dst, want


@pytest.mark.parametrize("n", [1, 2, 37, uring.ENTRIES + 300])
def test_batched_reads_return_exactly_the_file_bytes(tmp_path, read_path, n):
    blobs, fds = _files(tmp_path)
    try:
        f, lens, offs, dst, want = _requests(blobs, fds, n, np.random.default_rng(n))
        out = np.full(int(lens.sum()), 7, np.uint8)
        got = uring.read_into(out, dst, f, lens, offs)
        assert np.array_equal(got, lens)
        assert np.array_equal(out, want)
    finally:
        for fd in fds.tolist():
            os.close(fd)


def test_a_read_past_the_end_of_a_file_comes_back_short(tmp_path, read_path):
    blobs, fds = _files(tmp_path, count=2, size=1000)
    try:
        out = np.zeros(600, np.uint8)
        got = uring.read_into(out, np.array([0, 300]), fds, np.array([300, 300]), np.array([0, 900]))
        assert got.tolist() == [300, 100]
        assert np.array_equal(out[:300], blobs[0][:300]) and np.array_equal(out[300:400], blobs[1][900:])
    finally:
        for fd in fds.tolist():
            os.close(fd)


def test_threads_read_at_once_each_through_its_own_ring(tmp_path, read_path):
    blobs, fds = _files(tmp_path)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                f, lens, offs, dst, want = _requests(blobs, fds, 200, rng)
                out = np.empty(int(lens.sum()), np.uint8)
                uring.read_into(out, dst, f, lens, offs)
                assert np.array_equal(out, want)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in fds.tolist():
        os.close(fd)
    assert not errors, errors


def _child_reads(path, q):
    fd = os.open(path, os.O_RDONLY)
    out = np.empty(64, np.uint8)
    uring.read_into(out, np.array([0, 32]), np.array([fd, fd]), np.array([32, 32]), np.array([100, 5000]))
    q.put(out.tobytes())


def test_a_forked_child_reads_through_a_ring_of_its_own(tmp_path, read_path):
    blobs, fds = _files(tmp_path, count=1)
    out = np.empty(10, np.uint8)
    uring.read_into(out, np.array([0, 5]), np.array([fds[0], fds[0]]), np.array([5, 5]), np.array([0, 10]))  # parent's ring
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads, args=(tmp_path / "f0", q))
    p.start()
    got = q.get(timeout=30)
    p.join(30)
    os.close(int(fds[0]))
    assert p.exitcode == 0
    assert got == blobs[0][100:132].tobytes() + blobs[0][5000:5032].tobytes()


def _populated(path):
    return compacted_store(path, N, DIM, CHUNK)


def test_epochs_through_either_read_path_match_the_model(shm_path, read_path):
    """get + update over a table 10x the hot tier, with and without lookahead, flushes between:
    every read equals a tensor model, and so does the whole table after a reopen."""
    model = _populated(shm_path / "s").clone()
    rng = np.random.default_rng(5)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        for epoch in range(2):
            perm = rng.permutation(N)
            batches = [perm[i : i + 100].tolist() for i in range(0, N, 100)]
            order = LookaheadSampler(batches, s, lookahead=4) if epoch else batches
            for k, b in enumerate(order):
                ids = torch.tensor(b)
                assert torch.equal(s.get(ids), model[ids])
                v = model[ids] * 0.5 + 1
                s.update(ids, v)
                model[ids] = v
                if k % 17 == 16:
                    s.flush()
        s.flush()
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        assert torch.equal(s.get(torch.arange(N)), model)


def test_with_lookahead_no_row_is_read_from_disk_twice(shm_path, monkeypatch):
    """The prefetch thread and the training thread never both read the same row: a get waits for
    rows a prefetch is reading, and a prefetch skips rows a get read. Counted at the one place
    every base-chunk read passes."""
    _populated(shm_path / "s")
    reads = []
    real = uring.read_into

    def counting(out, dst, fds, lens, offs, counts=None):  # keyed by file name and offset
        reads.extend((os.path.basename(os.readlink(f"/proc/self/fd/{f}")), o) for f, o in zip(fds.tolist(), offs.tolist()))
        return real(out, dst, fds, lens, offs, counts)

    monkeypatch.setattr(uring, "read_into", counting)
    real_mapped = ChunkRows._gather_mapped

    def counting_mapped(self, out, rows, chunks, local, gens, base, *a):  # rows gathered through maps
        reads.extend((f"c{c:08d}-g{g:08d}", o) for c, g, o in
                     zip(chunks[rows].tolist(), gens[rows].tolist(), (base[rows] + local[rows] * self.rb).tolist()))
        return real_mapped(self, out, rows, chunks, local, gens, base, *a)

    monkeypatch.setattr(ChunkRows, "_gather_mapped", counting_mapped)
    perm = np.random.default_rng(2).permutation(N)[:3000]
    batches = [perm[i : i + 100].tolist() for i in range(0, len(perm), 100)]
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT * 10) as s:  # no eviction: any repeat is a second read
        s.get(torch.arange(N))  # every block verified once: later misses are plain row reads
        s.evict(1 << 30)
        reads.clear()
        for b in LookaheadSampler(batches, s, lookahead=3):
            ids = torch.tensor(b)
            s.update(ids, s.get(ids) + 1)
        st = s.stats()
    assert len(set(reads)) == len(reads), "a row was read twice"
    assert len(reads) <= len(perm)
    assert st.prefetch_hits + st.prefetch_misses == len(perm)


def test_chunk_files_closed_by_the_descriptor_bound_reopen_without_rereading(shm_path, monkeypatch):
    """A table of more chunk files than the open-file bound: every read stays right, and a file
    closed by the bound and wanted again is reopened with its header and checksums as first read
    (the directory of each (chunk, generation) is read once per handle)."""
    from lightning_embcache.store import chunkrows
    from lightning_embcache.store.disk import Disk

    table = _populated(shm_path / "s")
    dirs = []
    real = Disk._raw_chunk_directory

    def counting(self, path, chunk, **kw):
        dirs.append(chunk)
        return real(self, path, chunk, **kw)

    monkeypatch.setattr(Disk, "_raw_chunk_directory", counting)
    monkeypatch.setattr(chunkrows, "_max_files", lambda: 8)
    rng = np.random.default_rng(3)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        assert chunkrows._chunk_name(3, 7) == s._versions.disk.chunk_path(3, 7).name
        for _ in range(30):
            ids = torch.from_numpy(rng.choice(N, 200, replace=False))
            assert torch.equal(s.get(ids), table[ids])
            s.evict(1 << 30)
        reader = s._versions.chunkrows
        assert reader is not None and len(reader._order) <= reader.max_files + len(np.unique(ids.numpy() // CHUNK))
        gens = s._versions.cmap
    assert sorted(dirs) == sorted(set(dirs)), "a chunk file's directory was read again on reopening"
    assert len(set(dirs)) == len(np.unique(np.flatnonzero(gens)))


def _wait(cond, timeout=60.0):
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "background load did not finish"
        time.sleep(0.01)


@pytest.mark.parametrize("cached", [True, False])
def test_hints_are_read_by_the_next_miss_while_the_page_cache_serves_reads(shm_path, cached):
    """Reads served by the page cache: announced rows wait for the next get that misses and come
    up with its rows in one batch (no prefetch thread). Reads that wait for the disk: a prefetch
    thread loads them at once. Either way the announced rows are hot when their get comes. (A
    store that has not read enough yet to tell loads them in the background: see
    test_disk_lookahead.)"""
    table = _populated(shm_path / "s")
    rng = np.random.default_rng(4)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=4 * HOT) as s:  # a miss takes up to 1/4 of the slots ahead
        s._versions.chunkrows_reader().cache_counts[:] = [1000, 0 if cached else 1000]  # reads so far: all cached, or none
        coming = torch.from_numpy(rng.choice(N, 200, replace=False))
        s.upcoming(coming)
        if cached:
            import time

            time.sleep(0.2)
            assert s.stats().prefetched_rows == 0 and s._tiers.prefetch.executor is None
            others = torch.from_numpy(np.setdiff1d(rng.choice(N, 50, replace=False), coming.numpy()))
            assert torch.equal(s.get(others), table[others])  # a miss: takes the hint along
        _wait(lambda: s.stats().prefetched_rows >= 200)
        before = s.stats()
        assert torch.equal(s.get(coming), table[coming])
        after = s.stats()
        assert after.hot_misses == before.hot_misses
        assert after.prefetch_hits - before.prefetch_hits == 200


def test_a_kernel_whose_io_uring_cannot_read_falls_back_to_preadv(tmp_path, monkeypatch):
    """Linux 5.1-5.5 have io_uring but not its read operation: the ring's probe fails there (here
    the probe's system call is made to fail), and every read goes through preadv instead."""
    monkeypatch.setattr(uring, "_disabled", False)
    monkeypatch.setattr(uring, "_local", threading.local())
    monkeypatch.setattr(uring, "_SYS_REGISTER", 1 << 20)  # no such system call: ENOSYS, as a refused probe
    blob = np.arange(8192, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(blob.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros(64, np.uint8)
        got = uring.read_into(out, np.array([0, 32]), np.array([fd, fd]), np.array([32, 32]), np.array([100, 5000]))
    finally:
        os.close(fd)
    assert not uring.available() and list(got) == [32, 32]
    assert out.tobytes() == blob[100:132].tobytes() + blob[5000:5032].tobytes()
