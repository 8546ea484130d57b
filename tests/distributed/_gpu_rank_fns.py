"""Per-rank bodies of the NCCL tests of sharded rows on GPUs (top level, so that spawn can import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_embcache import EmbeddingStore, make_row_optimizer, trainable_fields
from lightning_embcache.device_tier import SLOT_OVERHEAD
from lightning_embcache.distributed import ShardedStore
from lightning_embcache.distributed.device_rows import ShardedDeviceRows

N, DIM = 3000, 16


def _batch(step: int, rank: int, n: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, N, (n,), generator=g)


def _open(root: str, opt, fraction: float, **gpu_options):
    store = ShardedStore.open_or_create(Path(root) / "rows", N, DIM, init="normal", seed=1, chunk_rows=100,
                                        fields=trainable_fields(opt, DIM, torch.float32))
    budget = int(fraction * store.local.num_rows * (store.local.row_bytes + SLOT_OVERHEAD))
    rows = store.trainable_rows(opt, device=torch.device("cuda", torch.cuda.current_device()), device_bytes=budget,
                                **gpu_options)
    return store, rows


def _reference(lr: float):
    ref = torch.nn.Embedding(N, DIM, sparse=True).cuda()
    with torch.no_grad():
        ref.weight.copy_(EmbeddingStore.create(None, N, DIM, init="normal", seed=1, chunk_rows=100).get(torch.arange(N)))
    return ref, torch.optim.SparseAdam(ref.parameters(), lr=lr)


def gpu_rows_match_sparse_adam(rank: int, world: int, root: str, fraction: float, prefetch: int = 0,
                               accumulate: int = 2) -> None:
    """Each rank trains its own batches through owners that hold a fraction of their shard on the
    GPU (evicting and bringing rows back every step); the reference is nn.Embedding + SparseAdam
    with the mean of the ranks' gradients over the same batches. Lookups, the final rows (read
    through the store, i.e. after the write-back), the per-row metadata and a flushed and reopened
    shard all match."""
    import sys

    opt = make_row_optimizer("adam", lr=0.05)
    switch0 = sys.getswitchinterval()
    store, rows = _open(root, opt, fraction, switch_interval=0.0005)  # process-wide while the rows are open
    assert isinstance(rows, ShardedDeviceRows)
    assert sys.getswitchinterval() == 0.0005
    tier = rows.tier
    assert (tier.capacity < store.local.num_rows) == (fraction < 1), (tier.capacity, store.local.num_rows)
    ref, ref_opt = _reference(0.05)
    target = torch.linspace(-1, 1, DIM, device="cuda")
    steps = 6
    # lookups in order; `prefetch` of them 1 or 2 ahead goes on past the last one (never looked up)
    keys = [10 * step + micro for step in range(1, steps + 2) for micro in range(accumulate)]
    announced, i = 1, 0
    for step in range(1, steps + 1):
        ref_opt.zero_grad()
        for micro in range(accumulate):
            for r in range(world):
                ids = _batch(10 * step + micro, r).cuda()
                (((ref(ids) - target) ** 2).sum(1).mean() / world).backward()
            ids = _batch(10 * step + micro, rank)
            z = rows.lookup(ids)
            while prefetch and announced <= i + prefetch:  # the next micro-batches' ids, exchanged meanwhile
                rows.prefetch(_batch(keys[announced], rank))
                announced += 1
            i += 1
            assert z.is_cuda and z.requires_grad
            torch.testing.assert_close(z.detach(), ref.weight.detach()[ids.cuda()], rtol=1e-5, atol=1e-5)
            ((z - target) ** 2).sum(1).mean().backward()
            rows.collect()
        ref_opt.step()
        rows.apply(step)
    if fraction < 1:
        assert tier.evicted_rows > 0  # rows left the GPU and came back: the budget was exercised
    if prefetch:  # a read through the store waits for the exchange running ahead, then reads
        rows.prefetch(_batch(77, rank))
        assert rows.store.ahead.hits == steps * accumulate - 1, rows.store.ahead.hits
    want = ref.weight.detach().cpu()
    torch.testing.assert_close(store.get(torch.arange(N)), want, rtol=1e-5, atol=1e-5)
    touched = torch.zeros(N, dtype=torch.bool)
    for step in range(1, steps + 1):
        for micro in range(accumulate):
            for r in range(world):
                touched[_batch(10 * step + micro, r)] = True
    meta = rows.row_meta(torch.arange(N))
    assert torch.equal(meta["updates"] > 0, touched)
    assert int(meta["last_step"].max()) == steps
    # training goes on after a read through the store
    z = rows.lookup(_batch(77, rank))
    z.sum().backward()
    rows.collect()
    rows.apply(steps + 1)
    version = store.flush()
    after = store.get(torch.arange(N))
    store.close()
    again = ShardedStore.open_or_create(Path(root) / "rows", N, DIM, version=version, init="normal", seed=1,
                                        chunk_rows=100, fields=trainable_fields(opt, DIM, torch.float32))
    assert torch.equal(again.get(torch.arange(N)), after)
    again.close()
    assert sys.getswitchinterval() == switch0  # restored when the rows closed


def direct_writes_reach_gpu_rows(rank: int, world: int, root: str) -> None:
    """`update` at the owners goes into their GPU rows too: the next lookup and a read see it."""
    opt = make_row_optimizer("sgd", lr=1.0)
    store, rows = _open(root, opt, 0.5)
    ids = torch.arange(rank, N, 7)
    rows.lookup(ids).sum().backward()  # brings the rows up and trains them once
    rows.collect()
    rows.apply(1)
    vals = torch.full((len(ids), DIM), float(rank + 3))
    store.update(ids, vals)
    want = torch.zeros(N, DIM)
    for r in range(world):  # of an id written by several ranks the highest rank wins
        want[torch.arange(r, N, 7)] = float(r + 3)
    z = rows.lookup(ids).detach().cpu()
    torch.testing.assert_close(z, want[ids])
    z = rows.lookup(ids)
    z.sum().backward()
    rows.collect()
    rows.apply(2)
    got = store.get(ids)
    counts = torch.zeros(N)
    for r in range(world):
        counts[torch.arange(r, N, 7)] += 1
    # SGD, lr 1: each rank's gradient 1 per lookup, divided by the world size
    torch.testing.assert_close(got, want[ids] - (counts[ids] / world)[:, None].expand(-1, DIM))
    store.close()


def overflow_on_one_rank_skips_every_rank(rank: int, world: int, root: str) -> None:
    """Mixed precision: a non-finite gradient row on one rank skips the rows' step on all ranks."""
    opt = make_row_optimizer("adam", lr=0.05)
    store, rows = _open(root, opt, 0.5)
    before = store.get(torch.arange(N))
    ids = _batch(5, rank)
    z = rows.lookup(ids)
    (z.sum() * (float("inf") if rank == world - 1 else 1.0)).backward()
    rows.collect()
    rows.apply(1, grad_scale=1024.0)
    assert torch.equal(store.get(torch.arange(N)), before)
    z = rows.lookup(ids)
    (z.sum() * 1024.0).backward()
    rows.collect()
    rows.apply(1, grad_scale=1024.0)
    assert not torch.equal(store.get(torch.arange(N)), before)
    store.close()


