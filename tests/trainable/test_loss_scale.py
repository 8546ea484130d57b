"""Mixed precision with a loss scale: the rows' gradients are unscaled, overflow steps skipped."""

from __future__ import annotations

import torch

from lightning_embcache import EmbeddingStore, TrainableRows, make_row_optimizer, trainable_fields

N, DIM = 64, 4


def _rows(name="sgd"):
    opt = make_row_optimizer(name, lr=0.5)
    store = EmbeddingStore.create(None, N, DIM, init="normal", fields=trainable_fields(opt, DIM, torch.float32))
    return store, TrainableRows(store, opt)


def test_scaled_gradients_train_the_rows_as_unscaled_ones():
    ids = torch.tensor([3, 7, 7, 20])
    target = torch.randn(4, DIM, generator=torch.Generator().manual_seed(0))
    results = []
    for scale in (None, 1024.0):
        store, rows = _rows()
        z = rows.lookup(ids)
        loss = ((z - target) ** 2).sum()
        (loss * (scale or 1.0)).backward()
        rows.apply(step=1, grad_scale=scale)
        results.append(store.get(torch.arange(N)))
    torch.testing.assert_close(results[1], results[0])
    assert not torch.equal(results[0], _rows()[0].get(torch.arange(N)))  # the rows did move


def test_an_overflowed_step_is_skipped_not_raised():
    store, rows = _rows("adam")
    before = store.read_records(torch.arange(N)).clone()
    z = rows.lookup(torch.tensor([1, 2]))
    (z.sum() * float("inf")).backward()
    rows.apply(step=1, grad_scale=65536.0)  # check_finite would refuse these rows: the step is skipped
    torch.testing.assert_close(store.read_records(torch.arange(N)), before)
    z = rows.lookup(torch.tensor([1, 2]))  # and the next step trains
    (z.sum() * 65536.0).backward()
    rows.apply(step=2, grad_scale=65536.0)
    assert not torch.equal(store.read_records(torch.arange(N)), before)
