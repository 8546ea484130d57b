"""max_norm: rows bounded as nn.Embedding(max_norm=...) bounds them, in the store."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache import EmbeddingStore, InvalidArgumentError, StoreError
from lightning_embcache.optim import make_row_optimizer
from lightning_embcache.optim.clip import renorm_rows
from lightning_embcache.trainable import TrainableRows, trainable_fields

N, DIM, STEPS = 120, 8, 100


def _batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        micro = [torch.randint(0, N, (24,), generator=g) for _ in range(2)]  # duplicates on purpose
        targets = [3 * torch.randn(24, DIM, generator=g) for _ in range(2)]
        yield micro, targets


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
@pytest.mark.parametrize("hot_bytes", [None, 60 * 200], ids=["memory", "disk-small-hot"])
def test_adam_with_max_norm_trains_like_nn_embedding(tmp_path, hot_bytes, norm_type):
    opt = make_row_optimizer("adam", lr=0.05)
    store = EmbeddingStore.create(tmp_path / "s" if hot_bytes else None, N, DIM, init="normal", seed=5,
                                  init_std=1.0, hot_bytes=hot_bytes, chunk_rows=32,
                                  fields=trainable_fields(opt, DIM, torch.float32))
    rows = TrainableRows(store, opt, max_norm=1.0, norm_type=norm_type)
    emb = torch.nn.Embedding(N, DIM, max_norm=1.0, norm_type=norm_type, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(store.get(torch.arange(N)))
    assert (emb.weight.norm(p=norm_type, dim=1) > 1.0).sum() > N // 2  # the bound has work to do
    ref = torch.optim.SparseAdam(emb.parameters(), lr=0.05)
    for step, (micro, targets) in enumerate(_batches(0), start=1):
        ref.zero_grad()
        for ids, tgt in zip(micro, targets):
            ((emb(ids) - tgt) ** 2).sum().backward()
            z = rows.lookup(ids)
            torch.testing.assert_close(z, emb.weight[ids].detach(), rtol=1e-5, atol=1e-5)
            ((z - tgt) ** 2).sum().backward()
            rows.collect()
        ref.step()
        rows.apply(step=step)
        if hot_bytes and step % 30 == 0:
            store.flush()
    torch.testing.assert_close(store.get(torch.arange(N)), emb.weight.detach(), rtol=1e-5, atol=1e-5)
    store.close()


def test_rows_under_the_bound_keep_their_bits_and_are_not_written():
    store = EmbeddingStore.create(None, 10, 4, init="normal", seed=1, init_std=0.1)
    opt = make_row_optimizer("sgd", lr=0.1)
    store.close()
    store = EmbeddingStore.create(None, 10, 4, init="normal", seed=1, init_std=0.1,
                                  fields=trainable_fields(opt, 4, torch.float32))
    before = store.get(torch.arange(10))
    rows = TrainableRows(store, opt, max_norm=100.0)
    updates = store.stats().updates
    with torch.no_grad():
        got = rows.lookup(torch.arange(10))
    assert torch.equal(got, before) and store.stats().updates == updates
    store.close()


def test_renorm_rows_is_nn_embeddings_rule():
    w = torch.randn(50, 16, generator=torch.Generator().manual_seed(0)) * 2
    ref = w.clone()
    ids = torch.arange(50)
    torch.embedding_renorm_(ref, ids, 1.5, 2.0)
    got, over = renorm_rows(w, 1.5, 2.0)
    assert torch.equal(got, ref)
    assert torch.equal(over, w.norm(dim=1) > 1.5)


@pytest.mark.parametrize("kw,name", [({"max_norm": 0}, "max_norm"), ({"max_norm": -1.0}, "max_norm"),
                                     ({"max_norm": float("inf")}, "max_norm"), ({"max_norm": True}, "max_norm"),
                                     ({"max_norm": 1.0, "norm_type": 0}, "norm_type"),
                                     ({"max_norm": 1.0, "norm_type": -2.0}, "norm_type"),
                                     ({"max_norm": 1.0, "norm_type": "2"}, "norm_type"),
                                     ({"stochastic_rounding": True}, "stochastic_rounding"),
                                     ({"stochastic_rounding": 1}, "stochastic_rounding")])
def test_bad_row_options_are_refused_by_name(kw, name):
    opt = make_row_optimizer("adam")
    store = EmbeddingStore.create(None, 10, 4, fields=trainable_fields(opt, 4, torch.float32))
    with pytest.raises(InvalidArgumentError, match=name) as err:
        TrainableRows(store, opt, **kw)
    assert isinstance(err.value, StoreError)
    store.close()
