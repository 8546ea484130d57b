"""Compaction rounds folded by the compaction process (foldproc.py): the same rows as folding in
the store's own thread, a flush never waits for a background round's fold, a dead or failing
process only sends rounds back to the store's thread, a killed writer takes its process with it
and loses nothing, and close() ends the process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _store_helpers import alive, assert_bitwise_equal, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import compaction, foldproc, versions

N, DIM, CHUNK = 4096, 8, 64  # 64 chunks of 2 KiB
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _new_files(monkeypatch):
    """Every fold writes a new chunk file, as the process does (a fold in place runs in the
    store's own thread, under the writer lock: inplace.py)."""
    monkeypatch.setattr(compaction, "FOLD_IN_PLACE", False)


@pytest.fixture
def process_mode(monkeypatch):
    monkeypatch.setenv(foldproc.ENV, "always")
    monkeypatch.setattr(compaction, "ROUND_BYTES", 8 * CHUNK * DIM * 4)  # passes of 8 rounds


def _ready(store: EmbeddingStore) -> int:
    """Wait until the store's compaction process serves; its pid."""
    wait_for(lambda: store._versions.compaction.fold_process() is not None, 30, "the compaction process to start")
    return store._versions.compaction.fold_proc.pid


def _before_each_fold(monkeypatch, hook) -> None:
    """Call ``hook()`` in the calling thread before each round the compaction process folds."""
    real_fold = foldproc.FoldProcess.fold

    def fold(self, *a, **k):
        hook()
        return real_fold(self, *a, **k)

    monkeypatch.setattr(foldproc.FoldProcess, "fold", fold)


def _update(store, table, ids, step) -> None:
    ids = torch.as_tensor(ids)
    values = torch.randn(len(ids), DIM, generator=torch.Generator().manual_seed(step))
    store.update(ids, values)
    table[ids] = values


def _run(path: Path, init: str, ops: list[tuple[str, int]]) -> tuple[torch.Tensor, EmbeddingStore]:
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=N * DIM * 4 // 8, init=init)
    if foldproc.wanted(0):
        _ready(store)  # every round then goes to the process (a round before it is up folds here)
    table = store.get(torch.arange(N)).clone()
    rng = np.random.default_rng(0)
    for step, (op, arg) in enumerate(ops):
        if op == "update":
            _update(store, table, rng.choice(N, arg, replace=False), step)
        elif op == "flush":
            store.flush()
        else:
            store.compact()
    store.flush()
    return table, store


def test_process_folds_the_same_rows_as_the_store_thread(tmp_path, process_mode, monkeypatch):
    """Dense and sparse chunks (init='normal': chunks written sparsely stay sparse until half
    their rows are written, then need initial values the process leaves to the store)."""
    ops = [("update", 3000), ("flush", 0), ("compact", 0), ("update", 40), ("flush", 0), ("compact", 0),
           ("update", 2500), ("flush", 0), ("update", 900), ("flush", 0), ("compact", 0)]
    want, s = _run(tmp_path / "proc", "normal", ops)
    with s:
        _ready(s)
        assert_bitwise_equal(s.get(torch.arange(N)), want, "rows folded by the process")
        assert s.stats().compaction_process_chunks > 0
    monkeypatch.setenv(foldproc.ENV, "never")
    want2, s2 = _run(tmp_path / "thread", "normal", ops)
    with s2:
        assert s2.stats().compaction_process_chunks == 0
        assert_bitwise_equal(want2, want, "the same operations folded in the store's thread")
    with EmbeddingStore.open(tmp_path / "proc") as s:
        assert_bitwise_equal(s.get(torch.arange(N)), want, "rows after reopening")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["update", "flush", "compact"]), st.integers(1, N)),
                    min_size=1, max_size=12))
def test_operation_sequences_match_a_tensor_model(tmp_path_factory, process_mode, ops):
    path = tmp_path_factory.mktemp("seq") / "s"
    want, s = _run(path, "zeros", ops)
    with s:
        assert_bitwise_equal(s.get(torch.arange(N)), want)
    with EmbeddingStore.open(path) as s:
        assert_bitwise_equal(s.get(torch.arange(N)), want, "rows after reopening")


def test_a_flush_does_not_wait_for_a_background_fold(tmp_path, process_mode, monkeypatch):
    """A background round folds without the writer lock: a flush on the training thread completes
    while the fold is still running, and the round then publishes over the flush's layout."""
    s = EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK, hot_bytes=N * DIM * 4, init="zeros")
    table = torch.zeros(N, DIM)
    _ready(s)
    folding, release = threading.Event(), threading.Event()
    _before_each_fold(monkeypatch, lambda: (folding.set(), release.wait(120)))
    with s:
        for step in range(3):
            _update(s, table, np.arange(N), step)
            s.flush()  # 3 segments of the whole table: background compaction starts
        wait_for(folding.is_set, 60, "a background round")
        _update(s, table, np.arange(0, N, 3), 10)
        t = threading.Thread(target=s.flush)
        t.start()
        t.join(60)  # the fold is held until release: a flush that waited for it would still wait
        flushed_while_folding = not t.is_alive()
        release.set()
        t.join()
        assert flushed_while_folding, "the flush waited for the background round's fold"
        s.compact()
        assert_bitwise_equal(s.get(torch.arange(N)), table)
        assert s.stats().compaction_process_chunks > 0
    with EmbeddingStore.open(tmp_path / "s") as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after reopening")


