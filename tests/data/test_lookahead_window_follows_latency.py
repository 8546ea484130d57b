"""LookaheadSampler(lookahead=None) announces as many batches ahead as the measured read latency
needs: the time a batch's rows take to come up (the store's seconds per row read below its hot
tier) over the time between two batches, plus one, within the hot tier's quarter; the items
yielded never change."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import BatchSampler, SequentialSampler

from lightning_embcache import EmbeddingStore, LookaheadSampler
from lightning_embcache.data import lookahead as la

BATCH, BATCHES = 64, 200


class Store:
    """Records hints; reports a settable read latency and a hot tier of 16 windows' worth."""

    hot_bytes = 16 * 4 * BATCH * (32 + 11)  # a quarter holds 16 batches
    row_bytes = 32

    def __init__(self, per_row: float) -> None:
        self.per_row = per_row
        self.hints = 0

    def upcoming(self, ids) -> None:
        self.hints += 1

    def read_seconds_per_row(self) -> float:
        return self.per_row


@pytest.fixture
def clock(monkeypatch):
    """Each step of training takes 10 ms."""
    now = [0.0]
    monkeypatch.setattr(la, "_clock", lambda: now[0])
    return now


def _run(store, clock, lookahead=None) -> tuple[list, list[int]]:
    sampler = LookaheadSampler(BatchSampler(SequentialSampler(range(BATCH * BATCHES)), BATCH, False), store,
                               lookahead=lookahead)
    items, ahead = [], []
    for i, item in enumerate(sampler):
        items.append(item)
        ahead.append(store.hints - (i + 1))  # batches announced beyond the one yielded
        clock[0] += 0.010
    return items, ahead


@pytest.mark.parametrize("per_row, want", [
    (1e-9, 2),  # rows come up in nanoseconds (page cache): one batch ahead, and the next
    (1e-3 / BATCH * 30, 4),  # a batch takes 30 ms against 10 ms steps: ceil(3) + 1
    (1e-3 / BATCH * 95, 11),  # 95 ms: ceil(9.5) + 1
    (1.0, 16),  # far slower than training: the hot tier's quarter bounds it
])
def test_window_follows_measured_latency(clock, per_row, want):
    store = Store(per_row)
    items, ahead = _run(store, clock)
    steady = ahead[100:150]  # after the window settled, before the epoch's end drains it
    assert set(steady) == {want}, (per_row, want, steady[:10])


def test_no_read_measured_yet_keeps_the_budget_window_and_a_given_lookahead_is_fixed(clock):
    store = Store(float("nan"))
    _, ahead = _run(store, clock)
    assert set(ahead[1:150]) == {16}
    store = Store(1e-9)
    _, ahead = _run(store, clock, lookahead=5)
    assert set(ahead[1:150]) == {5}


def test_the_items_are_the_wrapped_samplers_whatever_the_window(clock):
    want = list(BatchSampler(SequentialSampler(range(BATCH * BATCHES)), BATCH, False))
    for per_row in (1e-9, 1e-3 / BATCH * 30, 1.0, float("nan")):
        items, _ = _run(Store(per_row), clock)
        assert items == want


def test_a_real_store_measures_its_reads(tmp_path):
    n, dim = 4096, 8
    with EmbeddingStore.create(tmp_path / "s", n, dim, hot_bytes=256 * (dim * 4 + 11), init="zeros") as s:
        assert math.isnan(s.read_seconds_per_row())
        s.update(torch.arange(n), torch.ones(n, dim))
        s.flush()
        s.get(torch.arange(0, n, 7))  # rows below the hot tier
        per_row = s.read_seconds_per_row()
        assert 0 < per_row < 0.01, per_row


def test_in_chunk_order_the_window_is_at_least_half_a_sampler_window(clock):
    """Over a `ChunkShuffleSampler` the next window's chunks must be announced while the current
    window trains, however short the reads the training thread waits for."""
    from lightning_embcache import ChunkShuffleSampler

    n, chunk, window = BATCH * BATCHES, 256, 4  # 16 batches a window: at least 8 ahead
    for per_row, want in ((1e-9, 8), (1e-3 / BATCH * 95, 11), (1.0, 16)):
        store = Store(per_row)
        batches = BatchSampler(ChunkShuffleSampler(n, chunk_rows=chunk, window=window, seed=0), BATCH, False)
        sampler = LookaheadSampler(batches, store)
        ahead = []
        for i, _ in enumerate(sampler):
            ahead.append(store.hints - (i + 1))
            clock[0] += 0.010
        assert set(ahead[100:150]) == {want}, (per_row, want, ahead[100:110])
        assert list(sampler) == list(batches)  # the order is the sampler's
