"""Running out of GPU memory raises the store's `OutOfMemoryError` naming device_bytes, never a
raw CUDA error, and leaves the rows as they were: at the tier's creation (a table beyond the
GPU) and inside a training step (the GPU filled by something else)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_embcache import (
    EmbeddingStore,
    OutOfMemoryError,
    StoreError,
    TrainableRows,
    make_row_optimizer,
    trainable_fields,
)
from lightning_embcache.device_tier import DeviceTier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_device_tier_larger_than_the_gpu_is_refused_by_name(tmp_path):
    free, total = torch.cuda.mem_get_info()
    dim = 1024  # 4 KiB rows: a disk-mode table of twice the GPU, never materialised
    rows = 2 * total // (dim * 4)
    store = EmbeddingStore.create(tmp_path / "big", rows, dim, hot_bytes=1 << 20)
    with pytest.raises(OutOfMemoryError) as info:
        DeviceTier(store, "cuda", 4 * total)
    assert isinstance(info.value, StoreError)
    assert "device_bytes=" in str(info.value) and "lower device_bytes" in str(info.value)
    # the store is untouched and usable
    assert torch.equal(store.get(torch.tensor([0, rows - 1])), torch.zeros(2, dim))
    store.close()


def _fill_gpu() -> list[torch.Tensor]:
    """Take every byte the caching allocator can get, in shrinking blocks."""
    held, block = [], 1 << 30
    while block >= 1 << 16:
        try:
            held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            block //= 4
    return held


def test_running_out_of_gpu_memory_in_a_step_is_a_store_error_and_the_rows_survive(tmp_path):
    n, dim = 4000, 32
    opt = make_row_optimizer("adam", lr=0.05)
    store = EmbeddingStore.create(tmp_path / "s", n, dim, init="normal", seed=3, chunk_rows=128, hot_bytes=64 * 1024,
                                  fields=trainable_fields(opt, dim, torch.float32))
    tier = DeviceTier(store, "cuda", (n // 4) * (store.row_bytes + 26))
    rows = TrainableRows(store, opt, device_tier=tier)
    ids = torch.arange(0, 256)
    z = rows.lookup(ids)
    (z ** 2).sum().backward()
    rows.collect()
    rows.apply(step=1)
    want = tier.gather(np.arange(n)).clone()
    held = _fill_gpu()
    try:
        with pytest.raises(OutOfMemoryError) as info:
            for a in range(256, n, 256):  # rows that must come up (and push others down)
                rows.lookup(torch.arange(a, a + 256))
                rows.discard()
        assert "device_bytes=" in str(info.value)
    finally:
        del held
        torch.cuda.empty_cache()
    rows.discard()
    # every row still holds what it held before the failure, on the device and in the store
    torch.testing.assert_close(tier.gather(np.arange(n)), want, rtol=0, atol=0)
    rows.write_down()
    store.flush()
    torch.testing.assert_close(store.get(torch.arange(n)).cuda(), want, rtol=0, atol=0)
    tier.close()
    store.close()
