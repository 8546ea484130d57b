"""coalesce, RowGradBuffer, clipping, EMA and huge-page tables; hypothesis where it adds cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_embcache.optim import (
    RowGradBuffer,
    clip_grad_norm_with_rows_,
    clip_rows_by_norm_,
    clip_rows_by_value_,
    coalesce,
    ema_update,
    empty_hugepage,
    make_row_optimizer,
    rows_grad_norm,
    step_rows,
)
from lightning_embcache.optim.coalesce import _coalesce_index_add
from lightning_embcache.store.errors import InvalidArgumentError, InvalidTypeError

id_lists = st.lists(st.integers(0, 30), min_size=0, max_size=60)


def _dict_sum(ids, grads):
    out = {}
    for i, g in zip(ids.tolist(), grads.double()):
        out[i] = out.get(i, 0) + g
    return out


@settings(max_examples=60, deadline=None)
@given(ids=id_lists, seed=st.integers(0, 2**16))
def test_coalesce_sums_duplicates_like_a_dict(ids, seed):
    ids = torch.tensor(ids, dtype=torch.int64)
    grads = torch.randn(len(ids), 3, generator=torch.Generator().manual_seed(seed))
    uids, summed = coalesce(ids, grads)
    ref = _dict_sum(ids, grads)
    assert uids.tolist() == sorted(ref)
    for i, row in zip(uids.tolist(), summed.double()):
        torch.testing.assert_close(row, ref[i], rtol=1e-5, atol=1e-6)
    # the textbook unique + index_add_ gives the same answer
    if len(ids):
        uids2, summed2 = _coalesce_index_add(ids, grads)
        assert torch.equal(uids2, uids)
        torch.testing.assert_close(summed2, summed)


def test_coalesce_is_deterministic_and_keeps_unique_rows_exact():
    ids = torch.randint(0, 100, (5000,), generator=torch.Generator().manual_seed(0))
    grads = torch.randn(5000, 16)
    a = coalesce(ids, grads)
    b = coalesce(ids, grads)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    perm = torch.randperm(50)
    u, s = coalesce(perm, grads[:50])
    assert torch.equal(u, torch.arange(50))
    assert torch.equal(s[perm], grads[:50])          # no duplicates: rows moved, not re-added


def test_coalesce_sums_half_precision_in_float32():
    ids = torch.zeros(4096, dtype=torch.int64)
    grads = torch.full((4096, 2), 1.0, dtype=torch.bfloat16)
    _, summed = coalesce(ids, grads)
    assert summed.dtype == torch.float32 and summed[0, 0].item() == 4096.0


@pytest.mark.parametrize("ids,grads,error,message", [
    (torch.tensor([0.0]), torch.ones(1, 2), InvalidTypeError, "ids must be a 1-D int64 or int32 tensor"),
    (torch.tensor([[0]]), torch.ones(1, 2), InvalidTypeError, "ids must be a 1-D int64 or int32 tensor"),
    (torch.tensor([0]), torch.ones(2), InvalidTypeError, "grads must be a 2-D floating tensor"),
    (torch.tensor([0, 1]), torch.ones(3, 2), InvalidArgumentError, "grads must have one row per id; got 3 rows for 2 ids"),
])
def test_coalesce_rejects_bad_inputs(ids, grads, error, message):
    with pytest.raises(error, match=message):
        coalesce(ids, grads)


def test_row_grad_buffer_sums_micro_batches():
    buf = RowGradBuffer()
    buf.add(torch.tensor([3, 1]), torch.ones(2, 2))
    buf.add(torch.tensor([1, 5], dtype=torch.int32), torch.full((2, 2), 2.0))
    assert len(buf) == 4
    ids, grads = buf.pop()
    assert ids.tolist() == [1, 3, 5]
    assert grads[:, 0].tolist() == [3.0, 1.0, 2.0]
    assert len(buf) == 0
    with pytest.raises(InvalidArgumentError, match="needs at least one add"):
        buf.pop()


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["sgd", "adagrad", "rowwise_adagrad", "adam", "adamw"]),
       ids=st.lists(st.integers(0, 15), min_size=1, max_size=20), seed=st.integers(0, 2**16))
def test_step_rows_does_not_depend_on_the_order_of_ids(name, ids, seed):
    gen = torch.Generator().manual_seed(seed)
    opt = make_row_optimizer(name, **({"momentum": 0.9, "nesterov": True} if name == "sgd" else {}))
    weight = torch.randn(16, 4, generator=gen)
    state = {k: torch.rand(v.shape, generator=gen).to(v.dtype) for k, v in opt.init_state(16, 4).items()}
    ids = torch.tensor(ids)
    grads = torch.randn(len(ids), 4, generator=gen)
    perm = torch.randperm(len(ids), generator=gen)
    w1, s1 = weight.clone(), {k: v.clone() for k, v in state.items()}
    w2, s2 = weight.clone(), {k: v.clone() for k, v in state.items()}
    step_rows(opt, w1, s1, ids, grads, step=3)
    step_rows(opt, w2, s2, ids[perm], grads[perm], step=3)
    torch.testing.assert_close(w1, w2, rtol=1e-6, atol=1e-6)
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k], rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(max_norm=st.floats(0.0, 5.0), scale=st.floats(0.01, 100.0), seed=st.integers(0, 2**16))
def test_clip_rows_by_norm_bounds_each_row_and_keeps_direction(max_norm, scale, seed):
    g = torch.randn(8, 5, generator=torch.Generator().manual_seed(seed)) * scale
    before = g.clone()
    norms = clip_rows_by_norm_(g, max_norm)
    torch.testing.assert_close(norms, before.norm(dim=1))
    after = g.norm(dim=1)
    assert torch.all(after <= max_norm * (1 + 1e-5) + 1e-6)
    small = norms <= max_norm
    assert torch.equal(g[small], before[small]) or max_norm == 0
    cos = torch.nn.functional.cosine_similarity(g, before, dim=1)
    assert torch.all((cos > 0.9999) | (after < 1e-6))   # cosine_similarity clamps tiny norms


def test_clip_rows_by_value():
    g = torch.tensor([[-3.0, 0.5, 2.0]])
    clip_rows_by_value_(g, 1.0)
    assert g.tolist() == [[-1.0, 0.5, 1.0]]


def test_global_norm_counts_rows_as_a_dense_gradient():
    # A table of 6 rows as a dense parameter, and the same table as coalesced rows: same clipping.
    torch.manual_seed(0)
    dense = torch.nn.Parameter(torch.randn(3))
    dense.grad = torch.randn(3) * 4
    ids = torch.tensor([4, 1, 4])
    rows = torch.randn(3, 2) * 4
    uids, summed = coalesce(ids, rows)
    table = torch.nn.Parameter(torch.zeros(6, 2))
    table.grad = torch.zeros(6, 2).index_add_(0, ids, rows)
    ref_dense = dense.grad.clone()
    ref_total = torch.nn.utils.clip_grad_norm_([dense, table], max_norm=1.0)
    clipped_dense, dense.grad = dense.grad, ref_dense
    total = clip_grad_norm_with_rows_([dense], [summed], max_norm=1.0)
    torch.testing.assert_close(total, ref_total)
    torch.testing.assert_close(dense.grad, clipped_dense)
    torch.testing.assert_close(summed, table.grad[uids])
    torch.testing.assert_close(rows_grad_norm(table.grad[uids]) ** 2 + torch.zeros(()),
                               table.grad.norm() ** 2)


@settings(max_examples=40, deadline=None)
@given(momentum=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_ema_update_is_the_convex_combination(momentum, seed):
    gen = torch.Generator().manual_seed(seed)
    old, new = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    out = ema_update(old, new, momentum)
    torch.testing.assert_close(out, momentum * old + (1 - momentum) * new, rtol=1e-5, atol=1e-6)
    assert not out.data_ptr() == old.data_ptr()
    unit = ema_update(old, new, momentum, normalize=True)
    nonzero = (momentum * old + (1 - momentum) * new).norm(dim=1) > 1e-3
    assert torch.all((unit.norm(dim=1)[nonzero] - 1).abs() < 1e-5)


def test_ema_update_edges_and_errors():
    old, new = torch.ones(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2)
    assert torch.equal(ema_update(old, new, 1.0), old)
    assert torch.equal(ema_update(old, new, 0.0), new.to(torch.bfloat16))
    assert ema_update(old, new, 0.5).dtype == torch.bfloat16
    with pytest.raises(InvalidArgumentError, match=r"momentum must be in \[0, 1\]; got 1.5"):
        ema_update(old, new, 1.5)
    with pytest.raises(InvalidArgumentError, match="new must have old's shape"):
        ema_update(old, torch.zeros(3, 2), 0.5)


def test_empty_hugepage_is_a_writable_zeroed_table():
    t = empty_hugepage((1000, 16), torch.float32)
    assert t.shape == (1000, 16) and t.dtype == torch.float32 and torch.all(t == 0)
    t[999] = 3.0
    assert t.sum().item() == 48.0
