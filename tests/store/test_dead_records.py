"""Dead delta records (store/holes.py): once a chunk's base file holds a segment's records of it,
reads and folds go to the base, the records' disk blocks are punched out of the segment, and the
index forgets them - without losing a row, for the live layout, a pinned version or a read in
flight."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from fastpaths import skip_unless
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import compaction, fileio, garbage, versions
from lightning_embcache.store.holes import dead_rows
from lightning_embcache.store.rowindex import RowIndex

pytestmark = skip_unless(fileio.punch_supported(), "fallocate(PUNCH_HOLE)")

N, DIM, CR = 4096, 16, 64


# ---- the index: entries of dead records are dropped, the newest live record is still found ----
class _Seg:
    def __init__(self, seq: int, ids: set[int], cr: int) -> None:
        self.seq = seq
        self.ids = np.array(sorted(ids), np.int64)
        chunks = self.ids // cr
        starts = np.flatnonzero(np.r_[True, chunks[1:] != chunks[:-1]]) if len(ids) else np.zeros(0, np.int64)
        self.idx_chunk = chunks[starts]
        self.idx_count = np.diff(np.r_[starts, len(ids)]).astype(np.int64)


@settings(max_examples=150, deadline=None)
# an id in both runs of the index (main after a rebuild, recent after an add), dead in both
@example([("seg", {1, 9}), ("rebuild", None), ("seg", {1}), ("fold", {0}), ("prune", None)])
@given(st.lists(st.one_of(st.sets(st.integers(0, 63), max_size=24).map(lambda s: ("seg", s)),
                          st.sets(st.integers(0, 7), min_size=1, max_size=8).map(lambda s: ("fold", s)),
                          st.just(("prune", None)), st.just(("rebuild", None))), max_size=30))
def test_index_follows_a_model_of_newest_live_records(ops):
    """find() gives the newest record of each id unless base chunks hold it (then -1), after any
    sequence of new segments, folds (note_folded), prunes and rebuilds; superseded() names only
    segments whose every record is dead or has a newer one (what a flush may leave out)."""
    cr, rows = 8, 64
    segs: list[_Seg] = []
    folded = np.zeros(rows // cr, np.int64)
    index = RowIndex(num_rows=rows)
    for op, arg in ops:
        if op == "seg":
            segs.append(_Seg(len(segs) + 1, arg, cr))
            index.add(segs[-1])
        elif op == "fold" and segs:
            folded = folded.copy()
            chunks = np.array(sorted(arg), np.int64)
            folded[chunks] = segs[-1].seq
            index.note_folded(chunks, cr, folded)
        elif op == "prune":
            index.prune(folded, cr)
        elif op == "rebuild":
            index = RowIndex(segs, rows, folded)
        ids = np.arange(rows, dtype=np.int64)
        seg, _ = index.find(ids)
        seg[dead_rows(index.seqs, seg, ids // cr, folded)] = -1  # as the store reads (`_find_below`)
        got = np.where(seg >= 0, index.seqs[np.maximum(seg, 0)] if len(index.seqs) else -1, -1)
        # the model: newest segment holding each id; -1 if none or base chunks hold it
        want = np.full(rows, -1)
        for s in segs:
            want[s.ids] = s.seq
        want[(want >= 0) & (folded[ids // cr] >= want)] = -1
        assert np.array_equal(got, want), (op, got, want)
        # superseded: sound always
        newest = {}
        for s in segs:
            for x in s.ids.tolist():
                newest[x] = s.seq
        for q in index.superseded(segs, np.zeros(0, np.int64)):
            s = next(t for t in segs if t.seq == q)
            for x in s.ids.tolist():
                assert newest[x] > q or folded[x // cr] >= q, f"segment {q} still holds id {x}'s newest live record"


# ---- a real store ----------------------------------------------------------------------------
@pytest.fixture
def no_background_compaction(monkeypatch):
    """Compaction only when the test runs a round, so what is punched when is deterministic."""
    monkeypatch.setattr(compaction, "COMPACT_RATIO", 100.0)
    monkeypatch.setattr(compaction, "COMPACT_SEGMENTS", 10_000)
    monkeypatch.setattr(versions, "COMPACT_SEGMENTS", 10_000)  # (a flush's backpressure counts them too)
    monkeypatch.setattr(versions, "HARD_RATIO", 100.0)
    monkeypatch.setattr(compaction, "ROUND_SHARE", 1 / 8)
    monkeypatch.setattr(compaction, "ROUND_BYTES", 8 * CR * DIM * 4)
    monkeypatch.setattr(garbage, "PUNCH_FROM", 0.0)  # every round gives back what it killed


def _train(store: EmbeddingStore, model: torch.Tensor, rng: np.random.Generator, flushes: int, share: float = 0.3) -> None:
    for _ in range(flushes):
        ids = torch.from_numpy(rng.choice(N, int(N * share), replace=False))
        vals = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
        store.update(ids, vals)
        model[ids] = vals
        store.flush()


def _start(tmp_path, seed: int):
    """(path, rng, model, a new store): each test's table and its reference."""
    path = tmp_path / "s"
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=CR, hot_bytes=64 * DIM * 4)
    return path, np.random.default_rng(seed), torch.zeros(N, DIM), store


def _rounds(store: EmbeddingStore, k: int) -> None:
    with store._versions.flush_lock:
        for _ in range(k):
            store._versions.compaction.compact_round()


