"""Disk mode's miss path: one index over all delta segments, batched reads through long-lived
descriptors, adjacent rows merged, per-row initial values; every value checked against a model."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_embcache import CorruptStoreError, EmbeddingStore
from lightning_embcache.store import chunkrows, initrows, uring
from lightning_embcache.store.rowindex import RowIndex

N, DIM, CHUNK = 8192, 16, 256
ROW = DIM * 4
HOT_ROWS = 300
HOT = HOT_ROWS * (ROW + 11)


class _Seg:
    _next = 0

    def __init__(self, ids):
        self.ids = np.asarray(ids, np.int64)
        _Seg._next += 1
        self.seq = _Seg._next  # segments are numbered in the order they are written


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(0, 300), max_size=80), min_size=1, max_size=12),
       st.integers(0, 300), st.integers(0, 300))
def test_row_index_finds_the_newest_record_like_a_dict(segments, lo, width):
    """RowIndex answers 'which segment and position holds the newest record of id i' exactly as
    a dict filled segment by segment (newest last), whether built at once or added one by one,
    with or without its bitmap of the ids indexed."""
    model = {}
    for k, ids in enumerate(segments):
        for p, i in enumerate(sorted(ids)):
            model[i] = (k, p)
    built = RowIndex([_Seg(sorted(s)) for s in segments])
    built_bits = RowIndex([_Seg(sorted(s)) for s in segments], num_rows=302)
    added, added_bits = RowIndex(), RowIndex(num_rows=302)
    for s in segments:
        added.add(_Seg(sorted(s)))
        added_bits.add(_Seg(sorted(s)))
    probe = np.arange(0, 302, dtype=np.int64)
    for index in (built, added, built_bits, added_bits):
        seg, pos = index.find(probe)
        got = {int(i): (int(s), int(p)) for i, s, p in zip(probe, seg, pos) if s >= 0}
        assert got == model
        ids, seg, pos = index.in_range(lo, lo + width)
        assert {int(i): (int(s), int(p)) for i, s, p in zip(ids, seg, pos)} == \
            {i: v for i, v in model.items() if lo <= i < lo + width}


def test_row_index_merges_its_recent_run_into_the_main_one():
    """Many small segments (write-backs) end up in the main run: the structure stays two runs."""
    index = RowIndex()
    rng = np.random.default_rng(0)
    model = {}
    for k in range(200):
        ids = np.unique(rng.integers(0, 50_000, 100))
        index.add(_Seg(ids))
        model.update({int(i): (k, p) for p, i in enumerate(ids)})
    assert len(index._main[0]) > len(index._recent[0])
    keys = np.array(sorted(model), np.int64)
    seg, pos = index.find(keys)
    assert [(int(s), int(p)) for s, p in zip(seg, pos)] == [model[int(k)] for k in keys]


def test_row_index_bitmap_skips_the_search_for_ids_never_indexed(monkeypatch):
    """Ids with no delta record are answered from the bitmap: the binary search sees only the
    ids that have one (a batch of never-written rows searches nothing)."""
    index = RowIndex(num_rows=10_000)
    index.add(_Seg(np.arange(0, 10_000, 10)))
    searched = []
    real = RowIndex._find_in
    monkeypatch.setattr(RowIndex, "_find_in", staticmethod(
        lambda run, ids, seg, pos: (searched.append(len(ids)), real(run, ids, seg, pos))))
    seg, _ = index.find(np.arange(1, 10_000, 10))  # none indexed
    assert (seg == -1).all() and searched == []
    probe = np.arange(0, 100, dtype=np.int64)
    seg, pos = index.find(probe)
    assert searched == [10, 10]  # main and recent run, the 10 indexed ids only
    assert (seg >= 0).tolist() == (probe % 10 == 0).tolist() and pos[probe % 10 == 0].tolist() == list(range(10))


def _layered_store(path, compression=None, init="zeros"):
    """A store whose rows live in base chunks, under many delta segments, partly never written."""
    model = torch.zeros(N, DIM)
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, compression=compression, init=init)
    half = torch.arange(0, N // 2)
    vals = torch.randint(0, 5, (len(half), DIM)).float() if compression else torch.randn(len(half), DIM)
    s.update(half, vals)
    model[half] = vals
    s.flush()
    s.compact()
    s.flush()
    rng = np.random.default_rng(1)
    for _ in range(12):  # delta segments over the base and over never-written rows
        ids = torch.from_numpy(np.unique(rng.integers(0, N, 120)))
        v = torch.randn(len(ids), DIM)
        s.update(ids, v)
        model[ids] = v
        s.flush()
    written = torch.zeros(N, dtype=torch.bool)
    written[half] = True
    for seg in s._versions.committed:
        written[torch.from_numpy(seg.ids)] = True
    s.close()
    return model, written


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_random_misses_over_base_deltas_and_unwritten_rows_match_the_model(shm_path, compression):
    model, _ = _layered_store(shm_path / "s", compression)
    rng = np.random.default_rng(2)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        assert s.stats().segments >= 10
        for _ in range(40):
            ids = torch.from_numpy(rng.integers(0, N, 257))
            assert torch.equal(s.get(ids), model[ids])
            v = torch.randn(len(ids), DIM)
            s.update(ids, v)
            model.numpy()[ids.numpy()] = v.numpy()  # numpy assigns in order: the last duplicate wins, as in the store
        s.flush()
        assert torch.equal(s.get(torch.arange(N)), model)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        ids = torch.from_numpy(rng.permutation(N)[:3000])
        assert torch.equal(s.get(ids), model[ids])


def test_a_miss_batch_looks_up_the_delta_segments_once(shm_path, monkeypatch):
    """One index lookup per batch, however many segments: no per-segment search per call."""
    model, _ = _layered_store(shm_path / "s")
    calls = []
    original = RowIndex.find

    def counting(self, ids):
        calls.append(len(ids))
        return original(self, ids)

    monkeypatch.setattr(RowIndex, "find", counting)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        ids = torch.from_numpy(np.random.default_rng(3).choice(N, 200, replace=False))
        assert torch.equal(s.get(ids), model[ids])
    assert calls == [200]


def test_misses_open_no_file_per_read_and_merge_adjacent_rows(shm_path, monkeypatch):
    """After a chunk file was first read, later misses in it neither open nor close a file, and a
    run of adjacent rows is one read request."""
    monkeypatch.setattr(chunkrows, "MAPPED_READS", False)  # the read-call path (the prefetch thread's); maps: test_mapped_reads.py
    model, _ = _layered_store(shm_path / "s")
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        run = torch.arange(CHUNK + 10, CHUNK + 74)  # 64 adjacent base rows with no delta...
        run = run[~torch.isin(run, torch.from_numpy(np.concatenate([g.ids for g in s._versions.committed])))]
        assert len(run) > 40
        assert torch.equal(s.get(run), model[run])  # first read: opens, verifies the blocks
        s.evict(1 << 30)
        opens, preads = [], []
        real_open, real_read_into = os.open, uring.read_into
        monkeypatch.setattr(os, "open", lambda *a, **k: opens.append(a[0]) or real_open(*a, **k))
        # every read request of the batch (io_uring or preadv alike) passes through read_into
        monkeypatch.setattr(uring, "read_into", lambda out, dst, fds, *a: preads.extend(fds) or real_read_into(out, dst, fds, *a))
        assert torch.equal(s.get(run), model[run])
        runs = 1 + int((run[1:] != run[:-1] + 1).sum())
    assert opens == [], f"opened {opens} on a repeated miss"
    assert len(preads) == runs, f"{len(preads)} reads for {runs} runs of adjacent rows"


def _open_chunk_files(root) -> int:
    chunks = str(root / "chunks")
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(chunks)
        except OSError:
            pass
    return n


def test_open_chunk_files_stay_bounded(shm_path, monkeypatch):
    """Descriptors of chunk files are kept, but at most max(bound, chunks of one batch)."""
    monkeypatch.setattr(chunkrows, "_max_files", lambda: 8)
    model, _ = _layered_store(shm_path / "s")
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        rng = np.random.default_rng(4)
        peak = 0
        for _ in range(30):  # each batch: rows of 4 of the 16 base chunks
            chunks = rng.choice(N // 2 // CHUNK, 4, replace=False)
            ids = torch.from_numpy((chunks[:, None] * CHUNK + rng.integers(0, CHUNK, (4, 20))).reshape(-1))
            assert torch.equal(s.get(ids), model[ids])
            peak = max(peak, _open_chunk_files(shm_path / "s"))
        assert 4 <= peak <= 8 + 4
    assert _open_chunk_files(shm_path / "s") == 0, "close() left chunk files open"


def test_a_truncated_chunk_file_is_a_named_corruption(shm_path):
    _layered_store(shm_path / "s")
    f = sorted((shm_path / "s" / "chunks").glob("c00000003-*"))[-1]
    f.write_bytes(f.read_bytes()[:-3000])
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        with pytest.raises(CorruptStoreError) as info:
            s.get(torch.tensor([3 * CHUNK + 1]))
        assert f.name in str(info.value)


def test_normal_init_is_per_row_and_deterministic(shm_path, monkeypatch):
    """A never-written row's initial value depends only on (seed, id): the same whichever rows
    are read with it, in memory and disk mode, and a miss of one row computes one row."""
    sizes = []
    original = initrows.normal_rows

    def counting(ids, *a, **kw):
        sizes.append(len(ids))
        return original(ids, *a, **kw)

    with EmbeddingStore.create(shm_path / "a", N, DIM, chunk_rows=CHUNK, init="normal", seed=7, init_std=0.5,
                               hot_bytes=HOT) as s:
        monkeypatch.setattr("lightning_embcache.store.core.normal_rows", counting)
        one = s.get(torch.tensor([1234]))
        assert sizes == [1], f"a miss of one row computed {sizes} rows"
        many = s.get(torch.tensor([5, 1234, 4000]))
    with EmbeddingStore.create(None, N, DIM, chunk_rows=CHUNK, init="normal", seed=7, init_std=0.5) as m:
        table = m.get(torch.arange(N))
    assert torch.equal(one[0], many[1]) and torch.equal(one[0], table[1234])
    assert torch.equal(many, table[[5, 1234, 4000]])
    assert abs(float(table.mean())) < 0.01 and abs(float(table.std()) - 0.5) < 0.01
    with EmbeddingStore.create(None, N, DIM, chunk_rows=CHUNK, init="normal", seed=8, init_std=0.5) as other:
        assert not torch.equal(other.get(torch.arange(N)), table)


def test_stores_created_with_per_chunk_init_keep_their_initial_values(shm_path):
    """A store whose META predates per-row init still reads its never-written rows from the
    per-chunk generator it was created with."""
    from lightning_embcache.store.disk import Disk

    path = shm_path / "old"
    EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, init="normal", seed=3).close()
    meta = Disk.read_meta(path)
    del meta["init_version"]
    (path / "META").unlink()
    Disk.write_meta(path, meta)
    chunk = 5
    g = torch.Generator().manual_seed(3 * 1_000_003 + chunk)
    expect = torch.randn(CHUNK, DIM, generator=g)
    with EmbeddingStore.open(path, hot_bytes=HOT) as s:
        ids = torch.tensor([chunk * CHUNK + 3, chunk * CHUNK + 200])
        assert torch.equal(s.get(ids), expect[[3, 200]])
    with EmbeddingStore.open(path) as s:
        assert torch.equal(s.get(torch.arange(chunk * CHUNK, (chunk + 1) * CHUNK)), expect)


def _record_preadv(monkeypatch) -> list:
    """(bytes, flags) of every os.preadv from here on (the store's whole-chunk reads use it)."""
    reads: list = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off, flags=0: reads.append((sum(len(b) for b in bufs), flags))
                        or real(fd, bufs, off, flags))
    return reads


