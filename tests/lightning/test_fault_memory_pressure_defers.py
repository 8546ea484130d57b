"""MemoryPressure never raises into the fit it protects: a store that refuses (busy with a flush,
closed, a write-back failing) is asked again at the next check."""

from __future__ import annotations

import threading
from pathlib import Path
from unittest import mock

import torch

from lightning_embcache import EmbeddingStore, MemoryPressure
from lightning_embcache.lightning.memory_reading import MemoryReading
from lightning_embcache.store.errors import DiskFullError, StoreBusyError, StoreClosedError

GiB, MiB = 1 << 30, 1 << 20


def _reading(fraction: float, total: int = 4 * GiB) -> MemoryReading:
    return MemoryReading(total, int(total * (1 - fraction)), 100 * MiB)


def _handle(store):
    h = mock.Mock()
    h.name, h.path, h.store = "a", Path("/x/a"), store
    h._is_open.return_value = True
    h.stats.return_value = mock.Mock(hot_bytes=256 * MiB, warm_bytes=0, hot_budget_bytes=256 * MiB)
    return h


def test_store_errors_from_evict_and_set_budget_are_deferred_not_raised():
    store = mock.Mock()
    store.evict.side_effect = DiskFullError(28, "disk full (injected)")
    store.set_budget.side_effect = StoreBusyError("set_budget() cannot shrink the hot tier while a flush is writing")
    cb = MemoryPressure(reader=lambda: _reading(0.99), min_hot_bytes=16 * MiB)
    trainer = mock.Mock(loggers=[], global_step=1)
    module = mock.Mock(embedding_stores={"a": _handle(store)})
    for _ in range(3):
        assert cb.check(trainer, module) == 0
    assert cb.deferred >= 3 and store.set_budget.call_count == 3
    store.set_budget.side_effect = None  # the store is free again: the next check applies the cut
    store.evict.side_effect = lambda n: 0
    cb.check(trainer, module)
    store.set_budget.assert_called_with(hot_bytes=16 * MiB)
    store.evict.side_effect = StoreClosedError("closed")
    cb.check(trainer, module)


def test_set_budget_waits_for_a_flush_in_progress_instead_of_raising(tmp_path):
    """The flush holds the writer lock while its rows are in flight; set_budget() waits for it
    (it used to raise 'cannot shrink the hot tier while a flush is writing')."""
    dim = 16
    store = EmbeddingStore.create(tmp_path / "s", 4096, dim, chunk_rows=64, hot_bytes=2048 * (dim * 4 + 11))
    store.update(torch.arange(512), torch.ones(512, dim))
    entered, release = threading.Event(), threading.Event()
    real_write = store._versions.disk.write_segment

    def slow_write(*args, **kwargs):
        entered.set()
        release.wait(10)
        return real_write(*args, **kwargs)

    store._versions.disk.write_segment = slow_write
    t = threading.Thread(target=store.flush)
    t.start()
    assert entered.wait(60)
    threading.Timer(0.2, release.set).start()
    store.set_budget(hot_bytes=64 * (dim * 4 + 11))
    assert release.is_set()  # it returned only after the flush was let go: it waited for it
    t.join(10)
    assert store.stats().hot_budget_bytes <= 64 * (dim * 4 + 11)
    assert torch.equal(store.get(torch.arange(512)), torch.ones(512, dim))
    store.close()