def steps_never_wait_for_the_gpu(rank: int, world: int, root: str) -> None:
    """Lookups, gradients and the owners' steps in steady state make no synchronizing CUDA call."""
    opt = make_row_optimizer("adam", lr=0.05)
    store, rows = _open(root, opt, 0.5)
    rows.prefetch(_batch(1, rank))
    rows.prefetch(_batch(2, rank))
    for step in range(1, 12):
        if step == 6:
            torch.cuda.set_sync_debug_mode("error")
        z = rows.lookup(_batch(step, rank))
        rows.prefetch(_batch(step + 2, rank))  # two ahead: exchanges and uploads in their threads
        z.square().sum().backward()
        rows.collect()
        rows.apply(step)
    torch.cuda.set_sync_debug_mode(0)
    store.close()


def lookup_of_other_ids_than_prefetched_fails(rank: int, world: int, root: str) -> None:
    """`lookup` after `prefetch` must look up the prefetched ids (they were exchanged already)."""
    import pytest

    from lightning_embcache import InvalidArgumentError

    opt = make_row_optimizer("adam", lr=0.05)
    store, rows = _open(root, opt, 0.5)
    rows.prefetch(_batch(1, rank))
    with pytest.raises(InvalidArgumentError, match="exactly next_ids"):
        rows.lookup(_batch(2, rank))
    rows.prefetch(torch.tensor([0, N + 5]) if rank == 0 else torch.tensor([1]))
    with pytest.raises(InvalidArgumentError):  # invalid ids on one rank: every rank's lookup raises
        rows.lookup(torch.tensor([0, N + 5]) if rank == 0 else torch.tensor([1]))
    z = rows.lookup(_batch(3, rank))  # and the store goes on
    assert z.shape == (128, DIM)
    store.close()


def gpu_rows_max_norm_match_nn_embedding(rank: int, world: int, root: str, fraction: float) -> None:
    """Owners renorm the rows they serve on their GPUs: lookups and the final rows match
    nn.Embedding(max_norm=1.0) + SparseAdam over the ranks' batches."""
    opt = make_row_optimizer("adam", lr=0.05)
    store, rows = _open(root, opt, fraction, max_norm=1.0)
    assert isinstance(rows, ShardedDeviceRows)
    ref = torch.nn.Embedding(N, DIM, sparse=True, max_norm=1.0).cuda()
    with torch.no_grad():
        ref.weight.copy_(EmbeddingStore.create(None, N, DIM, init="normal", seed=1, chunk_rows=100).get(torch.arange(N)))
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    target = 2 * torch.linspace(-1, 1, DIM, device="cuda")
    for step in range(1, 8):
        ref_opt.zero_grad()
        for r in range(world):
            ids = _batch(step, r).cuda()
            (((ref(ids) - target) ** 2).sum(1).mean() / world).backward()
        ids = _batch(step, rank)
        z = rows.lookup(ids)
        torch.testing.assert_close(z.detach(), ref.weight.detach()[ids.cuda()], rtol=1e-5, atol=1e-5)
        assert float(z.detach().norm(dim=1).max()) <= 1.0 + 1e-5
        ((z - target) ** 2).sum(1).mean().backward()
        rows.collect()
        ref_opt.step()
        rows.apply(step)
    torch.testing.assert_close(store.get(torch.arange(N)), ref.weight.detach().cpu(), rtol=1e-5, atol=1e-5)
    store.close()
