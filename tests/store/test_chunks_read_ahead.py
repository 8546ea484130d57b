"""Chunks announced in `ChunkShuffleSampler` order are read whole into the warm tier by kernel
threads (chunkload.py). Rows served stay exactly a tensor model's through updates, flushes,
evictions and compactions that land while chunks are in flight; the warm budget holds; a damaged
file is still named by the get; files that are not dense raw chunks (sparse, LZ4) are read as
usual; a budget change, close() and a forked child find nothing left in flight."""

from __future__ import annotations

import os

import pytest
import torch
from _store_helpers import assert_bitwise_equal, compacted_store
from torch.utils.data import BatchSampler

from lightning_embcache import ChunkShuffleSampler, CorruptStoreError, EmbeddingStore, LookaheadSampler

N, DIM, CHUNK, WINDOW = 8192, 16, 512, 4
ROW = DIM * 4
WARM = 2 * WINDOW * CHUNK * ROW  # two windows of chunks, as docs/store.md advises


def _open(path, **kw) -> EmbeddingStore:
    kw.setdefault("hot_bytes", N * (ROW + 11) // 4)
    kw.setdefault("warm_bytes", WARM)
    return EmbeddingStore.open(path, **kw)


def _batches(store: EmbeddingStore, seed: int, bsz: int = 128):
    sampler = ChunkShuffleSampler(N, chunk_rows=CHUNK, window=WINDOW, seed=seed)
    for batch in LookaheadSampler(BatchSampler(sampler, bsz, drop_last=False), store, lookahead=4):
        yield torch.as_tensor(batch)


def _chunk_rows(c: int) -> torch.Tensor:
    return torch.arange(c * CHUNK, (c + 1) * CHUNK)


@pytest.mark.parametrize("kernel_threads", [True, False], ids=["read-ahead", "page-cache"])
def test_training_in_chunk_order_matches_a_tensor_model_within_the_warm_budget(shm_path, kernel_threads, request):
    request.getfixturevalue("read_ahead" if kernel_threads else "no_read_ahead")
    model = compacted_store(shm_path / "s", N, DIM, CHUNK).clone()
    with _open(shm_path / "s") as s:
        for epoch in range(3):
            for i, ids in enumerate(_batches(s, seed=epoch)):
                x = s.get(ids)
                assert_bitwise_equal(x, model[ids], f"epoch {epoch} batch {i}")
                new = x * 0.5 + (epoch + 1)
                s.update(ids, new)
                model[ids] = new
                if i % 7 == 6:
                    s.flush()
                if i % 23 == 22:
                    s.compact()
                assert s._tiers.warm.nbytes <= WARM  # the slots being read into count too
            if epoch == 0:
                first = s.stats().chunks_read_ahead
        s.flush()
        total = s.stats().chunks_read_ahead
    assert (first >= N // CHUNK) if kernel_threads else (first == 0)
    # later epochs too, where rows of most chunks have newer records in delta segments: at least
    # half their chunks (a compaction folding a file in place throws away the loads of that file
    # in flight, which the training thread then reads itself)
    assert (total - first >= N // CHUNK) if kernel_threads else (total == 0), (first, total)
    with _open(shm_path / "s") as s:
        assert_bitwise_equal(s.get(torch.arange(N)), model, "reopened")


def _announce(s: EmbeddingStore, c: int) -> None:
    """Announce every row of chunk ``c`` as a coming batch would (its read starts now)."""
    s._tiers.readahead._uncached_share = 1.0  # reads wait for the disk
    s._tiers.readahead._cache_seen = (1 << 62, 0)
    s.upcoming(_chunk_rows(c))


def test_rows_written_while_a_chunk_is_in_flight_are_served_new(shm_path, read_ahead):
    """Delta records written (flushed and evicted from the hot tier) after the read began are
    applied when the chunk joins the warm tier."""
    model = compacted_store(shm_path / "s", N, DIM, CHUNK).clone()
    with _open(shm_path / "s") as s:
        _announce(s, 3)
        ids = torch.arange(3 * CHUNK + 5, 4 * CHUNK, 9)
        model[ids] = torch.full((len(ids), DIM), 7.0)
        s.update(ids, model[ids])
        s.flush()
        s.evict(1 << 40)  # the written rows now live in a delta segment only
        assert_bitwise_equal(s.get(_chunk_rows(3)), model[_chunk_rows(3)])
        assert s.stats().chunks_read_ahead == 1


def test_a_chunk_compacted_while_in_flight_is_read_again_from_its_new_file(shm_path, read_ahead):
    model = compacted_store(shm_path / "s", N, DIM, CHUNK).clone()
    with _open(shm_path / "s") as s:
        _announce(s, 2)
        ids = _chunk_rows(2)[::2]
        model[ids] = -model[ids]
        s.update(ids, model[ids])
        s.flush()
        s.compact()  # chunk 2 gets a new base file: the one being read is not current
        s.flush()
        s.evict(1 << 40)
        assert_bitwise_equal(s.get(_chunk_rows(2)), model[_chunk_rows(2)])
        assert s.stats().chunks_read_ahead == 0


def _chunk_file(path, c: int):
    (f,) = sorted((path / "chunks").glob(f"c{c:08d}-g*"))
    return f


def test_a_damaged_chunk_read_ahead_is_named_by_the_get(shm_path, read_ahead):
    model = compacted_store(shm_path / "s", N, DIM, CHUNK).clone()
    f = _chunk_file(shm_path / "s", 2)
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF  # a byte of the last block of records
    f.write_bytes(bytes(data))
    with _open(shm_path / "s") as s:
        _announce(s, 2)
        _announce(s, 3)
        with pytest.raises(CorruptStoreError, match="chunk 2"):
            s.get(_chunk_rows(2))
        assert_bitwise_equal(s.get(_chunk_rows(3)), model[_chunk_rows(3)])
        assert s.stats().chunks_read_ahead == 1  # chunk 3's; chunk 2 was refused


def test_compressed_and_sparse_chunk_files_are_read_as_usual(shm_path, read_ahead):
    # chunk 0: LZ4 (constant rows pack); chunk 1: sparse (a few rows written over init="normal")
    with EmbeddingStore.create(shm_path / "s", N, DIM, chunk_rows=CHUNK, init="normal", seed=3,
                               compression="lz4") as s:
        model = s.get(torch.arange(N)).clone()
        model[_chunk_rows(0)] = 1.0
        few = torch.arange(CHUNK, 2 * CHUNK, 50)
        model[few] = 2.0
        s.update(_chunk_rows(0), model[_chunk_rows(0)])
        s.update(few, model[few])
        s.flush()
        s.compact()
        s.flush()
    assert _chunk_file(shm_path / "s", 0).read_bytes()[8:16] != b"chunkraw"
    assert _chunk_file(shm_path / "s", 1).read_bytes()[8:16] != b"chunkraw"
    with _open(shm_path / "s") as s:
        for c in (0, 1):
            _announce(s, c)
            assert_bitwise_equal(s.get(_chunk_rows(c)), model[_chunk_rows(c)], f"chunk {c}")
        assert s.stats().chunks_read_ahead == 0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_budget_change_and_close_wait_for_chunks_in_flight(shm_path, read_ahead):
    model = compacted_store(shm_path / "s", N, DIM, CHUNK)
    before = _open_fds()
    s = _open(shm_path / "s")
    for c in range(4):
        _announce(s, c)
    s.set_budget(warm_bytes=WARM // 2)  # the slab is made again: nothing may still be read into it
    assert s._tiers.warm.nbytes <= WARM // 2
    assert_bitwise_equal(s.get(torch.arange(4 * CHUNK)), model[: 4 * CHUNK])
    for c in range(4, 8):
        _announce(s, c)
    s.close()
    assert _open_fds() == before, "a descriptor of a chunk in flight was left open"


def test_a_forked_child_reads_its_rows_itself(shm_path, read_ahead):
    """The kernel fills the parent's slots: a child forked with chunks in flight reads them as
    usual (a read-only handle, as a DataLoader worker's)."""
    model = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", readonly=True, hot_bytes=N * (ROW + 11) // 4, warm_bytes=WARM) as s:
        s._tiers.readahead._uncached_share = 1.0
        s._tiers.readahead._cache_seen = (1 << 62, 0)
        s.upcoming(torch.arange(2 * CHUNK))  # one hint: both reads start, neither is looked at
        assert len(s._tiers.readahead.loader) == 2
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            ok = 0
            try:
                got = s.get(torch.arange(2 * CHUNK))
                ok = int(torch.equal(got, model[: 2 * CHUNK]) and s.stats().chunks_read_ahead == 0)
            finally:
                os.write(w, bytes([ok]))
                os._exit(0)
        os.close(w)
        child_ok = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert child_ok == b"\x01"
        assert_bitwise_equal(s.get(torch.arange(2 * CHUNK)), model[: 2 * CHUNK])
        assert s.stats().chunks_read_ahead == 2


def test_a_failure_while_taking_chunks_in_leaves_no_slot_reserved(shm_path, read_ahead, monkeypatch):
    """A delta segment that cannot be read while a chunk read ahead joins the warm tier fails
    that get; no slot stays reserved for it, and the store goes on (a budget change too)."""
    from lightning_embcache.store import readahead

    model = compacted_store(shm_path / "s", N, DIM, CHUNK).clone()
    with _open(shm_path / "s") as s:
        ids = _chunk_rows(1)[::3]
        model[ids] = 5.0
        s.update(ids, model[ids])
        s.flush()
        s.evict(1 << 40)
        _announce(s, 0)
        s._tiers.readahead.loader.start([1], [int(s._versions.cmap[1])])  # chunk 1 has newer rows in a delta segment
        real = readahead.gather_deltas
        monkeypatch.setattr(readahead, "gather_deltas", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "EIO")))
        with pytest.raises(OSError):
            s.get(torch.arange(2 * CHUNK))
        assert s._tiers.warm._loading == {} and s._tiers.warm._loading_bytes == 0
        monkeypatch.setattr(readahead, "gather_deltas", real)
        s.set_budget(warm_bytes=WARM // 2)
        assert_bitwise_equal(s.get(torch.arange(2 * CHUNK)), model[: 2 * CHUNK])
