"""Per-rank bodies of the multi-process tests (top level, so that spawn can import them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_embcache import EmbeddingStore, InvalidArgumentError, make_row_optimizer, trainable_fields
from lightning_embcache.distributed import ShardedStore, ShardedTrainableRows, shard_dir

N, DIM = 1000, 8


def _batch(step: int, rank: int, n: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, N, (n,), generator=g)


def get_update_match_a_tensor(rank: int, world: int, root: str) -> None:
    """Random writes from every rank (duplicates within and across ranks), then reads of every id,
    against a plain tensor that applies each call's writes in rank order (last wins)."""
    store = ShardedStore.open_or_create(Path(root) / "t", N, DIM, init="normal", seed=5, chunk_rows=64,
                                        hot_bytes=16 * DIM * 4 * 4)  # disk mode, a 16-row hot tier
    ref = EmbeddingStore.create(None, N, DIM, init="normal", seed=5, chunk_rows=64).get(torch.arange(N))
    assert torch.equal(store.get(torch.arange(N)), ref)  # initial rows are those of one process
    for step in range(6):
        for r in range(world):
            ids = _batch(step, r)
            vals = torch.randn(len(ids), DIM, generator=torch.Generator().manual_seed(7 + step * 10 + r))
            ref[ids] = vals  # index_put: of duplicates the last wins, as in the store
            if r == rank:
                mine = (ids, vals)
        store.update(*mine)
        if step == 3:
            store.flush()
    assert torch.equal(store.get(torch.arange(N)), ref)
    got = store.get(_batch(99, rank))
    assert torch.equal(got, ref[_batch(99, rank)])
    # this rank's shard holds exactly the ids it owns
    assert store.local.num_rows == len(range(rank, N, world))
    assert (Path(root) / "t" / shard_dir(Path(""), rank, world)).joinpath("META").exists()
    store.flush()
    store.close()


def invalid_ids_fail_every_rank(rank: int, world: int, root: str) -> None:
    store = ShardedStore.open_or_create(None, N, DIM)
    before = store.get(torch.arange(N))
    bad = torch.tensor([1, 2, N + 3]) if rank == 1 else torch.tensor([4, 5])
    with pytest.raises(InvalidArgumentError) as err:
        store.update(bad, torch.ones(len(bad), DIM))
    if rank == 1:
        assert f"ids must be in [0, {N}); got max id {N + 3} (batch position 2)" in str(err.value)
    else:
        assert "rank(s) [1] passed invalid ids" in str(err.value)
    with pytest.raises(InvalidArgumentError):
        store.get(torch.tensor([-1]) if rank == 0 else torch.tensor([0]))
    assert torch.equal(store.get(torch.arange(N)), before)  # nothing changed anywhere
    store.close()