def _segment_files(path) -> list[os.stat_result]:
    d = path / "segments"
    return [os.stat(d / n) for n in os.listdir(d)]


def test_rounds_punch_the_records_they_fold_and_every_row_reads_the_same(tmp_path, no_background_compaction):
    path, rng, model, s = _start(tmp_path, 0)
    with s:
        _train(s, model, rng, 4)
        raw = sum(st.st_size for st in _segment_files(path))
        _rounds(s, 4)  # half a sweep: no segment is folded everywhere, none can go
        files = _segment_files(path)
        assert len(files) == 4
        held = sum(fileio.held_bytes(st) for st in files)
        assert held < 0.7 * raw, f"segments hold {held} of {raw} bytes after half a sweep: nothing punched?"
        assert s._versions.compaction.segment_bytes(held=True) < 0.7 * s._versions.compaction.segment_bytes()
        assert torch.equal(s.get(torch.arange(N)), model)
        _train(s, model, rng, 1)
        _rounds(s, 2)
        assert torch.equal(s.get(torch.arange(N)), model)
    with EmbeddingStore.open(path) as s:
        assert torch.equal(s.get(torch.arange(N)), model)
        s.compact()
        assert torch.equal(s.get(torch.arange(N)), model)


def test_reads_and_folds_never_touch_a_dead_record(tmp_path, no_background_compaction):
    """Dead records overwritten with garbage: reads of every row (a fresh handle, nothing cached)
    and the rest of the sweep give the model's rows. Reading one would fail its checksum."""
    path, rng, model, s = _start(tmp_path, 1)
    with s:
        _train(s, model, rng, 3)
        _rounds(s, 3)
        folded = s._versions.folded.copy()
        segs = list(s._versions.committed)
    spoiled = 0
    for g in segs:
        dead = np.flatnonzero(folded[g.idx_chunk] >= g.seq)
        with open(g.path, "r+b") as f:
            for e in dead.tolist():
                f.seek(g.records_offset + int(g.idx_start[e]) * g.row_bytes)
                f.write(b"\xff" * int(g.idx_count[e]) * g.row_bytes)
                spoiled += 1
    assert spoiled > 0
    with EmbeddingStore.open(path, hot_bytes=64 * DIM * 4) as s:
        assert torch.equal(s.get(torch.arange(N)), model)
        s.compact()
        assert torch.equal(s.get(torch.arange(N)), model)


def test_a_pinned_version_keeps_the_records_it_reads(tmp_path, no_background_compaction):
    path, rng, model, s = _start(tmp_path, 2)
    with s:
        _train(s, model, rng, 3)
        v = s.version
        s.pin(v)
        at_pin = model.clone()
        _train(s, model, rng, 2)
        _rounds(s, 12)  # beyond a sweep: the pinned version's segments are folded in the live layout
        with EmbeddingStore.open(path, version=v, readonly=True) as r:
            assert torch.equal(r.get(torch.arange(N)), at_pin)
        assert torch.equal(s.get(torch.arange(N)), model)
        s.unpin(v)
        _train(s, model, rng, 1)
        _rounds(s, 2)
        assert torch.equal(s.get(torch.arange(N)), model)


def test_a_read_planned_before_a_round_holds_its_punches_back(tmp_path, no_background_compaction):
    """A prefetch plans under the store lock and reads without it: what a round kills meanwhile is
    punched only once that read ended (at the next round)."""
    path, rng, model, s = _start(tmp_path, 3)
    with s:
        _train(s, model, rng, 3)
        pool = s._versions.disk.pool
        epoch = pool.begin_read()  # as `_prefetch_once` does when it plans
        _rounds(s, 2)
        assert s._versions.garbage.dead.punched_bytes == 0 and s._versions.garbage.dead._queue, "punched under a read planned before the round"
        pool.end_read(epoch)
        queued = [(g, new.copy()) for g, new, _ in s._versions.garbage.dead._queue]
        _rounds(s, 1)
        assert s._versions.garbage.dead.punched_bytes > 0 and not s._versions.garbage.dead._queue
        assert all((g.punched[new]).all() for g, new in queued)
        assert torch.equal(s.get(torch.arange(N)), model)


def test_a_flush_waits_for_the_bytes_held_not_for_a_whole_sweep(tmp_path, no_background_compaction, monkeypatch):
    """Past the backpressure limit by the files' sizes but not by the bytes they still hold on
    disk, a flush runs no compaction round itself."""
    path, rng, model, s = _start(tmp_path, 4)
    with s:
        _train(s, model, rng, 4)
        _rounds(s, 6)
        table = N * s.row_bytes
        raw, held = s._versions.compaction.segment_bytes(), s._versions.compaction.segment_bytes(held=True)
        limit = (held + raw) / 2 / table
        monkeypatch.setattr(versions, "HARD_RATIO", limit)
        monkeypatch.setattr(versions, "HARD_FLOOR", 0)
        rounds = []
        real = type(s._versions.compaction).compact_round
        monkeypatch.setattr(type(s._versions.compaction), "compact_round", lambda self, *a, **k: rounds.append(1) or real(self, *a, **k))
        ids = torch.arange(8)
        s.update(ids, torch.ones(8, DIM))
        model[ids] = 1.0
        s.flush()
        assert not rounds, f"the flush ran {len(rounds)} rounds with {held} of {raw} segment bytes held (limit {limit * table:.0f})"
        assert torch.equal(s.get(torch.arange(N)), model)
