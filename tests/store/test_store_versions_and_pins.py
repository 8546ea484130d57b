"""Pinned versions survive flushes, compactions and reopen bit for bit; unpinned old versions are
reclaimed; disk use stays near the table's size plus what pinned versions hold."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _store_helpers import assert_snapshot_equal, snapshot

from lightning_embcache import EmbeddingStore, VersionNotFoundError

N, DIM, CHUNK = 4096, 16, 256  # 256 KiB table, 16 chunks
ROW_BYTES = DIM * 4
TABLE = N * ROW_BYTES
HOT = 512 * (ROW_BYTES + 11)


def _breakdown(store) -> str:
    """Bytes on disk per kind of file, in tables, and the retained versions: for failure messages."""
    kinds: dict[str, int] = {}
    for p in store.path.rglob("*"):
        if p.is_file():
            kind = "chunks" if p.parent.name == "chunks" else "segments" if p.parent.name == "segments" else p.name.split("-")[0]
            kinds[kind] = kinds.get(kind, 0) + p.stat().st_size
    shares = {k: round(v / TABLE, 2) for k, v in kinds.items() if v > 1024}
    return f"{shares} (in tables), versions {store.versions()}, pinned {store.pinned()}, {store.stats().segments} segments"


def _cycle(store, rng, rows=300):
    ids = torch.from_numpy(rng.integers(0, N, rows))
    store.update(ids, torch.from_numpy(rng.standard_normal((rows, DIM)).astype(np.float32)))
    return store.flush()


def test_pinned_versions_survive_flushes_compactions_and_reopen(shm_path):
    path = shm_path / "store"
    rng = np.random.default_rng(1)
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=HOT, fields={"m": (torch.float32, 2)})
    pinned = {}
    early = []
    for i in range(40):
        v = _cycle(store, rng)
        if i < 3:
            early.append(v)
        if i in (5, 17):
            store.pin(v)
            pinned[v] = snapshot(store)
        if i % 4 == 3:
            store.compact()
    assert store.pinned() == sorted(pinned)
    for v, want in pinned.items():
        assert v in store.versions()
        with EmbeddingStore.open(path, version=v, readonly=True) as r:
            assert r.version == v
            assert_snapshot_equal(snapshot(r), want, f"pinned version {v} beside the writer")
        assert len(store.manifest_checksum(v)) == 8
    # unpinned early versions were reclaimed and say so
    for v in early:
        assert v not in store.versions()
        with pytest.raises(VersionNotFoundError, match=f"version={v}"):
            EmbeddingStore.open(path, version=v, readonly=True)
    latest = snapshot(store)
    store.close()

    with EmbeddingStore.open(path) as s:  # pins are persisted
        assert s.pinned() == sorted(pinned)
        assert_snapshot_equal(snapshot(s), latest, "latest version after reopen")
        for _ in range(10):
            _cycle(s, rng)
        s.compact()
    for v, want in pinned.items():
        with EmbeddingStore.open(path, version=v) as s:  # writable at an old version, too
            assert_snapshot_equal(snapshot(s), want, f"pinned version {v} after reopen")


def test_unpinned_version_is_reclaimed_and_its_bytes_freed(shm_path):
    path = shm_path / "store"
    rng = np.random.default_rng(2)
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=HOT) as s:
        # every row written: the pinned version's chunk files are dense, a whole table (a few
        # random rows would be sparse files holding just those rows)
        _cycle(s, rng, rows=4 * N)
        for _ in range(3):
            _cycle(s, rng)
        s.compact()
        v = s.version
        s.pin(v)
        for i in range(12):
            _cycle(s, rng, rows=1500)  # rewrites most chunks
            s.compact()
        held = s.stats().disk_bytes
        s.unpin(v)
        _cycle(s, rng)
        s.compact()
        assert v not in s.versions()
        freed = held - s.stats().disk_bytes
        assert freed > 0.5 * TABLE, f"unpinning a version whose chunks were all rewritten freed only {freed} B"
    with pytest.raises(VersionNotFoundError):
        EmbeddingStore.open(path, version=v)


@pytest.mark.parametrize("hot_rows", [None, 512], ids=["memory-path", "disk"])
def test_disk_use_after_each_compaction_is_the_table(shm_path, hot_rows):
    """Flushes of up to 5% of the rows (touching every chunk), compact() after each flush:
    measured after each compaction (published at once, garbage collected round by round), disk
    use is the table plus its small files."""
    every = 1
    path = shm_path / "store"
    rng = np.random.default_rng(3)
    hot = None if hot_rows is None else hot_rows * (ROW_BYTES + 11)
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot) as s:
        for i in range(30 * every):
            _cycle(s, rng, rows=int(rng.integers(10, N // 20)))
            if i % every == every - 1:
                s.compact()
                now = s.stats().disk_bytes
                assert now <= 1.05 * TABLE + (64 << 10), (
                    f"after {i + 1} flushes and a compaction disk use is {now} B = {now / TABLE:.2f} x the table: "
                    f"{_breakdown(s)}"
                )


def test_disk_use_with_a_pinned_version_adds_at_most_its_footprint(shm_path):
    path = shm_path / "store"
    rng = np.random.default_rng(4)
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=512 * (ROW_BYTES + 11)) as s:
        for _ in range(6):
            _cycle(s, rng)
        s.compact()
        _cycle(s, rng)
        s.pin(s.version)
        pinned_footprint = s.stats().disk_bytes
        bound = 1.1 * TABLE + pinned_footprint + (64 << 10)
        for i in range(45):
            _cycle(s, rng, rows=int(rng.integers(10, N // 20)))
            if i % 3 == 2:
                s.compact()
                now = s.stats().disk_bytes
                assert now <= bound, (
                    f"with one pinned version ({pinned_footprint} B) disk use is {now} B > {bound}: {_breakdown(s)}"
                )


def _one_segment_store(path):
    """A zero-initialised store with a tenth of its rows in one delta segment (under the
    background compaction's threshold); returns (open store, rows, version)."""
    rows = torch.zeros(N, DIM)
    ids = torch.arange(0, N, 10)
    rows[ids] = torch.randn(len(ids), DIM)
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, init="zeros")
    store.update(ids, rows[ids])
    v1 = store.flush()
    assert store.stats().segments == 1
    return store, rows, v1


