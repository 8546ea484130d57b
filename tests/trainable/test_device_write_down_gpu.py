"""A flush's write-down of the device tier holds the training step lock only while the rows'
copies are queued: the store writes run after it (in a `DeferredSync` worker thread) while the
training thread goes on queuing steps, and the flush still holds every row as of its start."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.device_tier import DeviceTier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["whole-table", "half-table"])
def test_training_goes_on_while_the_write_down_reaches_the_store(tmp_path, fraction):
    n, dim = 2000, 16
    store = EmbeddingStore.create(tmp_path / "s", n, dim, init="normal", seed=2, chunk_rows=128, hot_bytes=64 * 1024)
    tier = DeviceTier(store, "cuda", int(n * fraction) * (store.row_bytes + 26))
    ids = np.arange(0, n, 3) if fraction == 1.0 else np.arange(0, n // 4)
    before = torch.randn(len(ids), dim, device="cuda")
    tier.scatter(ids, before)
    entered, release = threading.Event(), threading.Event()
    original = store._write_records_trusted

    def slow_write(*args, **kwargs):
        entered.set()
        assert release.wait(30), "the test never let the store write go on"
        return original(*args, **kwargs)

    store._write_records_trusted = slow_write
    result: dict = {}
    writer = threading.Thread(target=lambda: result.update(n=tier.write_down()))
    writer.start()
    try:
        assert entered.wait(30), "the write-down never reached the store"
        # the rows' copies are queued and the store write is held: a training step gets the lock
        got = tier.step_lock.acquire(timeout=10)
        assert got, "the write-down kept the step lock while the store wrote its rows"
        try:  # a step after the write-down began: not part of it
            slot = tier.slots(ids[:1])
            tier.view("weight").index_fill_(0, torch.as_tensor(slot, device="cuda"), 7.0)
            tier.mark_dirty(slot)
        finally:
            tier.step_lock.release()
        assert writer.is_alive()  # ... and it has not returned before its rows landed
    finally:
        release.set()
        writer.join(60)
    store._write_records_trusted = original
    assert result["n"] == len(ids)
    # the store holds every row as of the write-down's start, the later step's row too only on the device
    host = store.get(torch.from_numpy(ids)).cuda()
    torch.testing.assert_close(host, before, rtol=0, atol=0)
    assert float(tier.gather(ids[:1])[0, 0]) == 7.0
    tier.write_down()
    assert float(store.get(torch.from_numpy(ids[:1]))[0, 0]) == 7.0
    tier.close()
    store.close()
