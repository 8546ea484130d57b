"""The store's side of a device writing a memory-mode table in place (`mapped_host`): rows a
device write queued are dirty at once, every host read waits for the write to land first, a
flush's snapshot never changes under it, and disk mode or a readonly handle refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.mapped_host import MappedHost

N, DIM = 1000, 4


class _LateWrite:
    """Stands in for a device write: the rows land only when someone waits for it."""

    def __init__(self, table: torch.Tensor, ids: np.ndarray, records: np.ndarray) -> None:
        self.table, self.ids, self.records, self.waits = table, ids, records, 0

    def synchronize(self) -> None:
        self.waits += 1
        self.table.numpy()[self.ids] = self.records


def _queue(store, ids, value):
    recs = store.read_records(torch.from_numpy(ids)).numpy().copy()
    store.record_view(torch.from_numpy(recs), "weight")[:] = value
    late = _LateWrite(store._resident_table(), ids, recs)
    assert store._device_write(ids, lambda: late)
    return late


def test_host_reads_and_flushes_see_a_queued_device_write_whole(tmp_path):
    store = EmbeddingStore.create(tmp_path / "s", N, DIM, init="zeros", chunk_rows=64)
    ids = np.array([3, 500, 999])
    late = _queue(store, ids, 7.0)
    assert late.waits == 0  # queued, not waited for
    assert (store.get(torch.from_numpy(ids)) == 7.0).all() and late.waits == 1
    late = _queue(store, np.array([10, 11]), 9.0)
    version = store.flush()  # the snapshot waits for the write, then writes the rows as dirty
    assert late.waits == 1
    store.close()
    again = EmbeddingStore.open(tmp_path / "s", version=version, readonly=True)
    got = again.get(torch.tensor([3, 500, 999, 10, 11, 12]))
    assert got[:3].eq(7.0).all() and got[3:5].eq(9.0).all() and got[5].eq(0.0).all()
    again.close()


def test_close_waits_for_a_queued_device_write(tmp_path):
    store = EmbeddingStore.create(tmp_path / "s", N, DIM, init="zeros", chunk_rows=64)
    late = _queue(store, np.array([1]), 1.0)
    store.close()
    assert late.waits == 1


def test_no_device_write_while_a_flush_copies_rows_out(tmp_path):
    store = EmbeddingStore.create(tmp_path / "s", N, DIM, init="zeros", chunk_rows=64)
    with store._core.lock:
        store._tiers.cow = {}  # what a flush's snapshot holds while it writes
        called = []
        assert not store._device_write(np.array([1]), lambda: called.append(1))
        store._tiers.cow = None
    assert not called and store.unflushed_share == 0
    store.close()


@pytest.mark.parametrize("how", ["disk", "readonly"])
def test_disk_mode_and_readonly_handles_offer_no_table(tmp_path, how):
    store = EmbeddingStore.create(tmp_path / "s", N, DIM, init="zeros", chunk_rows=64,
                                  hot_bytes=100 * 16 if how == "disk" else None)
    store.flush()
    if how == "readonly":
        store.close()
        store = EmbeddingStore.open(tmp_path / "s", readonly=True)
    assert store._resident_table() is None
    store.close()


def test_without_cuda_nothing_is_registered():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert MappedHost.try_register(torch.zeros(4, 8, dtype=torch.uint8), torch.device("cuda")) is None


def test_kernels_queued_in_a_writing_block_mark_rows_dirty_and_keep_a_flush_snapshot_whole(tmp_path):
    """`_device_writing`: a device trains rows in the table in place. While a flush's snapshot is
    open, rows it still has to copy are saved before the block, so the version it writes is the
    table at its start, not a later step's."""
    store = EmbeddingStore.create(tmp_path / "s", N, DIM, init="zeros", chunk_rows=64)
    ids = np.array([2, 4, 6])
    table = store._resident_table()

    def device_step(value):
        recs = table.numpy()[ids].copy()
        store.record_view(torch.from_numpy(recs), "weight")[:] = value
        late = _LateWrite(table, ids, recs)
        with store._device_writing(ids) as queued:
            queued(late)
        return late

    device_step(1.0)
    with store._core.lock:  # a flush's snapshot opens (the flush thread holds the lock for it)
        slots = np.flatnonzero(store._tiers.hot.dirty)
        assert set(slots.tolist()) == {2, 4, 6}
        store._tiers.hot.inflight[slots] = True
        read = store._tiers.writeback._snapshot_reader(slots)
    late = device_step(2.0)  # the next step, while the flush writes: its old rows are saved
    late.synchronize()  # the device ran it
    with store._core.lock:
        snap = read.read_into(0, len(slots), np.empty((len(slots), table.shape[1]), np.uint8))
        store._tiers.hot.inflight[slots] = False
        store._tiers.cow = None
    assert store.record_view(torch.from_numpy(snap), "weight").eq(1.0).all()
    assert store.get(torch.from_numpy(ids)).eq(2.0).all()
    store.close()