def trainable_rows_match_sparse_adam(rank: int, world: int, root: str, accumulate: int = 2) -> None:
    """Each rank trains its own batches; the reference is nn.Embedding + SparseAdam with the mean of
    the ranks' gradients (what DDP does to dense parameters), over the same batches."""
    opt = make_row_optimizer("adam", lr=0.05)
    store = ShardedStore.open_or_create(Path(root) / "rows", N, DIM, init="normal", seed=1, chunk_rows=100,
                                        fields=trainable_fields(opt, DIM, torch.float32))
    rows = ShardedTrainableRows(store, opt)
    ref = torch.nn.Embedding(N, DIM, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(EmbeddingStore.create(None, N, DIM, init="normal", seed=1, chunk_rows=100).get(torch.arange(N)))
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    target = torch.linspace(-1, 1, DIM)
    for step in range(1, 5):
        ref_opt.zero_grad()
        for micro in range(accumulate):
            for r in range(world):
                ids = _batch(10 * step + micro, r, 32)
                loss = ((ref(ids) - target) ** 2).sum(1).mean() / world
                loss.backward()
            ids = _batch(10 * step + micro, rank, 32)
            z = rows.lookup(ids)
            ((z - target) ** 2).sum(1).mean().backward()
            rows.collect()
        ref_opt.step()
        rows.apply(step)
    got = store.get(torch.arange(N))
    torch.testing.assert_close(got, ref.weight.detach(), rtol=1e-5, atol=1e-6)
    meta = rows.row_meta(torch.arange(N))
    touched = torch.zeros(N, dtype=torch.bool)
    for step in range(1, 5):
        for micro in range(accumulate):
            for r in range(world):
                touched[_batch(10 * step + micro, r, 32)] = True
    assert torch.equal(meta["updates"] > 0, touched)
    assert int(meta["last_step"].max()) == 4
    store.close()


def exchange_is_o_batch(rank: int, world: int, root: str) -> None:
    """Bytes a rank sends per get follow the batch, not the table."""
    sent = {}
    for n in (1_000, 100_000):
        store = ShardedStore.open_or_create(None, n * 10, 16, hot_bytes=1 << 20)
        before = store.exchanged_bytes
        store.get(torch.arange(256) * 7 + rank)
        sent[n] = store.exchanged_bytes - before
        store.close()
    assert sent[100_000] == sent[1_000], sent
    assert sent[1_000] < 256 * (16 * 4 + 8) + 64, sent  # each unique id and its row at most once


def operation_sequence(rank: int, world: int, root: str, ops: list) -> None:
    """Replay `ops` (updates and reads from every rank, flushes, close + reopen from disk) on a
    disk-mode sharded store and on a plain tensor that keeps what was durable at each flush."""
    n, dim = 97, 3
    path = Path(root) / "seq"
    opts = dict(init="normal", seed=2, chunk_rows=8, hot_bytes=4 * (dim * 4 + 64))
    store = ShardedStore.open_or_create(path, n, dim, **opts)
    ref = EmbeddingStore.create(None, n, dim, init="normal", seed=2).get(torch.arange(n))
    durable = ref.clone()
    try:
        for op in ops:
            kind = op[0]
            if kind == "update":
                for r in range(world):  # the owners apply the ranks' rows in rank order: last wins
                    ids, seed = op[1][r]
                    vals = torch.randn(len(ids), dim, generator=torch.Generator().manual_seed(seed))
                    for i, v in zip(ids, vals):
                        ref[i] = v
                ids, seed = op[1][rank]
                store.update(torch.tensor(ids, dtype=torch.int64),
                             torch.randn(len(ids), dim, generator=torch.Generator().manual_seed(seed)))
            elif kind == "get":
                ids = torch.tensor(op[1][rank], dtype=torch.int64)
                assert torch.equal(store.get(ids), ref[ids]), op
            elif kind == "flush":
                store.flush()
                durable = ref.clone()
            elif kind == "reopen":  # what was not flushed is dropped
                store.close()
                store = ShardedStore.open_or_create(path, n, dim, **opts)
                ref = durable.clone()
        assert torch.equal(store.get(torch.arange(n)), ref)
    finally:
        store.close()


def trainable_rows_with_an_idle_rank(rank: int, world: int, root: str) -> None:
    """A rank with no ids in a step (an empty batch) still takes part; the other's rows train."""
    opt = make_row_optimizer("sgd", lr=1.0)
    store = ShardedStore.open_or_create(None, N, DIM, fields=trainable_fields(opt, DIM, torch.float32))
    rows = ShardedTrainableRows(store, opt)
    ids = torch.tensor([], dtype=torch.int64) if rank == 0 else torch.tensor([3, 4, 4])
    z = rows.lookup(ids)
    z.sum().backward()
    rows.collect()
    rows.apply(1)
    got = store.get(torch.tensor([3, 4, 5]))
    # SGD, lr 1, gradient 1 per lookup, divided by the world size (the ranks' mean)
    assert torch.equal(got, torch.tensor([[-0.5] * DIM, [-1.0] * DIM, [0.0] * DIM])), got
    store.close()


def device_budget_reaches_each_shard(rank: int, world: int, root: str) -> None:
    """``device_bytes`` given to a sharded store is each shard's GPU budget; on a Gloo (CPU)
    group trainable rows stay in host memory whatever it is, and ``device_bytes=0`` always does."""
    opt = make_row_optimizer("sgd", lr=1.0)
    store = ShardedStore.open_or_create(None, N, DIM, device_bytes=1 << 20, fields=trainable_fields(opt, DIM, torch.float32))
    assert store.device_bytes == 1 << 20
    assert isinstance(store.trainable_rows(opt), ShardedTrainableRows)
    assert isinstance(store.trainable_rows(opt, device="cpu"), ShardedTrainableRows)
    assert isinstance(store.trainable_rows(opt, device_bytes=0), ShardedTrainableRows)
    assert store.device_rows is None
    with pytest.raises(InvalidArgumentError, match=r"switch_interval=0.001 applies to rows on the owners' GPUs"):
        store.trainable_rows(opt, device_bytes=0, switch_interval=0.001)
    store.close()


def announced_lookups_train_like_sparse_adam(rank: int, world: int, root: str) -> None:
    """Lookups announced two batches ahead (`ShardedStore.prefetch`, what a LookaheadSampler does
    through the handle) take their exchanged routes; a second lookup per step of other ids, a
    read, and a batch announced but never looked up leave them intact; rows equal nn.Embedding +
    SparseAdam with the mean gradients."""
    opt = make_row_optimizer("adam", lr=0.05)
    store = ShardedStore.open_or_create(Path(root) / "rows", N, DIM, init="normal", seed=1, chunk_rows=100,
                                        fields=trainable_fields(opt, DIM, torch.float32))
    rows = store.trainable_rows(opt)
    ref = torch.nn.Embedding(N, DIM, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(EmbeddingStore.create(None, N, DIM, init="normal", seed=1, chunk_rows=100).get(torch.arange(N)))
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    target = torch.linspace(-1, 1, DIM)
    steps = [1, 2, 3, 5, 6]  # batch 4 is announced and never looked up
    for s in (1, 2):
        store.prefetch(_batch(s, rank, 32))
    for i, step in enumerate(steps):
        ahead = 2 if step < 4 else 1
        if step + ahead <= 6:
            store.prefetch(_batch(step + ahead, rank, 32))  # every rank announces the same count
        ref_opt.zero_grad()
        for r in range(world):
            ids = _batch(step, r, 32)
            neg = _batch(100 + step, r, 8)
            (((ref(ids) - target) ** 2).sum(1).mean() / world + ref(neg).sum() / world).backward()
        z = rows.lookup(_batch(step, rank, 32))
        n = rows.lookup(_batch(100 + step, rank, 8))  # not announced: exchanged as usual
        (((z - target) ** 2).sum(1).mean() + n.sum()).backward()
        rows.collect()
        ref_opt.step()
        rows.apply(i + 1)
        if step == 2:  # a read between steps (validation): the announced routes stay
            store.get(_batch(200, rank, 16))
    assert store.ahead.hits == len(steps), store.ahead.hits
    torch.testing.assert_close(store.get(torch.arange(N)), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    # invalid announced ids on one rank: every rank's lookup of that batch fails, then training goes on
    bad = torch.tensor([1, N + 2]) if rank == 1 else torch.tensor([3, 4])
    try:
        store.prefetch(bad)
    except InvalidArgumentError:
        assert rank == 1
    with pytest.raises(InvalidArgumentError, match=f"got max id {N + 2}" if rank == 1 else r"rank\(s\) \[1\]"):
        rows.lookup(bad)
    rows.lookup(_batch(7, rank)).sum().backward()
    rows.collect()
    rows.apply(9)
    store.close()


def max_norm_rows_match_nn_embedding(rank: int, world: int, root: str) -> None:
    """max_norm on a row-sharded store: each owner renorms the rows it serves in its shard, as
    nn.Embedding(max_norm=...) does in its table at lookup; rows and their training equal the
    reference's (mean of the ranks' gradients), and no stored row of a looked-up id is over it."""
    opt = make_row_optimizer("adam", lr=0.05)
    store = ShardedStore.open_or_create(Path(root) / "rows", N, DIM, init="normal", seed=1, chunk_rows=100,
                                        fields=trainable_fields(opt, DIM, torch.float32))
    rows = store.trainable_rows(opt, device_bytes=0, max_norm=0.5)
    ref = torch.nn.Embedding(N, DIM, sparse=True, max_norm=0.5)
    with torch.no_grad():
        ref.weight.copy_(EmbeddingStore.create(None, N, DIM, init="normal", seed=1, chunk_rows=100).get(torch.arange(N)))
    assert float(ref.weight.norm(dim=1).max()) > 0.5  # some rows start over the bound
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    target = torch.linspace(-1, 1, DIM)
    seen = torch.zeros(N, dtype=torch.bool)
    for step in range(1, 6):
        ref_opt.zero_grad()
        for r in range(world):
            ids = _batch(step, r, 32)
            seen[ids] = True
            (((ref(ids) - target) ** 2).sum(1).mean() / world).backward()
        z = rows.lookup(_batch(step, rank, 32))
        assert float(z.norm(dim=1).max()) <= 0.5 + 1e-5
        ((z - target) ** 2).sum(1).mean().backward()
        rows.collect()
        ref_opt.step()
        rows.apply(step)
    torch.testing.assert_close(store.get(torch.arange(N)), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    store.close()
