"""A background pass waits for a compaction process that is starting by blocking on its pipe
(`FoldProcess.wait_ready`), not by polling: it wakes when the child is up, when the child dies,
and when the store closes (`FoldProcess.interrupt`, called by `Versions.wake`)."""

from __future__ import annotations

import os
import signal
import threading

import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import compaction, foldproc

N, DIM, CHUNK = 4096, 8, 64


def _store(path) -> EmbeddingStore:
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK)
    s.update(torch.arange(N), torch.ones(N, DIM))
    s.flush()
    return s


def _start(store: EmbeddingStore) -> foldproc.FoldProcess:
    disk = store._versions.disk
    return foldproc.FoldProcess(disk.root, N, CHUNK, store.row_bytes, disk.uid, unbound=disk.unbound)


def _never_ready(monkeypatch) -> None:
    """Children that start but never say they are ready (they sleep until killed)."""
    monkeypatch.setattr(foldproc, "_BOOT", "import time\ntime.sleep(3600)\n")


def _kill(proc: foldproc.FoldProcess) -> None:
    """End a child that never came up (it sleeps, and serves no stop request)."""
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _returns(fn, *args, name: str | None = None) -> list:
    """Run ``fn(*args)`` in a thread; its result once it returned (a hang fails the test)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True, name=name)
    t.start()
    t.join(120)  # a bound on a hang only: every call here returns on an event the test makes
    assert not t.is_alive(), f"{fn.__name__} did not return"
    return out


def test_wait_ready_returns_once_the_child_is_up(tmp_path):
    with _store(tmp_path / "s") as s:
        proc = _start(s)
        try:
            assert _returns(proc.wait_ready, 3600.0) == [True]
            assert proc.usable() and not proc.broken
        finally:
            proc.close()


def test_wait_ready_returns_when_interrupted(tmp_path, monkeypatch):
    _never_ready(monkeypatch)
    with _store(tmp_path / "s") as s:
        proc = _start(s)
        try:
            proc.interrupt()
            assert _returns(proc.wait_ready, 3600.0) == [False]
            assert not proc.usable() and not proc.broken  # still starting, as far as it knows
        finally:
            proc.close()
            _kill(proc)


def test_wait_ready_returns_when_the_child_dies(tmp_path, monkeypatch):
    monkeypatch.setattr(foldproc, "_BOOT", "raise SystemExit(3)\n")
    with _store(tmp_path / "s") as s:
        proc = _start(s)
        try:
            assert _returns(proc.wait_ready, 3600.0) == [False]
            assert proc.broken
        finally:
            proc.close()


def test_a_pass_waits_for_the_process_without_polling(tmp_path, monkeypatch):
    """The pass's wait for a starting child sleeps never: it blocks on the child's pipe."""
    monkeypatch.setenv(foldproc.ENV, "always")
    with _store(tmp_path / "s") as s:
        c = s._versions.compaction
        c.fold_process()  # starting
        assert c.fold_proc is not None

        real_sleep, slept = compaction.time.sleep, []

        def no_sleep(seconds: float) -> None:
            # (time.sleep is one function for every thread: the store's own threads sleep on)
            if threading.current_thread().name == "await-fold-process":
                slept.append(seconds)
                raise AssertionError(f"the wait for the compaction process polled (sleep({seconds}))")
            real_sleep(seconds)

        monkeypatch.setattr(compaction.time, "sleep", no_sleep)
        _returns(c._await_fold_process, name="await-fold-process")
        monkeypatch.undo()
        assert not slept
        assert c.fold_process() is not None, "the pass went on before the process was up"


def test_close_ends_a_wait_for_a_process_that_never_comes_up(tmp_path, monkeypatch):
    """A store closed while passes wait for a child still starting does not wait for that child:
    every wait is interrupted, then sees the store closed (two wait here: the pass its flush
    started in the background, and the one this test runs)."""
    monkeypatch.setenv(foldproc.ENV, "always")
    _never_ready(monkeypatch)
    monkeypatch.setattr(foldproc, "START_WAIT_S", 3600.0)
    s = _store(tmp_path / "s")
    c = s._versions.compaction
    c.fold_process()
    assert c.fold_proc is not None
    child = c.fold_proc
    try:
        waiting = threading.Event()
        real = foldproc.FoldProcess.wait_ready

        def wait_ready(self, timeout):
            waiting.set()
            return real(self, timeout)

        monkeypatch.setattr(foldproc.FoldProcess, "wait_ready", wait_ready)
        t = threading.Thread(target=c._await_fold_process, daemon=True)
        t.start()
        assert waiting.wait(120)
        _returns(s.close)
        t.join(120)
        assert not t.is_alive(), "the pass still waits for the process after close()"
    finally:
        s.close()
        _kill(child)

