"""A flush leaves out of its version every segment all of whose rows were flushed again since:
rows flushed over and over (a hot set) keep one segment on disk and never need a compaction,
while every version (the newest, a pinned older one, one reopened after close) reads exactly
what was flushed into it."""

from __future__ import annotations

import os

import numpy as np
import torch
from _store_helpers import assert_bitwise_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import EmbeddingStore

N, DIM, CHUNK = 4096, 8, 128
ROW = DIM * 4


def _segments(path) -> list[str]:
    return [n for n in os.listdir(path / "segments") if not n.startswith(".")]


def test_a_hot_set_flushed_again_and_again_keeps_one_segment(tmp_path):
    path = tmp_path / "s"
    table = torch.zeros(N, DIM)
    hot_set = torch.from_numpy(np.random.default_rng(0).choice(N, N // 20, replace=False))
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=N * ROW // 4, init="zeros") as s:
        for k in range(60):  # 60 x 5% of the rows: 3 tables' worth of segments without the drop
            values = torch.full((len(hot_set), DIM), float(k))
            s.update(hot_set, values)
            table[hot_set] = values
            s.flush()
            assert s.stats().segments == 1, s.stats()  # the version lists the newest segment only
        s._wait_bg()  # garbage collection deletes the others in the background
        assert len(_segments(path)) == 1, _segments(path)
        st_ = s.stats()
        assert st_.superseded_segments >= 58 and st_.compactions == 0, st_
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows")
    with EmbeddingStore.open(path) as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after reopening")


def test_a_pinned_version_keeps_the_segments_a_later_flush_left_out(tmp_path):
    path = tmp_path / "s"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=N * ROW // 4, init="zeros") as s:
        ids = torch.arange(0, N, 7)
        s.update(ids, torch.ones(len(ids), DIM))
        pinned = s.flush()
        s.pin(pinned)
        at_pin = s.get(torch.arange(N)).clone()
        for k in range(3):
            s.update(ids, torch.full((len(ids), DIM), 10.0 + k))
            s.flush()
        assert s.stats().superseded_segments >= 1
        with EmbeddingStore.open(path, version=pinned, readonly=True) as old:
            assert_bitwise_equal(old.get(torch.arange(N)), at_pin, f"rows of pinned version {pinned}")


@st.composite
def _ops(draw):
    ops = []
    for _ in range(draw(st.integers(4, 14))):
        kind = draw(st.sampled_from(["update_hot", "update_hot", "update_any", "flush", "flush", "evict", "reopen"]))
        ops.append((kind, draw(st.integers(0, 2**31 - 1))))
    return ops


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops())
def test_versions_read_what_was_flushed_whatever_the_sequence(tmp_path_factory, ops):
    """Against a dict of flushed rows per version: updates of a small hot set (segments that
    the next flushes supersede) mixed with updates anywhere, write-backs of evicted rows
    (pending segments a flush may leave out), reopening; every retained version reads its rows."""
    path = tmp_path_factory.mktemp("s") / "s"
    hot_set = np.arange(0, N, 512)  # 8 rows: flushes supersede segments wholly and partly
    live = torch.zeros(N, DIM)  # what the store holds now
    flushed: dict[int, torch.Tensor] = {}
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=64 * (ROW + 32), init="zeros")
    try:
        for kind, seed in ops:
            rng = np.random.default_rng(seed)
            if kind.startswith("update"):
                ids = rng.choice(hot_set, 5) if kind == "update_hot" else rng.integers(0, N, 30)
                values = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
                s.update(torch.from_numpy(ids), values)
                for i, r in enumerate(ids.tolist()):
                    live[r] = values[i]
            elif kind == "flush":
                v = s.flush()
                flushed[v] = live.clone()
                s.pin(v)  # keep every version, to read each one back
            elif kind == "evict":
                s.evict(1 << 30)  # dirty rows written back into a pending segment
            else:
                s.flush()
                flushed[s.version] = live.clone()
                s.pin(s.version)
                s.close()
                s = EmbeddingStore.open(path, hot_bytes=64 * (ROW + 32))
            assert_bitwise_equal(s.get(torch.arange(N)), live, f"rows after {kind}")
        for v, want in flushed.items():
            with EmbeddingStore.open(path, version=v, readonly=True) as old:
                assert_bitwise_equal(old.get(torch.arange(N)), want, f"rows of version {v}")
    finally:
        s.close()
