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


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["get", "records", "fields", "update", "flush", "compact", "evict",
                                           "reopen"]),
                          st.lists(st.integers(0, N - 1), min_size=1, max_size=200)), min_size=1, max_size=14))
def test_reads_match_a_tensor_model_across_writes_compaction_and_reopening(shm_path, ops):
    """Gets (and whole records, and named fields), updates, flushes, compaction, evictions and
    reopening in any order, after every chunk was verified: every read returns the model's rows
    exactly, whether from the hot tier, a delta segment or the maps; a reopened store returns
    exactly what its last flush held."""
    path = shm_path / f"m{os.getpid()}-{np.random.default_rng().integers(1 << 40)}"
    table = compacted_store(path, N, DIM, CHUNK, seed=1)
    flushed = table.clone()
    s = EmbeddingStore.open(path, hot_bytes=HOT)
    try:
        _verify_all(s)
        for k, (op, ids) in enumerate(ops):
            if op == "reopen":
                s.close()
                table = flushed.clone()
                s = EmbeddingStore.open(path, hot_bytes=HOT)
                _verify_all(s)
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
