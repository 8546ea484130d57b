"""A prefetch over the mapped host table plans its swap on the prefetch thread (host bookkeeping
only) and the kernel is queued by the thread that next reads the rows: rows and moments still
equal nn.Embedding + SparseAdam's, the prefetch thread makes no CUDA call, a flush copying the
table meanwhile sends the dirty victims down another way, and a swap that fails to queue leaves
the map as it was. The prefetch thread also works out the next lookup's slots: that lookup
neither searches the map nor uploads its slots, unless a row moved in between."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore, TrainableRows, make_row_optimizer, trainable_fields
from lightning_embcache import device_tier as device_tier_module
from lightning_embcache.device_slots import SlotMap
from lightning_embcache.device_tier import SLOT_OVERHEAD, DeviceTier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, DIM, BATCH, STEPS = 4000, 16, 128, 120


def _setup(tmp_path):
    opt = make_row_optimizer("adam", lr=0.05)
    store = EmbeddingStore.create(tmp_path / "s", N, DIM, init="normal", seed=1, chunk_rows=128,
                                  fields=trainable_fields(opt, DIM, torch.float32))
    tier = DeviceTier(store, "cuda", (N // 4) * (store.row_bytes + SLOT_OVERHEAD))
    assert tier.stats()["device_mapped_host"] and not tier.resident
    emb = torch.nn.Embedding(N, DIM, sparse=True, device="cuda")
    with torch.no_grad():
        emb.weight.copy_(store.get(torch.arange(N)).cuda())
    return store, tier, TrainableRows(store, opt, device_tier=tier), emb, torch.optim.SparseAdam(emb.parameters(), lr=0.05)


def _train(store, tier, rows, emb, ref, fail_at=None, arm=None):
    """STEPS steps, each prefetching the next batch after its lookup (as `embcache bench train`
    does), a flush every 40; ``fail_at``: the step whose lookup is expected to raise (``arm()``
    is called just before it; skipped by both)."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, N, (BATCH,), generator=g) for _ in range(STEPS + 1)]
    applied = 0  # Adam's step count (SparseAdam counts the steps it took)
    last, updates = torch.zeros(N, dtype=torch.int32), torch.zeros(N, dtype=torch.int32)
    for step in range(1, STEPS + 1):
        ids, tgt = batches[step - 1], torch.randn(BATCH, DIM, generator=g).cuda()
        if step == fail_at:
            arm()
            with pytest.raises(RuntimeError, match="injected"):
                rows.lookup(ids)
            rows.prefetch(batches[step])
            continue
        ref.zero_grad()
        ((emb(ids.cuda()) - tgt) ** 2).sum().backward()
        out = rows.lookup(ids)
        rows.prefetch(batches[step])
        ((out - tgt) ** 2).sum().backward()
        rows.collect()
        ref.step()
        applied += 1
        rows.apply(step=applied)
        last[ids] = applied
        updates[ids.unique()] += 1
        if step % 40 == 0:
            rows.write_down()
            store.flush()
    state = ref.state[emb.weight]
    for name, want in (("weight", emb.weight.detach()), ("exp_avg", state["exp_avg"]),
                       ("exp_avg_sq", state["exp_avg_sq"])):
        torch.testing.assert_close(tier.gather(np.arange(N), name), want, rtol=1e-5, atol=1e-6, msg=name)
    rows.write_down()
    torch.testing.assert_close(store.get(torch.arange(N)).cuda(), emb.weight.detach(), rtol=1e-5, atol=1e-6)
    meta = store.get_fields(torch.arange(N), ("last_step", "updates"))  # each updated row counted once a step
    assert torch.equal(meta["last_step"][:, 0], last) and torch.equal(meta["updates"][:, 0], updates)


def _threads_calling(monkeypatch, obj, name):
    seen: list[str] = []
    real = getattr(obj, name)

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(obj, name, spy)
    return seen


def test_prefetched_swaps_are_queued_by_the_reading_thread_and_train_like_sparse_adam(tmp_path, monkeypatch):
    store, tier, rows, emb, ref = _setup(tmp_path)
    swaps = _threads_calling(monkeypatch, device_tier_module.mapped_swap, "swap_rows")
    _train(store, tier, rows, emb, ref)
    assert tier.stats()["device_staged_ahead_rows"] > 0
    assert swaps and all(not t.startswith("embcache-device-prefetch") for t in swaps), set(swaps)
    tier.close()
    store.close()


def test_a_flush_copying_the_table_sends_a_planned_swaps_dirty_victims_down_staged(tmp_path, monkeypatch):
    store, tier, rows, emb, ref = _setup(tmp_path)
    real, calls = store._device_write, [0]

    def every_third_declines(idx, enqueue):  # what a flush copying the table out answers
        calls[0] += 1
        return False if calls[0] % 3 == 0 else real(idx, enqueue)

    monkeypatch.setattr(store, "_device_write", every_third_declines)
    staged = _threads_calling(monkeypatch, DeviceTier, "_write_item")
    _train(store, tier, rows, emb, ref)
    assert calls[0] >= 3 and staged  # some victims did go down the staged way
    tier.close()
    store.close()


def test_a_swap_that_fails_to_queue_puts_the_map_back(tmp_path, monkeypatch):
    store, tier, rows, emb, ref = _setup(tmp_path)
    real, armed = device_tier_module.mapped_swap.swap_rows, [False]

    def fails_once_armed(*a, **k):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("injected: the kernel could not be queued")
        return real(*a, **k)

    monkeypatch.setattr(device_tier_module.mapped_swap, "swap_rows", fails_once_armed)
    _train(store, tier, rows, emb, ref, fail_at=10, arm=lambda: armed.__setitem__(0, True))
    assert not armed[0]  # the lookup did queue (and fail) a swap
    tier.close()
    store.close()


def test_a_prefetched_lookup_takes_the_slots_the_job_worked_out_and_one_upload(tmp_path, monkeypatch):
    store, tier, rows, emb, ref = _setup(tmp_path)
    finds = _threads_calling(monkeypatch, SlotMap, "find")
    uploads = _threads_calling(monkeypatch, DeviceTier, "to_device")
    _train(store, tier, rows, emb, ref)  # rows and moments as SparseAdam's
    training = threading.current_thread().name
    # one lookup without a prefetch (the first) searches the map on this thread; no other does
    assert finds.count(training) <= 1 + STEPS // 40, finds.count(training)
    # the job's upload carries the swap's index array and the next lookup's slots: one a step,
    # where a lookup uploading its own slots makes two (a few more: write-downs, the final check)
    assert uploads.count(training) < 1.5 * STEPS, uploads.count(training)
    tier.close()
    store.close()


def test_slots_worked_out_ahead_are_not_used_once_a_row_moved(tmp_path):
    store, tier, rows, emb, ref = _setup(tmp_path)
    cap = tier.capacity
    a = np.arange(0, cap // 2, dtype=np.int64)
    tier.prefetch(a)
    tier._join()  # the swap queued; a's slots went up with its index array
    tier.slots(np.arange(cap // 2, cap // 2 + 3 * cap // 4, dtype=np.int64))  # evicts some of a's rows
    got = tier.view("weight").index_select(0, tier.device_positions(tier.positions(a.copy())))
    torch.testing.assert_close(got.cpu(), store.get(torch.from_numpy(a)))
    tier.close()
    store.close()