def test_a_call_wanting_many_blocks_of_a_chunk_reads_it_whole_and_verified(shm_path, monkeypatch):
    """First reads of at least 1/8 of a chunk's 4 KiB blocks (an epoch in ChunkShuffleSampler
    order) read the chunk in one sequential read, from the disk if need be, and check every
    block; a single row reads its block only; a damaged block is still a named corruption."""
    monkeypatch.setattr(chunkrows, "MAPPED_READS", False)  # the read-call path (the prefetch thread's); maps: test_mapped_reads.py
    from _store_helpers import compacted_store

    n, dim, chunk = 4096, 128, 256  # 512-byte rows: 32 blocks per chunk
    table = compacted_store(shm_path / "s", n, dim, chunk)
    whole = chunk * dim * 4
    reads = _record_preadv(monkeypatch)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=64 * (dim * 4 + 11)) as s:
        ids = torch.arange(2 * chunk, 3 * chunk, 32)  # 8 rows in 8 different blocks of chunk 2
        assert torch.equal(s.get(ids), table[ids])
        assert (whole, 0) in reads, reads
        reads.clear()
        one = torch.tensor([5 * chunk + 7])
        assert torch.equal(s.get(one), table[one])
        assert all(size < whole for size, _ in reads), reads
    f = sorted((shm_path / "s" / "chunks").glob("c00000007-*"))[-1]
    raw = bytearray(f.read_bytes())
    raw[-whole + 3 * 4096 + 5] ^= 0xFF  # block 3 of chunk 7's records
    f.write_bytes(bytes(raw))
    with EmbeddingStore.open(shm_path / "s", hot_bytes=64 * (dim * 4 + 11)) as s:
        with pytest.raises(CorruptStoreError) as info:
            s.get(torch.arange(7 * chunk, 8 * chunk, 32))
        assert f.name in str(info.value) and "block 3 of chunk 7" in str(info.value)