def test_compact_publishes_its_layout_under_the_same_version(shm_path):
    """compact() rewrites the version's manifest with the base-chunk layout of the same rows:
    the version number and its identity stay, a flush with nothing new keeps it, and a reopen
    finds no segment to compact again."""
    path = shm_path / "store"
    store, rows, v1 = _one_segment_store(path)
    with store:
        ident = store.manifest_checksum(v1)
        store.compact()
        assert store.stats().segments == 0
        assert store.flush() == v1, "a flush with nothing new moved the version"
        assert store.versions() == [v1] and store.manifest_checksum(v1) == ident
    with EmbeddingStore.open(path) as store:
        assert store.version == v1
        assert store.stats().segments == 0, "reopening found the pre-compaction segments"
        assert torch.equal(store.get(torch.arange(N)), rows)


def test_compaction_beside_a_reader_of_the_version_publishes_a_new_one(shm_path):
    """A read-only handle holds the version it opened: compaction must not replace that
    version's layout under it, so its layout becomes a new version (same rows) and the reader
    keeps reading every row of its own."""
    path = shm_path / "store"
    store, rows, v1 = _one_segment_store(path)
    with store:
        with EmbeddingStore.open(path, readonly=True) as reader:
            store.compact()
            assert store.version > v1 and store.stats().segments == 0
            assert torch.equal(reader.get(torch.arange(N)), rows)
        assert torch.equal(store.get(torch.arange(N)), rows)


def test_garbage_collection_keeps_the_chunks_the_live_layout_reads(shm_path):
    """Disk mode, flushes while writing the whole table, then compact() + flush(): collection runs
    after each compaction and must keep every chunk file the in-memory layout still reads, also
    those of an earlier compaction that no manifest listed yet (found by the store benchmark:
    reopening raised 'the chunk map lists it but it is gone')."""
    path = shm_path / "store"
    n, step = 8 * N, 2048
    rows = torch.randn(n, DIM)
    store = EmbeddingStore.create(path, n, DIM, chunk_rows=CHUNK, hot_bytes=HOT)
    for k, a in enumerate(range(0, n, step)):
        store.update(torch.arange(a, a + step), rows[a : a + step])
        if k % 2 == 1:
            store.flush()
    store.flush()
    store.compact()
    store.flush()
    assert torch.equal(store.get(torch.arange(n)), rows)
    store.close()
    with EmbeddingStore.open(path) as store:
        assert torch.equal(store.get(torch.arange(n)), rows)


def test_a_flush_with_nothing_new_keeps_its_version_after_a_background_compaction(shm_path):
    """Only compact() makes the next flush publish a layout without new rows; a background
    compaction waits for a flush that has rows to write, so flush() with nothing new stays a no-op."""
    import time

    path = shm_path / "store"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK) as store:
        store.update(torch.arange(N), torch.randn(N, DIM))  # the whole table: > 25% in one segment
        v = store.flush()
        deadline = time.monotonic() + 20
        while store.stats().compactions < 1:
            assert time.monotonic() < deadline, "no background compaction started"
            time.sleep(0.01)
        assert store.flush() == v


