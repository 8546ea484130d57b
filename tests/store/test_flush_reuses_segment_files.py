"""A large flush overwrites the segment file compaction dropped instead of creating a new one
(segpool.py); the rows stay those of a plain tensor model, through reopens, and no read of this
process ever sees a segment file while it is reused."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from _store_helpers import InlineExecutor, assert_bitwise_equal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lightning_embcache import EmbeddingStore
from lightning_embcache.store.disk import SEGMENT_RE
from lightning_embcache.store.segpool import SEGMENT_POOL_PREFIX

N, DIM, CHUNK = 4096, 8, 64


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    monkeypatch.setenv("EMBCACHE_COMPACTION_PROCESS", "never")


def _inline_background(monkeypatch) -> None:
    """Background compaction runs inside the flush that starts it, so a sequence replays exactly."""
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_embcache.store") and hasattr(module, "ThreadPoolExecutor"):
            monkeypatch.setattr(module, "ThreadPoolExecutor", InlineExecutor)


def _pooled(path) -> list[str]:
    return [n for n in os.listdir(path / "segments") if n.startswith(SEGMENT_POOL_PREFIX)]


def _check_folder(path) -> None:
    """segments/ holds segment files and at most one pooled file, nothing else."""
    names = os.listdir(path / "segments")
    odd = [n for n in names if not (SEGMENT_RE.match(n) or n.startswith(SEGMENT_POOL_PREFIX))]
    assert not odd, odd
    assert len(_pooled(path)) <= 1, names


def _update(store, table: torch.Tensor, rng, frac: float) -> None:
    ids = np.sort(rng.choice(N, int(N * frac), replace=False))
    values = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
    store.update(torch.from_numpy(ids), values)
    table[torch.from_numpy(ids)] = values


def _create(path) -> EmbeddingStore:
    return EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, init="zeros")


def test_large_flushes_overwrite_the_segment_compaction_dropped(tmp_path):
    path = tmp_path / "s"
    table = torch.zeros(N, DIM)
    rng = np.random.default_rng(0)
    with _create(path) as s:
        seg_pool = s._versions.disk.segment_pool
        for step in range(6):
            _update(s, table, rng, 0.5)
            s.flush()
            s._wait_bg()  # the background pass folds the segment and drops it into the pool
            _check_folder(path)
            assert_bitwise_equal(s.get(torch.arange(N)), table, f"rows after flush {step}")
        assert seg_pool.pooled >= 5 and seg_pool.reused >= 4, (seg_pool.pooled, seg_pool.reused)
    assert not _pooled(path), "close() leaves no pooled file behind"
    with EmbeddingStore.open(path) as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after reopening")


def test_reuse_waits_for_reads_that_began_before(tmp_path):
    """A read that began before compaction dropped a segment (a prefetch planned then) keeps that
    file from being overwritten: the next flush writes a new file; once the read ends, reuse
    resumes."""
    path = tmp_path / "s"
    table = torch.zeros(N, DIM)
    rng = np.random.default_rng(1)
    with _create(path) as s:
        disk = s._versions.disk
        _update(s, table, rng, 0.5)
        s.flush()
        s._wait_bg()
        # a read (of the layout that will list the next segment) the kernel runs in the
        # background: registered like a prefetch's, without holding off compaction's folds
        epoch = disk.pool.begin_async_read()
        _update(s, table, rng, 0.5)
        s.flush()  # reuses the file pooled before the read began
        s._wait_bg()  # drops this flush's segment into the pool, sealed after the read began
        reused = disk.segment_pool.reused
        assert len(disk.segment_pool) == 1
        _update(s, table, rng, 0.5)
        s.flush()
        assert disk.segment_pool.reused == reused, "a segment file a running read may reach was overwritten"
        disk.pool.end_async_read(epoch)
        s._wait_bg()
        _update(s, table, rng, 0.5)
        s.flush()
        assert disk.segment_pool.reused == reused + 1
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows")


def test_explicit_compact_gives_the_pooled_file_back(tmp_path):
    path = tmp_path / "s"
    table = torch.zeros(N, DIM)
    rng = np.random.default_rng(2)
    with _create(path) as s:
        _update(s, table, rng, 0.5)
        s.flush()
        s._wait_bg()
        assert len(_pooled(path)) == 1
        s.compact()
        assert not os.listdir(path / "segments")
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows")


def test_a_pooled_file_far_larger_than_the_flush_is_left_for_the_next_drop(tmp_path):
    """A flush much smaller than the pooled file writes a new file (cutting the pooled one to
    length would free most of it: the cost of a delete on the flush's time, none of the gain of
    reuse); the next segment dropped takes its place, and the large file is deleted then."""
    path = tmp_path / "s"
    table = torch.zeros(N, DIM)
    rng = np.random.default_rng(3)
    with _create(path) as s:
        disk = s._versions.disk
        _update(s, table, rng, 1.0)
        s.flush()
        s._wait_bg()
        assert len(disk.segment_pool) == 1
        big = _pooled(path)
        _update(s, table, rng, 0.05)
        s.flush()
        assert disk.segment_pool.reused == 0 and _pooled(path) == big
        s._wait_bg()
        _update(s, table, rng, 0.5)
        s.flush()
        s._wait_bg()
        assert len(_pooled(path)) == 1 and _pooled(path) != big  # reused or replaced by a newer drop
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows")


def test_a_forked_child_never_touches_the_writers_pooled_segment(tmp_path):
    from _store_helpers import in_forked_child

    from lightning_embcache.store.recycle import FilePool
    from lightning_embcache.store.segpool import SegmentPool

    (tmp_path / "s000000000001").write_bytes(b"x" * 4096)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        pool = SegmentPool(fd, FilePool(fd))
        assert pool.put("s000000000001")
        in_forked_child(pool.close)
        assert len([n for n in os.listdir(tmp_path) if n.startswith(SEGMENT_POOL_PREFIX)]) == 1
        assert pool.take(4096) is not None
        pool.close()
    finally:
        os.close(fd)


def test_a_symlink_in_place_of_a_dropped_segment_is_never_pooled(tmp_path):
    from lightning_embcache.store.recycle import FilePool
    from lightning_embcache.store.segpool import SegmentPool

    target = tmp_path / "outside"
    target.write_bytes(b"x" * 4096)
    (tmp_path / "s000000000001").symlink_to(target)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        pool = SegmentPool(fd, FilePool(fd))
        assert not pool.put("s000000000001")
        assert len(pool) == 0 and target.read_bytes() == b"x" * 4096
    finally:
        os.close(fd)


class FlushCompactReopen(RuleBasedStateMachine):
    """Updates of a few rows or half the table, flushes (background compaction inline), explicit
    compactions and reopens, against a tensor: every get equals it, and a reopen equals the last
    flush."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="embcache-segpool-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.path = __import__("pathlib").Path(self.dir) / "s"
        self.table = torch.zeros(N, DIM)
        self.flushed = self.table.clone()
        self.store: EmbeddingStore | None = None
        self.reused = 0

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.store = _create(self.path)

    @rule(frac=st.sampled_from([0.01, 0.3, 0.5, 0.9]))
    def update(self, frac: float) -> None:
        _update(self.store, self.table, self.rng, frac)

    @rule()
    def flush(self) -> None:
        self.store.flush()
        self.flushed = self.table.clone()

    @rule()
    def compact(self) -> None:
        self.store.compact()
        assert not _pooled(self.path)

    @rule()
    def reopen(self) -> None:
        self.reused += self.store._versions.disk.segment_pool.reused
        self.store.close()
        assert not _pooled(self.path)
        self.store = EmbeddingStore.open(self.path)
        self.table = self.flushed.clone()  # close() flushes nothing: the last flush is what stays
        assert_bitwise_equal(self.store.get(torch.arange(N)), self.flushed, "rows after reopening")

    @invariant()
    def rows_match(self) -> None:
        if self.store is not None:
            _check_folder(self.path)
            assert_bitwise_equal(self.store.get(torch.arange(N)), self.table, "rows")

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def test_flushes_compactions_and_reopens_match_a_tensor(monkeypatch):
    _inline_background(monkeypatch)
    machine = FlushCompactReopen.TestCase
    machine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None,
                                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    machine().runTest()