def test_a_killed_process_sends_rounds_back_to_the_store(tmp_path, process_mode):
    s = EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK, hot_bytes=N * DIM * 4, init="zeros")
    table = torch.zeros(N, DIM)
    with s:
        pid = _ready(s)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not alive(pid, zombie_is_gone=True), 30, "the killed process to go")
        _update(s, table, np.arange(N), 1)
        s.flush()
        s.compact()  # the process is gone: folded here
        assert s.stats().compaction_process_failures >= 1
        assert_bitwise_equal(s.get(torch.arange(N)), table)
        pid2 = _ready(s)  # started once more
        assert pid2 != pid
        os.kill(pid2, signal.SIGKILL)
        wait_for(lambda: not alive(pid2, zombie_is_gone=True), 30, "the second killed process to go")
        for step in range(2, 4):
            _update(s, table, np.arange(0, N, step), step)
            s.flush()
            s.compact()
        time.sleep(0.5)
        assert s._versions.compaction.fold_process() is None, "a process that died twice is not started again"
        assert_bitwise_equal(s.get(torch.arange(N)), table)
    with EmbeddingStore.open(tmp_path / "s") as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after reopening")


def test_close_ends_the_process(tmp_path, process_mode):
    s = EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK, init="zeros")
    pid = _ready(s)
    assert alive(pid, zombie_is_gone=True)
    s.close()
    wait_for(lambda: not alive(pid, zombie_is_gone=True), 30, "the process to end at close()")


_WRITER = """
import os, sys, numpy as np, torch
from lightning_embcache import EmbeddingStore
path, n, dim, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = EmbeddingStore.open(path)
while s._versions.compaction.fold_process() is None:
    pass
print(s._versions.compaction.fold_proc.pid, flush=True)
step = 0
while True:
    step += 1
    ids = torch.arange(n)
    s.update(ids, torch.full((n, dim), float(step)))
    s.flush()
    print("flushed", step, flush=True)
"""


def test_a_killed_writer_takes_its_process_and_loses_nothing(tmp_path, monkeypatch):
    """kill -9 of a writer whose process folds in the background: its process dies with it, and
    reopening gives the rows of the last acknowledged flush (or of the one after it)."""
    path = tmp_path / "s"
    EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, init="zeros").close()
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", **{foldproc.ENV: "always"})
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(N), str(DIM), str(CHUNK)],
                            stdout=subprocess.PIPE, text=True, env=env)
    child = int(proc.stdout.readline())
    acked = 0
    while acked < 12:  # enough flushes that background passes run when the kill lands
        line = proc.stdout.readline()
        assert line.startswith("flushed"), line
        acked = int(line.split()[1])
    proc.kill()
    proc.wait()
    wait_for(lambda: not alive(child, zombie_is_gone=True), 30, "the compaction process to die with its writer")
    # a torn chunk write of the dead child, as a kill inside a round leaves one (the kill may or
    # may not have landed inside one)
    (path / "chunks" / f".c00000001-g00009999.tmp{child}-1").write_bytes(b"torn")
    with EmbeddingStore.open(path) as s:
        got = s.get(torch.arange(N))
        value = float(got[0, 0])
        assert value in (acked, acked + 1), (value, acked)
        assert_bitwise_equal(got, torch.full((N, DIM), value), "every row of one flush")
        # Temp files of the dead processes are gone (this handle's own background round may be
        # writing one right now: its names carry this process's pid).
        mine = re.compile(rf"(\.tmp|^\.pool-){os.getpid()}-")
        leftovers = [n for n in os.listdir(path / "chunks") if n.startswith(".") and not mine.search(n)]
        assert not leftovers, leftovers


def test_a_bad_setting_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(foldproc.ENV, "sometimes")
    with pytest.raises(ValueError, match="EMBCACHE_COMPACTION_PROCESS"):
        EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK).close()


def test_a_flush_waiting_for_a_background_round_waits_for_that_round_only(tmp_path, process_mode, monkeypatch):
    """A flush over the disk-use limit waits for the background round in progress, and the
    background pass starts no new round until the flush got in (it would otherwise go on round
    after round while the flush waits to be scheduled)."""
    monkeypatch.setattr(versions, "HARD_FLOOR", 0)  # this small table's flushes count too
    s = EmbeddingStore.create(tmp_path / "s", N, DIM, chunk_rows=CHUNK, hot_bytes=N * DIM * 4, init="zeros")
    table = torch.zeros(N, DIM)
    _ready(s)
    folding = threading.Event()
    started: list[tuple[str, float]] = []  # (thread, time) of each fold

    def note() -> None:
        started.append((threading.current_thread().name, time.perf_counter()))
        if threading.current_thread() is not threading.main_thread():
            folding.set()  # a background round is folding (without the writer lock)
            time.sleep(0.1)

    _before_each_fold(monkeypatch, note)
    with s:
        for step in range(4):
            _update(s, table, np.arange(N), step)
            s.flush()  # segments of 4 tables: a background pass of many rounds starts
        me = threading.current_thread().name
        for step in range(3):  # (whether the pass would have gone on depends on scheduling)
            _update(s, table, np.arange(step, N, 2), 10 + step)
            folding.clear()
            wait_for(folding.is_set, 60, "a background round")
            t0 = time.perf_counter()
            s.flush()  # over the limit: it waits for the round in progress, then folds itself
            t1 = time.perf_counter()
            own = [at for name, at in started if name == me and t0 < at < t1]
            assert own, "the flush was not over the limit: it folded nothing itself"
            # up to the flush's own last round (it holds the writer lock then; once it lets go,
            # a background round may start before this thread reads the clock)
            background = [at for name, at in started if name != me and t0 < at < own[-1]]
            assert not background, f"{len(background)} background rounds started while flush {step} waited"
        s.compact()
        assert_bitwise_equal(s.get(torch.arange(N)), table)
    with EmbeddingStore.open(tmp_path / "s") as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after reopening")
