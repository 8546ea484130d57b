"""A training step's cost follows the batch, never the table.

A store with optimizer fields keeps each field as a strided view of its record pool, and numpy's
`take` on a non-contiguous array first copies the whole array: a step on a 300 MB table once cost
0.4 s per field. These tests count the bytes a step allocates (tracemalloc sees numpy's buffers),
so a whole-table copy fails them however fast the machine is.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from lightning_embcache import EmbeddingStore, TrainableRows, make_row_optimizer, trainable_fields

BATCH, DIM = 256, 32


def _step_peak_bytes(store: EmbeddingStore, rows: TrainableRows, ids: torch.Tensor, step: int) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        z = rows.lookup(ids)
        (z * z).sum().backward()
        rows.apply(step=step)
        rows.settle()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["adam", "adagrad", "sgd"])
@pytest.mark.parametrize("hot", ["memory", "disk"])
def test_a_step_allocates_what_the_batch_needs_not_the_table(tmp_path, name, hot):
    opt = make_row_optimizer(name, lr=0.01)
    num_rows = 100_000
    store = EmbeddingStore.create(tmp_path / "s", num_rows, DIM, init="normal",
                                  hot_bytes=None if hot == "memory" else 8 << 20,
                                  fields=trainable_fields(opt, DIM, torch.float32))
    table_bytes = num_rows * store.row_bytes
    rows = TrainableRows(store, opt)
    g = torch.Generator().manual_seed(0)
    # warm up: load every chunk, so the measured steps are the steady state
    store.get(torch.arange(num_rows))
    peaks = []
    for step in range(1, 6):
        ids = torch.randint(0, num_rows, (BATCH,), generator=g)
        peaks.append(_step_peak_bytes(store, rows, ids, step))
    batch_bytes = BATCH * store.row_bytes
    # a handful of batch-sized temporaries, never anything near the table (tens of MB here)
    assert max(peaks) < 40 * batch_bytes, (max(peaks), batch_bytes, table_bytes)
    assert max(peaks) < table_bytes // 20
    store.close()


def test_get_fields_of_a_multi_field_store_does_not_copy_the_table(tmp_path):
    opt = make_row_optimizer("adam", lr=0.01)
    store = EmbeddingStore.create(None, 100_000, DIM, fields=trainable_fields(opt, DIM, torch.float32))
    ids = torch.randint(0, 100_000, (BATCH,))
    store.get_fields(ids, ("weight", "exp_avg"))
    tracemalloc.start()
    try:
        store.get_fields(ids, ("weight", "exp_avg", "exp_avg_sq", "last_step"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * BATCH * store.row_bytes
    store.close()
