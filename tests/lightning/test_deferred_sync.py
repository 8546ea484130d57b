"""DeferredSync: intervals, coalescing, flush before every checkpoint, logged keys."""

from __future__ import annotations

import threading
import time
from unittest import mock

import pytest
import torch
from _lightning_helpers import tiny_model, tiny_trainer
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_embcache import DeferredSync, EmbeddingStore
from lightning_embcache.lightning.flush_worker import CoalescingWorker


class FlushSpy:
    """Wraps a handle's flush: records the step and thread of every call, optionally slowly."""

    def __init__(self, model, trainer_ref, delay=0.0, gate=None):
        self.handle = model.latents
        self.gate = gate  # background calls wait for it: the test decides how long a flush takes
        self.real = type(self.handle).flush.__get__(self.handle)
        self.trainer_ref = trainer_ref
        self.delay = delay
        self.calls = []
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()
        self.handle.flush = self

    def __call__(self):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if self.delay:
                time.sleep(self.delay)
            if self.gate is not None and threading.current_thread() is not threading.main_thread():
                assert self.gate.wait(60), "the test never opened the gate"
            step = self.trainer_ref[0].global_step if self.trainer_ref else None
            self.calls.append((step, threading.current_thread() is threading.main_thread()))
            return self.real()
        finally:
            with self.lock:
                self.active -= 1


def _run(tmp_path, sync, steps, *extra, delay=0.0, gate=None, **kw):
    model = tiny_model(tmp_path / "latents")
    ref = []
    spy = FlushSpy(model, ref, delay, gate)
    trainer = tiny_trainer(tmp_path, callbacks=[sync, *extra], max_steps=steps, **kw)
    ref.append(trainer)
    trainer.fit(model)
    return model, spy, trainer


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        DeferredSync(every_n_steps=0)
    with pytest.raises(ValueError, match="every_n_epochs=-1"):
        DeferredSync(every_n_epochs=-1)


def test_flushes_every_n_steps_and_at_fit_end(tmp_path):
    sync = DeferredSync(every_n_steps=3, every_n_epochs=None, background=False)
    _, spy, _ = _run(tmp_path, sync, 10)
    steps = [s for s, _ in spy.calls]
    assert steps[:3] == [3, 6, 9]
    assert steps[3:] == [10, 10]  # DeferredSync at fit end, then the mixin's own (nothing left: no new version)


def test_flushes_every_n_epochs(tmp_path):
    sync = DeferredSync(every_n_steps=None, every_n_epochs=2, background=False)
    _, spy, _ = _run(tmp_path, sync, 24, max_epochs=3)  # 8 steps per epoch
    assert [s for s, _ in spy.calls][:1] == [16]


def test_background_flush_runs_off_the_training_thread(tmp_path):
    sync = DeferredSync(every_n_steps=2, every_n_epochs=None, background=True)
    _, spy, _ = _run(tmp_path, sync, 6)
    on_main = [main for _, main in spy.calls]
    assert False in on_main  # interval flushes in the worker
    assert on_main[-1] is True  # the fit-end flush on the training thread


class _OpenGateAt(Callback):
    def __init__(self, gate: threading.Event, step: int) -> None:
        self.gate, self.step = gate, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            self.gate.set()


def test_slow_flushes_are_coalesced_never_queued(tmp_path):
    """The first background flush is held until step 12 (a gate, not a sleep): the requests of
    steps 2-12 meanwhile leave one run pending and coalesce the rest, whatever the host's speed."""
    gate = threading.Event()
    sync = DeferredSync(every_n_steps=1, every_n_epochs=None, background=True)
    _, spy, _ = _run(tmp_path, sync, 16, _OpenGateAt(gate, 12), gate=gate)
    assert spy.max_active == 1
    background = [c for c in spy.calls if not c[1]]
    assert sync.coalesced >= 12 - 2  # steps 2..12 found a run in flight and one already pending
    assert len(background) < 16
    assert len(background) + sync.coalesced <= 16


def test_coalescing_worker_keeps_at_most_one_pending_run():
    started, release = threading.Event(), threading.Event()
    runs = []

    def job():
        started.set()
        release.wait(5)
        runs.append(1)
        return len(runs)

    worker = CoalescingWorker(job)
    assert worker.request() is True
    started.wait(5)
    assert worker.request() is True  # one pending behind the running one
    assert [worker.request() for _ in range(10)] == [False] * 10
    release.set()
    worker.wait_idle()
    assert worker.drain() == [1, 2] and worker.coalesced == 10
    worker.stop()


def test_an_error_in_a_background_flush_reaches_the_training_thread():
    worker = CoalescingWorker(lambda: 1 / 0)
    worker.request()
    with pytest.raises(ZeroDivisionError):
        worker.wait_idle()
    worker.stop()


def test_flush_completes_before_each_checkpoint_is_written(tmp_path, monkeypatch):
    events = []
    real_save = TorchCheckpointIO.save_checkpoint

    def save(self, checkpoint, path, storage_options=None):
        events.append(("save", checkpoint["embedding_stores"]["latents"]["version"], sync._worker.busy))
        return real_save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", save)

    class Rows(Callback):  # the rows as the training thread sees them when the checkpoint is taken
        rows = {}

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            events.append(("hook", trainer.global_step))
            self.rows[trainer.global_step] = pl_module.latents.get(torch.arange(512))

    sync = DeferredSync(every_n_steps=1, every_n_epochs=None, background=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    model, spy, _ = _run(tmp_path, sync, 9, Rows(), ckpt, delay=0.05, enable_checkpointing=True)
    saves = [e for e in events if e[0] == "save"]
    assert len(saves) == 3
    assert all(busy is False for _, _, busy in saves)  # no background flush runs while a file is written
    for (_, version, _), step in zip(saves, (3, 6, 9)):
        with EmbeddingStore.open(tmp_path / "latents", version=version, readonly=True) as store:
            assert torch.equal(store.get(torch.arange(512)), Rows.rows[step])


def test_logs_exactly_its_three_keys(tmp_path):
    logger = mock.Mock()
    logger.save_dir = logger.log_dir = str(tmp_path)
    logger.name, logger.version = "mock", 0
    sync = DeferredSync(every_n_steps=2, every_n_epochs=None, background=False)
    _run(tmp_path, sync, 4, logger=logger)
    keys = set()
    for call in logger.log_metrics.call_args_list:
        keys |= {k for k in call.args[0] if k.startswith("embcache/")}
    assert keys == {"embcache/sync_seconds", "embcache/synced_rows", "embcache/dirty_rows"}
    first = next(c.args[0] for c in logger.log_metrics.call_args_list if "embcache/synced_rows" in c.args[0])
    assert first["embcache/synced_rows"] == 128  # batch 2: two batches of 64 distinct rows made durable
    assert first["embcache/dirty_rows"] == 0  # a flush on the training thread leaves nothing behind
    assert first["embcache/sync_seconds"] > 0
