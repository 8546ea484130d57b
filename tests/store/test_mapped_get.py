"""The lean get over page-cached chunk files (`Tiers._mapped_get`, `ChunkRows.gather_verified`):
hot rows merged with rows gathered from the maps, every value checked against a tensor model
through get, get_fields and read_records, across updates, flushes, compaction, evictions and
reopening; damage in a chunk not verified yet is still found before any row of the call is
returned; whole-record writes into reused slots keep the records' padding as before."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _store_helpers import compacted_store, model_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import CorruptStoreError, EmbeddingStore
from lightning_embcache.store import tiers
from lightning_embcache.store.rowindex import RowIndex

N, DIM, CHUNK = 2048, 32, 128  # 128-byte rows: 32 to a block, 4 blocks per chunk
ROW = DIM * 4
HOT = 96 * (ROW + 11)


def _count_general_reads(monkeypatch) -> list:
    """Calls of the general miss path (a plan below the hot tier)."""
    calls: list = []
    real = tiers.Tiers.plan_below
    monkeypatch.setattr(tiers.Tiers, "plan_below", lambda self, ids: calls.append(len(ids)) or real(self, ids))
    return calls


def _verify_all(s: EmbeddingStore) -> None:
    """Read every row twice a chunk at a time (chunks then verified whole), then empty the hot tier."""
    for _ in range(2):
        for c in range(0, N, CHUNK):
            s.get(torch.arange(c, c + CHUNK, 3))
            s.evict(1 << 30)


def test_a_batch_of_hot_and_mapped_rows_is_one_gather_without_a_plan(shm_path, monkeypatch):
    """Once every chunk is verified, a get whose rows are partly hot (updated) and partly below
    is served without a plan below the hot tier, hot rows from their slots (the newest values),
    the rest from the maps; an all-hot batch too; the hit and miss counts follow the rows."""
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        _verify_all(s)
        hot = torch.tensor([5, 700, 1500])
        table[hot] += 1
        s.update(hot, table[hot])
        plans = _count_general_reads(monkeypatch)
        before = s.stats()
        mixed = torch.tensor([1500, 3, 700, 2047, 5, 5, 1024])
        assert torch.equal(s.get(mixed), table[mixed])
        assert torch.equal(s.get(hot), table[hot])
        assert torch.equal(s.read_records(mixed).view(torch.float32), table[mixed])
        after = s.stats()
        assert plans == []
        assert after.hot_hits - before.hot_hits == 4 + 3 + 4  # (ids 1500, 700, 5 and 5 are hot)
        assert after.hot_misses - before.hot_misses == 3 + 3
        assert s._tiers.hot.used == 3  # rows served from the maps take no slot


def test_damage_in_a_chunk_not_verified_is_found_before_any_row_is_returned(shm_path):
    """A call mixing rows of chunks verified whole (served by the gather) with a row of a damaged
    chunk never read yet raises CorruptStoreError naming the block, and returns nothing."""
    compacted_store(shm_path / "s", N, DIM, CHUNK)
    f = sorted((shm_path / "s" / "chunks").glob("c00000009-*"))[-1]
    raw = bytearray(f.read_bytes())
    raw[-CHUNK * ROW + 2 * 4096 + 7] ^= 0x10  # block 2 of chunk 9's records
    f.write_bytes(bytes(raw))
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        for _ in range(2):
            s.get(torch.arange(0, 2 * CHUNK, 5))  # chunks 0 and 1 verified whole
            s.evict(1 << 30)
        served = s._versions.chunkrows.map_counts[0]
        bad = torch.tensor([3, CHUNK + 1, 9 * CHUNK + 2 * 32 + 4])
        with pytest.raises(CorruptStoreError, match="block 2 of chunk 9"):
            s.get(bad)
        assert s._versions.chunkrows.map_counts[0] == served


def test_a_fresh_handle_reads_in_one_loop_checking_each_block_once(shm_path, native_gets, monkeypatch):
    """A fresh handle's gets (no chunk verified yet) are served by the C loop without the general
    path: each 4 KiB block checked the first time a row in it is read and never again, the files
    mapped as the gets meet them, no row installed in the hot tier; a chunk with first reads in
    `WHOLE_AFTER` calls is checked whole at its next (as the general path does); the values are
    the table's."""
    from lightning_embcache.store.chunkrows import WHOLE_AFTER

    chunk = 512  # 16 blocks a chunk
    table = compacted_store(shm_path / "s", N, DIM, chunk)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        plans = _count_general_reads(monkeypatch)
        for k in range(WHOLE_AFTER):  # a new block of chunks 1 and 3 each call, and block 0 again
            ids = torch.tensor([chunk + 32 * k, 3 * chunk + 32 * k + 5, 3 * chunk + 1])
            assert torch.equal(s.get(ids), table[ids])
            assert s._versions.chunkrows.map_counts[1] == 2 * (k + 1)
        one = torch.tensor([chunk + 32 * 9])
        assert torch.equal(s.get(one), table[one])  # chunk 1's next call of first reads: checked whole
        reader = s._versions.chunkrows
        assert reader.map_counts[1] == 2 * WHOLE_AFTER + 16 - WHOLE_AFTER
        rest = torch.arange(chunk, 2 * chunk)
        assert torch.equal(s.get(rest), table[rest])
        assert reader.map_counts[1] == 2 * WHOLE_AFTER + 16 - WHOLE_AFTER
        assert plans == []
        assert s._tiers.hot.used == 0
        assert s.stats().hot_misses == 3 * WHOLE_AFTER + 1 + chunk


