"""Kept versions share the chunk files: disk use is the table plus the rows changed per kept
version, not a table per kept version; each kept version still reads exactly its rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore

N, DIM, CHUNK = 8192, 32, 256  # 1 MiB table, 32 chunks
ROW_BYTES = DIM * 4
TABLE = N * ROW_BYTES
SMALL_FILES = 64 << 10  # META, manifests, chunk maps, PINS, headers of chunk files and segments
ALL = torch.arange(N)


def _disk_bytes(path: Path) -> int:
    """The sum of the sizes of every file in the store's folder."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _written_table(path: Path, rng: np.random.Generator) -> EmbeddingStore:
    """A disk-mode store whose every row lives in base chunk files."""
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=N // 4 * (ROW_BYTES + 11))
    store.update(ALL, torch.from_numpy(rng.standard_normal((N, DIM)).astype(np.float32)))
    store.flush()
    store.compact()
    return store


def _scatter(store: EmbeddingStore, rng: np.random.Generator, rows: int) -> int:
    """Update ``rows`` distinct rows spread over every chunk and flush; returns the new version."""
    ids = torch.from_numpy(rng.choice(N, rows, replace=False))
    store.update(ids, torch.from_numpy(rng.standard_normal((rows, DIM)).astype(np.float32)))
    return store.flush()