def test_a_call_wanting_many_wide_rows_of_a_chunk_reads_it_whole(shm_path, monkeypatch):
    """Wide rows: 1/32 of a chunk's rows in distinct blocks are only 1/16 of its blocks (under the
    1/8 share), yet an epoch in ChunkShuffleSampler order asks that many per call: they read the
    chunk whole too. A few random rows of a chunk still read only their blocks."""
    monkeypatch.setattr(chunkrows, "MAPPED_READS", False)  # the read-call path (the prefetch thread's); maps: test_mapped_reads.py
    from _store_helpers import compacted_store

    n, dim, chunk = 2048, 512, 512  # 2 KiB rows: 256 blocks per chunk
    table = compacted_store(shm_path / "s", n, dim, chunk)
    whole = chunk * dim * 4
    reads = _record_preadv(monkeypatch)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=64 * (dim * 4 + 11)) as s:
        ids = torch.arange(chunk, 2 * chunk, 32)  # 16 rows (1/32) in 16 of the 256 blocks of chunk 1
        assert torch.equal(s.get(ids), table[ids])
        assert (whole, 0) in reads, reads
        reads.clear()
        few = torch.arange(3 * chunk, 4 * chunk, 128)  # 4 rows of chunk 3
        assert torch.equal(s.get(few), table[few])
        assert all(size < whole for size, _ in reads), reads


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 200), st.integers(0, 1000), max_size=60),
       st.dictionaries(st.integers(0, 200), st.integers(0, 1000), max_size=60),
       st.sampled_from([np.int32, np.int64]))