def test_damage_met_by_the_loop_is_named_and_no_row_is_returned(shm_path, native_gets):
    """Rows of a chunk read block by block by the C loop, then a call with a row in a damaged block
    of it: CorruptStoreError naming the block and the file, nothing returned, nothing counted as
    served; the blocks read before stay served."""
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    f = sorted((shm_path / "s" / "chunks").glob("c00000009-*"))[-1]
    raw = bytearray(f.read_bytes())
    raw[-CHUNK * ROW + 2 * 4096 + 7] ^= 0x10  # block 2 of chunk 9's records
    f.write_bytes(bytes(raw))
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        good = torch.tensor([9 * CHUNK + 1, 9 * CHUNK + 40, 3])  # blocks 0 and 1 of chunk 9
        assert torch.equal(s.get(good), table[good])
        reader = s._versions.chunkrows
        served = reader.map_counts[0]
        with pytest.raises(CorruptStoreError, match="block 2 of chunk 9") as info:
            s.get(torch.tensor([5, 9 * CHUNK + 2 * 32 + 4, 9 * CHUNK + 1]))
        assert f.name in str(info.value)
        assert reader.map_counts[0] == served


def _uncached(path) -> bool:
    """Drop ``path``'s pages from the page cache; whether its middle page is then not cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(4096)], os.fstat(fd).st_size // 2 // 4096 * 4096, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="Linux only")
def test_rows_of_files_not_in_the_page_cache_are_asked_for_together_once(tmp_path, native_gets):
    """Chunk files not in the page cache when a handle first meets them: before the gather, the
    128 KiB region around each row of a block not checked yet is asked from the kernel, once per
    region (reads that then run together, not one page fault at a time); files in the page cache
    are asked nothing. Values are the table's either way."""
    from lightning_embcache.store.mappedget import ASK_BYTES

    n, dim, chunk = 8192, 128, 1024  # 512-byte rows: 512 KiB chunks, 4+ regions each
    table = compacted_store(tmp_path / "s", n, dim, chunk)
    files = sorted((tmp_path / "s" / "chunks").glob("c*"))
    if not all([_uncached(f) for f in files]):
        pytest.skip("the page cache here keeps these files (tmpfs?)")
    ids = torch.tensor([5, 300, 301, 700, 3 * chunk + 900, 3 * chunk + 17])
    with EmbeddingStore.open(tmp_path / "s", hot_bytes=64 * 600) as s:
        assert torch.equal(s.get(ids), table[ids])
        reader, native = s._versions.chunkrows, s._tiers.native_get
        regions = {(i // chunk, (int(reader._off[i // chunk]) + i % chunk * dim * 4) // ASK_BYTES) for i in ids.tolist()}
        assert native.asks == len(regions) < len(ids)
        assert torch.equal(s.get(ids), table[ids])
        assert native.asks == len(regions)  # blocks checked: nothing asked again
    for f in files:
        f.read_bytes()  # in the page cache now
    with EmbeddingStore.open(tmp_path / "s", hot_bytes=64 * 600) as s:
        assert torch.equal(s.get(ids), table[ids])
        assert s._tiers.native_get.asks == 0


@pytest.mark.parametrize("gets", ["native", "numpy"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["get", "records", "fields", "update", "flush", "compact", "evict",
                                           "reopen"]),
                          st.lists(st.integers(0, N - 1), min_size=1, max_size=200)), min_size=1, max_size=14))
def test_reads_match_a_tensor_model_across_writes_compaction_and_reopening(shm_path, request, gets, ops):
    """Gets (and whole records, and named fields), updates, flushes, compaction, evictions and
    reopening in any order: every read returns the model's rows exactly, whether from the hot
    tier, a delta segment or the maps; a reopened store returns exactly what its last flush held.
    Through the C loop (mappedget.py) from a fresh handle (its first reads check blocks in the
    loop); through the numpy path once every chunk was verified whole (its `gather_verified`)."""
    request.getfixturevalue(f"{gets}_gets")
    path = shm_path / f"m{os.getpid()}-{np.random.default_rng().integers(1 << 40)}"
    table = compacted_store(path, N, DIM, CHUNK, seed=1)
    flushed = table.clone()
    verify = _verify_all if gets == "numpy" else (lambda s: None)
    s = EmbeddingStore.open(path, hot_bytes=HOT)
    try:
        verify(s)
        for k, (op, ids) in enumerate(ops):
            if op == "reopen":
                s.close()
                table = flushed.clone()
                s = EmbeddingStore.open(path, hot_bytes=HOT)
                verify(s)
            elif model_step(s, table, op, torch.tensor(ids), k):
                flushed = table.clone()
        assert torch.equal(s.get(torch.arange(N)), table)
    finally:
        s.close()


