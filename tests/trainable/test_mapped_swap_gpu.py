"""`mapped_swap.swap_rows` against plain tensor indexing (the reference), and the device tier
over a mapped table moving its rows with it: one kernel per miss set, rows equal to
nn.Embedding + SparseAdam."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore, TrainableRows, make_row_optimizer, mapped_swap, trainable_fields
from lightning_embcache.device_tier import SLOT_OVERHEAD, DeviceTier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _weights(records, dtype, dim):
    return records[:, : dim * torch.empty(0, dtype=dtype).element_size()].view(dtype)


def _records(n, row_bytes, dtype, dim, gen):
    rec = torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=gen)
    _weights(rec, dtype, dim)[:] = torch.randn(n, dim, generator=gen)
    return rec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_swap_rows_moves_records_like_indexing_and_flags_non_finite_weights_it_writes_out(dtype, bad):
    gen = torch.Generator().manual_seed(0)
    dim, row_bytes, cap, rows = 6, 40, 64, 500
    pool = _records(cap, row_bytes, dtype, dim, gen).cuda()
    host = _records(rows, row_bytes, dtype, dim, gen).cuda()
    slots = torch.randperm(cap, generator=gen)[:40]
    out = torch.randperm(rows, generator=gen)[:40]
    inn = torch.randperm(rows, generator=gen)[:40]
    out[::3] = -1
    inn[::5] = -1
    inn[torch.isin(inn, out)] = -1  # the tier never reads a row it writes out in the same call
    if bad is not None:
        _weights(pool, dtype, dim)[slots[7], 3] = bad
    p0, h0 = pool.clone(), host.clone()
    flag = torch.zeros((), dtype=torch.int32, device="cuda")
    check = mapped_swap.weight_words(pool, _weights(pool, dtype, dim))
    assert check == (0, dim * torch.empty(0, dtype=dtype).element_size() // 4,
                     {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype])
    mapped_swap.swap_rows(pool, host, torch.cat([slots, out, inn]).cuda(), flag, check)
    ref_host, ref_pool = h0.clone(), p0.clone()
    w = out >= 0
    ref_host[out[w].cuda()] = p0[slots[w].cuda()]
    r = inn >= 0
    ref_pool[slots[r].cuda()] = h0[inn[r].cuda()]
    assert torch.equal(host, ref_host) and torch.equal(pool, ref_pool)
    assert int(flag) == (1 if bad is not None and out[7] >= 0 else 0)


def test_a_tier_over_a_mapped_table_moves_each_miss_set_with_one_kernel_and_trains_like_sparse_adam(
        tmp_path, monkeypatch):
    calls = []
    real = mapped_swap.swap_rows
    monkeypatch.setattr(mapped_swap, "swap_rows", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    n, dim = 4000, 16
    opt = make_row_optimizer("adam", lr=0.05)
    store = EmbeddingStore.create(tmp_path / "s", n, dim, init="normal", seed=1, chunk_rows=128,
                                  fields=trainable_fields(opt, dim, torch.float32))
    tier = DeviceTier(store, "cuda", n // 4 * (store.row_bytes + SLOT_OVERHEAD))
    assert tier.stats()["device_mapped_host"]
    rows = TrainableRows(store, opt, device_tier=tier)
    emb = torch.nn.Embedding(n, dim, sparse=True, device="cuda")
    with torch.no_grad():
        emb.weight.copy_(store.get(torch.arange(n)).cuda())
    ref = torch.optim.SparseAdam(emb.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    for step in range(1, 61):
        ids = torch.randint(0, n, (300,), generator=g)
        target = torch.randn(len(ids), dim, generator=g).cuda()
        ((rows.lookup(ids) - target) ** 2).sum().backward()
        rows.collect()
        rows.apply(step=step)
        ref.zero_grad()
        ((emb(ids.cuda()) - target) ** 2).sum().backward()
        ref.step()
    st = tier.stats()
    assert calls and st["device_evicted_rows"] > 0 and st["device_to_host_bytes"] > 0
    rows.write_down()
    torch.testing.assert_close(store.get(torch.arange(n)).cuda(), emb.weight.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tier.gather(np.arange(n)), emb.weight.detach(), rtol=1e-5, atol=1e-5)
    store.close()


def test_the_tier_counts_rows_staged_ahead_and_lookups_that_found_their_rows(tmp_path):
    """What the profiler reports as the window's hit rate and rows staged ahead (issue: a user
    sees whether the rows came before the lookup): a prefetched batch is all hits, its misses
    staged ahead; a batch nobody announced loads at its lookup (no hits, nothing ahead)."""
    n, dim = 4000, 16
    opt = make_row_optimizer("adam", lr=0.05)
    store = EmbeddingStore.create(tmp_path / "s", n, dim, init="normal", seed=1, chunk_rows=128,
                                  fields=trainable_fields(opt, dim, torch.float32))
    tier = DeviceTier(store, "cuda", n // 4 * (store.row_bytes + SLOT_OVERHEAD))
    a = np.arange(0, 600, 2, dtype=np.int64)
    tier.prefetch(a)
    tier.positions(np.concatenate([a, a[:10]]))
    st = tier.stats()
    assert st["device_staged_ahead_rows"] == len(a)
    assert st["device_lookup_rows"] == len(a) + 10 and st["device_lookup_hit_rows"] == len(a) + 10
    b = np.arange(1, 401, 2, dtype=np.int64)
    tier.positions(b)
    st = tier.stats()
    assert st["device_staged_ahead_rows"] == len(a)
    assert st["device_lookup_rows"] == len(a) + 10 + len(b) and st["device_lookup_hit_rows"] == len(a) + 10
    tier.close()
    store.close()


def test_announced_batches_are_staged_after_the_next_lookup_and_then_found_on_the_gpu(tmp_path):
    """`upcoming` only announces; the lookup that follows starts one job staging every announced
    batch after it, so that lookup does not wait for their rows and theirs find them."""
    n, dim = 4000, 16
    opt = make_row_optimizer("adam", lr=0.05)
    store = EmbeddingStore.create(tmp_path / "s", n, dim, init="normal", seed=1, chunk_rows=128,
                                  fields=trainable_fields(opt, dim, torch.float32))
    tier = DeviceTier(store, "cuda", n // 4 * (store.row_bytes + SLOT_OVERHEAD))
    batches = [np.arange(k * 100, k * 100 + 80, dtype=np.int64)[::-1].copy() for k in range(4)]
    for b in batches[:3]:
        tier.upcoming(b)
    assert tier.stats()["device_staged_ahead_rows"] == 0  # nothing staged before a lookup
    tier.positions(batches[0])  # loads its own rows, then stages batches 1 and 2
    tier.upcoming(batches[3])
    tier.positions(batches[1])  # stages batch 3
    for b in batches[2:]:
        tier.positions(b)
    st = tier.stats()
    assert st["device_staged_ahead_rows"] == 3 * 80
    assert st["device_lookup_hit_rows"] == 3 * 80 and st["device_lookup_rows"] == 4 * 80
    rows = tier.gather(np.concatenate(batches))
    torch.testing.assert_close(rows.cpu(), store.get(torch.from_numpy(np.concatenate(batches))))
    tier.close()
    store.close()