def test_pinned_versions_share_chunk_files_after_compaction(shm_path):
    """Six pinned versions, 5% of the rows changed before each (three flushes), compaction run to
    completion after each pin: the store holds the table plus the changed rows, where a table
    per pinned version was kept before; every pinned version reads its rows bit for bit."""
    path = shm_path / "store"
    rng = np.random.default_rng(7)
    store = _written_table(path, rng)
    kept: dict[int, torch.Tensor] = {}
    changed = 0
    with store:
        for _ in range(6):
            for _ in range(3):
                v = _scatter(store, rng, N // 60)
                changed += (N // 60) * ROW_BYTES
            store.pin(v)
            kept[v] = store.get(ALL).clone()
            store.compact()
            for w, want in kept.items():
                with EmbeddingStore.open(path, version=w, readonly=True) as r:
                    assert torch.equal(r.get(ALL), want), f"pinned version {w} changed after a compaction"
    held = _disk_bytes(path)
    bound = 1.1 * TABLE + 1.2 * changed + SMALL_FILES
    assert held <= bound, (f"{len(kept)} pinned versions with {changed / TABLE:.2f} tables of rows changed hold "
                           f"{held / TABLE:.2f} tables on disk (bound {bound / TABLE:.2f})")
    for w, want in kept.items():
        with EmbeddingStore.open(path, version=w, readonly=True) as r:
            assert torch.equal(r.get(ALL), want), f"pinned version {w} after close"
    with EmbeddingStore.open(path) as s:  # a writable reopen keeps them too
        assert s.pinned() == sorted(kept)
        s.compact()
        assert torch.equal(s.get(ALL), kept[max(kept)])
    for w, want in kept.items():
        with EmbeddingStore.open(path, version=w) as s:
            assert torch.equal(s.get(ALL), want), f"pinned version {w} opened writable"


def test_a_pinned_version_keeps_its_identity_when_it_shares_new_chunk_files(shm_path):
    """A pinned version published again with the new chunk files keeps its number and its
    identity (the checksum a checkpoint recorded), and its rows."""
    path = shm_path / "store"
    rng = np.random.default_rng(8)
    with _written_table(path, rng) as store:
        v = _scatter(store, rng, N // 20)
        store.pin(v)
        ident, want = store.manifest_checksum(v), store.get(ALL).clone()
        gen = store._versions.disk.read_manifest(v).chunkmap
        _scatter(store, rng, N // 20)
        store.compact()
        m = store._versions.disk.read_manifest(v)
        assert m.chunkmap != gen and m.segments == [], "the pinned version does not read the folded chunk files"
        assert store.manifest_checksum(v) == ident
        with EmbeddingStore.open(path, version=v, readonly=True) as r:
            assert torch.equal(r.get(ALL), want)


def test_segments_held_for_kept_versions_start_no_compaction(shm_path):
    """Segments newer than a pinned version that shares the chunk files are not folded; the
    compaction thresholds leave them out, so flushes neither start passes that fold nothing nor
    wait for them."""
    path = shm_path / "store"
    rng = np.random.default_rng(9)
    with _written_table(path, rng) as store:
        store.pin(_scatter(store, rng, 16))
        for _ in range(12):  # 12 x 5% of the rows: past the 40% a flush would fold itself
            _scatter(store, rng, N // 20)
        store._wait_bg()
        assert store.stats().segments == 13  # the pinned version's own and the 12 flushed since
        assert not store._versions.compaction.needs()
        store.compact()  # folds the pinned version's own segment only
        assert store.stats().segments == 12
        compactions = store.stats().compactions
        store.compact()
        _scatter(store, rng, N // 20)
        store._wait_bg()
        assert store.stats().compactions == compactions, "a round ran on segments a pinned version shares"


@pytest.mark.parametrize("process", ["never", "always"])
def test_past_the_share_the_oldest_pinned_version_keeps_its_own_chunks(shm_path, monkeypatch, process):
    """Once the segments newer than the oldest pinned version hold more than its share of the
    table, background rounds (in the store's thread or the compaction process) fold them: that
    version keeps its own chunk files, the newer pinned one shares the new ones, both read their
    rows bit for bit."""
    from lightning_embcache.store import foldproc, sharing

    monkeypatch.setattr(sharing, "SHARE_RATIO", 0.2)
    monkeypatch.setenv(foldproc.ENV, process)
    path = shm_path / "store"
    rng = np.random.default_rng(10)
    with _written_table(path, rng) as store:
        kept = {}
        for flushes in (4, 1):  # 40% of the rows after the first pin, 10% after the second
            v = _scatter(store, rng, 16)
            store.pin(v)
            kept[v] = store.get(ALL).clone()
            for _ in range(flushes):
                _scatter(store, rng, N // 10)
            store._wait_bg()
        old, new = sorted(kept)
        store.compact()
        assert store._versions.disk.read_manifest(old).chunkmap != store._versions.cmap_gen, "the oldest pin still shares"
        assert store._versions.disk.read_manifest(new).chunkmap == store._versions.cmap_gen, "the newer pin does not share"
        if process == "always":
            assert store.stats().compaction_process_chunks > 0
        for v, want in kept.items():
            with EmbeddingStore.open(path, version=v, readonly=True) as r:
                assert torch.equal(r.get(ALL), want)


@pytest.mark.parametrize("share", [0.02, 0.1])
def test_disk_use_beside_a_reader_of_an_old_version(shm_path, share):
    """A read-only handle holds an early version through 150 flushes: compaction folds every
    newer segment, disk use stays within 1.5x the table plus the files that version alone needs,
    and the reader reads its rows unchanged throughout."""
    path = shm_path / "store"
    rng = np.random.default_rng(11)
    with _written_table(path, rng) as store:
        for _ in range(10):
            _scatter(store, rng, int(share * N))
        with EmbeddingStore.open(path, version=store.version, readonly=True) as reader:
            want = reader.get(ALL).clone()
            m = store._versions.disk.read_manifest(reader.version)
            files = [store._versions.disk.segment_path(q) for q in m.segments]
            cmap = store._versions.disk.read_chunkmap(m.chunkmap)
            files += [store._versions.disk.chunk_path(c, g) for c, g in enumerate(cmap.tolist()) if g]
            needs = sum(p.stat().st_size for p in files)
            peak = 0
            for i in range(150):
                _scatter(store, rng, int(share * N))
                store._wait_bg()
                peak = max(peak, _disk_bytes(path))
                if i % 50 == 49:
                    assert torch.equal(reader.get(ALL), want)
            assert torch.equal(reader.get(ALL), want)
    assert peak <= 1.5 * TABLE + needs + SMALL_FILES, (
        f"peak {peak / TABLE:.2f} tables beside a reader whose version needs {needs / TABLE:.2f}")