def test_whole_field_writes_into_reused_slots_keep_the_padding_zero(shm_path):
    """Records with padding (a float16 weight of 3 columns, then an int32 field): rows written
    through write_records with every byte set, written back and evicted, leave their slots to
    rows written through update_fields of every field; those rows read back with zero padding
    and their own values."""
    n = 512
    with EmbeddingStore.create(shm_path / "s", n, 3, dtype=torch.float16, chunk_rows=64,
                               hot_bytes=64 * (16 + 11), fields={"step": (torch.int32, 1)}) as s:
        assert s.row_bytes == 16  # 6 bytes of weight, 2 of padding, 4 of step, 4 of padding
        a = torch.arange(0, 64)
        rec = torch.full((64, 16), 0xFF, dtype=torch.uint8)
        rec[:, :6] = 0
        rec[:, 8:12] = 0
        for part in range(0, 64, 16):  # (a call of over half the hot tier's slots goes around it)
            s.write_records(a[part : part + 16], rec[part : part + 16])
        assert s._tiers.hot.free_count == 0
        s.flush()
        b = torch.arange(100, 164)
        w = torch.randn(64, 3).half()
        step = torch.arange(64, dtype=torch.int32).unsqueeze(1)
        for part in range(0, 64, 16):  # each evicts 16 of a's rows and takes their slots
            s.update_fields(b[part : part + 16], {"weight": w[part : part + 16], "step": step[part : part + 16]})
        assert s._tiers.hot.slot_of[b.numpy()].all()
        got = s.read_records(b)
        assert torch.equal(s.record_view(got, "weight"), w)
        assert torch.equal(s.record_view(got, "step"), step)
        assert torch.equal(got[:, 6:8], torch.zeros(64, 2, dtype=torch.uint8))
        assert torch.equal(got[:, 12:], torch.zeros(64, 4, dtype=torch.uint8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 999), min_size=0, max_size=40), min_size=0, max_size=5),
       st.lists(st.integers(0, 999), min_size=0, max_size=60))
def test_row_index_any_of_agrees_with_find(segments, query):
    """`RowIndex.any_of(ids)` is whether `find` gives any of ``ids`` a record, for indexes built
    from segments at once and grown one segment at a time."""

    class Seg:
        def __init__(self, ids, seq):
            self.ids = np.unique(np.asarray(ids, np.int64))
            self.seq = seq
            self.idx_count = np.ones(len(self.ids), np.int64)

    segs = [Seg(ids, k + 1) for k, ids in enumerate(segments)]
    q = np.asarray(query, np.int64)
    for index in (RowIndex(segs, num_rows=1000), RowIndex(num_rows=1000), RowIndex(segs)):
        if not len(index.segs):
            for seg in segs:
                index.add(seg)
        want = bool((index.find(q)[0] >= 0).any()) if len(q) else False
        assert index.any_of(q) == want


def test_an_empty_call_returns_empty_fields(shm_path, native_gets):
    """A get of no ids over mapped chunk files (one field, and several) returns empty rows of the
    fields' shapes and types, as every other path does."""
    with EmbeddingStore.create(shm_path / "s", N, DIM, chunk_rows=CHUNK, fields={"m": (torch.float32, DIM)}) as s:
        s.update_fields(torch.arange(N), {"weight": torch.ones(N, DIM), "m": torch.zeros(N, DIM)})
        s.flush()
        s.compact()
        s.flush()
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT * 2) as s:
        s.get(torch.arange(0, N, 7))  # chunk files mapped and checked
        none = torch.zeros(0, dtype=torch.int64)
        assert s.get(none).shape == (0, DIM)
        got = s.get_fields(none, ("weight", "m"))
        assert got["weight"].shape == got["m"].shape == (0, DIM) and got["m"].dtype == torch.float32


def test_a_row_whose_index_bit_is_set_without_a_record_stays_in_the_loop(shm_path, native_gets, monkeypatch):
    """The row index's bitmap may mark an id with no delta record (a bit is a hint: the index
    answers exactly): the C loop asks the index, and serves the call itself when no row of it has
    a record, without the general path; a row with a record goes to the general path, newest
    value returned."""
    table = compacted_store(shm_path / "s", N, DIM, CHUNK)
    with EmbeddingStore.open(shm_path / "s", hot_bytes=HOT) as s:
        ids = torch.arange(0, 40)
        table[ids] += 1
        s.update(ids, table[ids])
        s.flush()
        s.evict(1 << 30)  # rows 0..39 now live in a delta segment only
        s.get(torch.tensor([700]))  # chunk files mapped
        rows = s._versions.rows
        rows._bits[900 >> 3] |= 1 << (900 & 7)  # a hint with no record behind it
        plans = _count_general_reads(monkeypatch)
        q = torch.tensor([900, 1500])
        assert torch.equal(s.get(q), table[q])
        assert plans == []
        q = torch.tensor([900, 5])
        assert torch.equal(s.get(q), table[q])
        assert plans == [2]  # (the call goes to the general path whole)