def test_merging_two_runs_keeps_the_newer_entry_like_a_dict(a, b, dtype):
    """The index's run merge: sorted unique ids, and of an id in both runs the second's entry."""
    from lightning_embcache.store.rowindex import _merge

    def run(d):
        ids = np.array(sorted(d), dtype)
        vals = np.array([d[i] for i in sorted(d)], np.int32)
        return ids, vals, vals + 1

    ids, seg, pos = _merge(run(a), run(b))
    want = {**a, **b}
    assert ids.dtype == dtype and ids.tolist() == sorted(want)
    assert seg.tolist() == [want[i] for i in sorted(want)] and pos.tolist() == [want[i] + 1 for i in sorted(want)]


def test_the_index_keeps_ids_in_the_narrowest_type_and_answers_wider_queries():
    """Ids as int32 for tables that fit (12 bytes an entry); int64 queries are cast, not the index."""
    index = RowIndex(num_rows=1000)
    index.add(_Seg([3, 7, 999]))
    assert index._main[0].dtype == np.int32 or index._recent[0].dtype == np.int32
    seg, pos = index.find(np.array([7, 8, 999], np.int64))
    assert seg.tolist() == [0, -1, 0] and pos[[0, 2]].tolist() == [1, 2]
    ids, _, _ = index.in_range(0, 1000)
    assert ids.tolist() == [3, 7, 999]
