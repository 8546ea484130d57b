"""TrainableRows against torch's own sparse training of an nn.Embedding (the reference)."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.optim import make_row_optimizer
from lightning_embcache.trainable import TrainableRows, trainable_fields

N, DIM, STEPS = 300, 8, 200


def _reference(name: str, weight0: torch.Tensor, **kw):
    emb = torch.nn.Embedding(N, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(weight0)
    if name == "adam":
        opt = torch.optim.SparseAdam(emb.parameters(), **kw)
    elif name == "adagrad":
        opt = torch.optim.Adagrad(emb.parameters(), **kw)
    else:
        opt = torch.optim.SGD(emb.parameters(), **kw)
    return emb, opt


def _batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        # duplicates on purpose: 48 draws from a small range
        micro = [torch.randint(0, N, (24,), generator=g) for _ in range(2)]
        targets = [torch.randn(24, DIM, generator=g) for _ in range(2)]
        yield micro, targets


@pytest.mark.parametrize("name,kw", [("sgd", {"lr": 0.1}), ("adagrad", {"lr": 0.1}), ("adam", {"lr": 0.01})])
@pytest.mark.parametrize("hot_bytes", [None, 60 * 200], ids=["memory", "disk-small-hot"])
def test_store_rows_train_like_nn_embedding(tmp_path, name, kw, hot_bytes):
    opt = make_row_optimizer(name, **kw)
    store = EmbeddingStore.create(tmp_path / "s" if hot_bytes else None, N, DIM, init="normal", seed=3,
                                  hot_bytes=hot_bytes, chunk_rows=32, fields=trainable_fields(opt, DIM, torch.float32))
    rows = TrainableRows(store, opt)
    emb, ref_opt = _reference(name, store.get(torch.arange(N)), **kw)
    for step, (micro, targets) in enumerate(_batches(0), start=1):
        ref_opt.zero_grad()
        for ids, tgt in zip(micro, targets):  # gradient accumulation over two micro-batches
            ((emb(ids) - tgt) ** 2).sum().backward()
            z = rows.lookup(ids)
            ((z - tgt) ** 2).sum().backward()
            rows.collect()
        ref_opt.step()
        rows.apply(step=step)
        if step % 50 == 0 and hot_bytes:
            store.flush()
    torch.testing.assert_close(store.get(torch.arange(N)), emb.weight.detach(), rtol=1e-5, atol=1e-5)
    meta = rows.row_meta(torch.arange(N))
    touched = torch.zeros(N, dtype=torch.bool)
    counts = torch.zeros(N, dtype=torch.int32)
    for micro, _ in _batches(0):
        u = torch.unique(torch.cat(micro))
        touched[u] = True
        counts[u] += 1
    assert torch.equal(meta["updates"], counts)
    assert (meta["last_step"][touched] > 0).all() and (meta["last_step"][~touched] == 0).all()
    store.close()


def test_flushed_rows_and_moments_come_from_the_same_step(tmp_path):
    opt = make_row_optimizer("adam", lr=0.05)
    path = tmp_path / "s"
    store = EmbeddingStore.create(path, N, DIM, hot_bytes=40 * 200, chunk_rows=32,
                                  fields=trainable_fields(opt, DIM, torch.float32))
    rows = TrainableRows(store, opt)
    snapshots = {}
    for step, (micro, targets) in enumerate(_batches(1), start=1):
        for ids, tgt in zip(micro, targets):
            ((rows.lookup(ids) - tgt) ** 2).sum().backward()
        rows.apply(step=step)
        if step % 20 == 0:
            rows.settle()
            v = store.flush()
            snapshots[v] = store.get_fields(torch.arange(N), ("weight", "exp_avg", "exp_avg_sq", "updates"))
        if step == 150:
            break
    store.close()
    # reopen the newest version: every row's weights, moments and counters from the same flush
    reopened = EmbeddingStore.open(path, hot_bytes=40 * 200)
    got = reopened.get_fields(torch.arange(N), ("weight", "exp_avg", "exp_avg_sq", "updates"))
    want = snapshots[max(snapshots)]
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_missing_fields_error_names_the_fix():
    store = EmbeddingStore.create(None, 10, 4)
    with pytest.raises(ValueError, match="trainable_fields"):
        TrainableRows(store, make_row_optimizer("adam", lr=1e-3))
