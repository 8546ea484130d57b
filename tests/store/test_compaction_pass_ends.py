"""A background compaction pass neither keeps disk garbage nor runs forever:

* segments that flushes leave out while a pass runs (a hot set flushed again and again) are
  deleted between its rounds, not when the pass ends, so disk use stays bounded by what the
  versions hold however long the pass takes;
* once the rows that started the pass are folded, a hot set of rows flushed over and over (its
  segments left out by the flushes themselves, the layout holding one segment over half the
  threshold) ends the pass instead of being folded into the table again after every flush.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from _store_helpers import assert_bitwise_equal

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import compaction, versions
from lightning_embcache.store.compaction import Compaction

N, DIM, CHUNK = 8192, 8, 128
ROW = DIM * 4


def _segment_files(path) -> int:
    return sum(1 for n in os.listdir(path / "segments") if not n.startswith("."))


def _slow_rounds(monkeypatch, seconds: float) -> None:
    """One chunk a round, each round taking at least ``seconds``: a pass lasts many flushes,
    all of it in the background (no flush folds rounds itself for backpressure)."""
    monkeypatch.setattr(versions, "HARD_RATIO", 9.0)
    monkeypatch.setattr(compaction, "ROUND_BYTES", CHUNK * ROW)
    monkeypatch.setattr(compaction, "ROUND_SHARE", 1 / 10_000)
    fold_round = Compaction._fold_round

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return fold_round(self, *args, **kwargs)

    monkeypatch.setattr(Compaction, "_fold_round", slow)


def test_segments_left_out_by_flushes_go_while_a_pass_runs(tmp_path, monkeypatch):
    _slow_rounds(monkeypatch, 0.03)  # 64 chunks: a pass of 2 s or more
    path = tmp_path / "s"
    rng = np.random.default_rng(0)
    table = torch.from_numpy(rng.standard_normal((N, DIM), dtype=np.float32))
    hot_set = torch.from_numpy(np.sort(rng.choice(N, N // 10, replace=False)))
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, init="zeros") as s:
        s.update(torch.arange(N), table)
        s.flush()  # a segment of the whole table: a background pass starts
        most = 0
        for k in range(25):
            values = torch.full((len(hot_set), DIM), float(k))
            s.update(hot_set, values)
            table[hot_set] = values
            s.flush()  # leaves out the previous hot-set segment
            time.sleep(0.02)
            most = max(most, _segment_files(path))
        st = s.stats()
        assert 0 < st.compactions < N // CHUNK, ("the pass still runs", st)
        assert st.superseded_segments >= 20, st
        # The layout holds the whole-table segment (until the pass ends) and the newest hot-set
        # one; the last flushes' may wait for the next round. Kept until the pass ended, there
        # were 26 here.
        assert most <= 5, f"{most} segment files on disk during the pass"
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows")
    with EmbeddingStore.open(path) as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after reopening")


def test_a_hot_set_over_half_the_threshold_ends_the_pass(tmp_path, monkeypatch):
    _slow_rounds(monkeypatch, 0.005)  # 64 chunks: a pass of ~0.3 s or more
    path = tmp_path / "s"
    rng = np.random.default_rng(1)
    table = torch.from_numpy(rng.standard_normal((N, DIM), dtype=np.float32))
    # Over half of COMPACT_RATIO (where a pass used to stop) and under it (where one starts).
    share = (compaction.COMPACT_RATIO / 2 + compaction.COMPACT_RATIO) / 2
    hot_set = torch.from_numpy(np.sort(rng.choice(N, int(N * share), replace=False)))
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, init="zeros") as s:
        s.update(torch.arange(N), table)
        s.flush()  # a segment of the whole table: a background pass starts
        k = 0

        def flush_hot_set() -> None:
            nonlocal k
            s.update(hot_set, torch.full((len(hot_set), DIM), float(k)))
            table[hot_set] = float(k)
            s.flush()
            time.sleep(0.01)
            k += 1

        # The hot set flushed again and again while the pass folds the whole-table segment (64
        # rounds of a chunk each), however long that takes on this machine: counted, not timed.
        while (k < 20 or s.stats().compactions < N // CHUNK) and k < 5000:
            flush_hot_set()
        for _ in range(20):  # and on after it: an ended pass stays ended
            flush_hot_set()
        s._wait_bg()
        st = s.stats()
        # The hot set's segments are left out by the flushes themselves. A pass that went on
        # while segments were over half the threshold folded each new hot-set segment into every
        # chunk again: 200+ rounds here.
        assert st.superseded_segments >= 20, st
        assert N // CHUNK <= st.compactions <= 2 * (N // CHUNK), st
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows")
    with EmbeddingStore.open(path) as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after reopening")