def test_segments_written_after_a_reopen_are_never_taken_for_folded(shm_path):
    """Chunk maps record the newest segment folded into each chunk; after compaction deleted
    every segment file, a reopened store must still number new segments past those records
    (numbering them from the files left made a new segment look folded, and compaction dropped
    its rows)."""
    path = shm_path / "store"
    model = torch.randn(N, DIM)
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK) as store:
        store.update(torch.arange(N), model)
        store.flush()
        store.compact()
        assert not list((path / "segments").iterdir())
    for i in range(3):
        with EmbeddingStore.open(path) as store:
            ids = torch.arange(i, N, 7)
            model[ids] = float(i)
            store.update(ids, model[ids])
            store.flush()
            store.compact()
            assert torch.equal(store.get(torch.arange(N)), model)
    with EmbeddingStore.open(path) as store:
        assert torch.equal(store.get(torch.arange(N)), model)


def test_compaction_makes_its_chunks_durable_without_syncfs(shm_path, monkeypatch):
    """Where the file system cannot be synced at once (not Linux), a round syncs each chunk file
    it wrote before its manifest names them."""
    from lightning_embcache.store import fileio

    monkeypatch.setattr(fileio, "_SYNCFS", None)
    # The fsyncs counted are this process's: the store folds here, not in a compaction process
    # (whose rounds sync by the same Disk.sync_chunks; a suite may run with the process forced).
    monkeypatch.setenv("EMBCACHE_COMPACTION_PROCESS", "never")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    path = shm_path / "store"
    model = torch.randn(N, DIM)
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK) as store:
        store.update(torch.arange(N), model)
        store.flush()
        store._wait_bg()
        store.update(torch.arange(0, N, 9), model[::9] + 1)
        model[::9] += 1
        store.flush()
        synced.clear()
        store.compact()
        assert len(synced) >= N // CHUNK, f"{len(synced)} fsyncs for {N // CHUNK} chunk files"
    with EmbeddingStore.open(path) as store:
        assert torch.equal(store.get(torch.arange(N)), model)


@pytest.mark.parametrize("init", ["normal", "callable"])
def test_compaction_keeps_never_written_rows_at_their_initial_values(shm_path, init):
    """Compaction computes the initial values of a never-written chunk only for the rows no
    segment holds: every other row must read as in a store where nothing was compacted."""
    kw = {"init": "normal", "init_std": 0.5, "seed": 7} if init == "normal" else \
        {"init": lambda ids: ids[:, None].float().expand(-1, DIM) * 0.25}
    fields = {"m": (torch.float32, 2)}
    ids = torch.tensor([3, 4, 70, CHUNK + 1, 5 * CHUNK - 1])
    with EmbeddingStore.create(shm_path / "ref", N, DIM, chunk_rows=CHUNK, fields=fields, **kw) as ref:
        want = ref.get(torch.arange(N))
        want_m = ref.get_fields(torch.arange(N), ["m"])["m"]
    with EmbeddingStore.create(shm_path / "s", N, DIM, chunk_rows=CHUNK, fields=fields, **kw) as s:
        s.update(ids, torch.full((len(ids), DIM), 9.0))
        s.flush()
        s.compact()
        assert s.stats().segments == 0
        want[ids] = 9.0
        assert torch.equal(s.get(torch.arange(N)), want)
        assert torch.equal(s.get_fields(torch.arange(N), ["m"])["m"], want_m)


def test_a_round_folds_the_oldest_segments_chunks_before_a_newer_segments(shm_path):
    """Compaction drops a segment once every chunk it touches has folded it. A round that takes
    a newer segment's chunks with more delta rows over the oldest segment's last ones leaves the
    oldest on disk for another whole pass over the newer one (disk use and flush backpressure
    follow): the oldest segment's chunks go first."""
    from lightning_embcache.store import compaction

    n, chunk = 64 * 16, 16  # 64 chunks; a round rewrites 1/16 of the table: 4 chunks
    assert compaction.ROUND_SHARE == 1 / 16
    path = shm_path / "store"
    with EmbeddingStore.create(path, n, 64, chunk_rows=chunk) as store:  # segments < 25%: no background round
        model = store.get(torch.arange(n)).clone()
        first = torch.arange(0, 62 * chunk, chunk)  # one row in each of chunks 0..61
        model[first] = 1.0
        store.update(first, model[first])
        store.flush()
        index = store._versions.rows
        with store._versions.flush_lock:
            for _ in range(15):  # 60 of its 62 chunks folded
                assert store._versions.compaction.compact_round()
        assert store.stats().segments == 1
        assert store._versions.rows is index, "rounds that dropped no segment rebuilt the row index"
        # The newer segment: two rows in each of chunks 0..59 and 62..63, one in chunks 60..61.
        second = torch.cat([torch.arange(c * chunk + 1, c * chunk + (3 if c < 60 or c > 61 else 2))
                            for c in range(64)])
        model[second] = 2.0
        store.update(second, model[second])
        store.flush()
        assert store.stats().segments == 2
        with store._versions.flush_lock:
            assert store._versions.compaction.compact_round()
        assert store.stats().segments == 1, _breakdown(store)
        assert torch.equal(store.get(torch.arange(n)), model)
        store.compact()
        assert torch.equal(store.get(torch.arange(n)), model)
