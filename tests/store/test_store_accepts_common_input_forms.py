"""Ids and values arrive in many forms (tensors of any int dtype, numpy, lists, strided or
grad-tracking tensors); all of them store exactly what a plain tensor assignment would."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore, InvalidArgumentError, VersionNotFoundError

N, DIM = 300, 6


@pytest.fixture(params=["memory", "disk"])
def store(request, shm_path):
    hot = None if request.param == "memory" else 20 * (DIM * 4 + 11)
    with EmbeddingStore.create(shm_path / "s", N, DIM, chunk_rows=32, hot_bytes=hot) as s:
        yield s


@pytest.mark.parametrize("make_ids", [
    lambda ix: torch.tensor(ix, dtype=torch.int32),
    lambda ix: torch.tensor(ix, dtype=torch.int16),
    lambda ix: np.array(ix, dtype=np.uint16),
    lambda ix: np.array(ix, dtype=np.int64),
    lambda ix: list(ix),
    lambda ix: torch.tensor([0] + list(ix), dtype=torch.int64)[1:],  # a view with an offset
    lambda ix: torch.tensor(ix, dtype=torch.int64).repeat_interleave(2)[::2],  # strided
], ids=["int32", "int16", "np-uint16", "np-int64", "list", "offset-view", "strided"])
def test_id_forms(store, make_ids):
    ix = [5, 250, 5, 31, 32]
    vals = torch.arange(len(ix) * DIM, dtype=torch.float32).reshape(len(ix), DIM)
    store.update(make_ids(ix), vals)
    want = torch.zeros(N, DIM)
    for i, row in enumerate(ix):
        want[row] = vals[i]
    assert torch.equal(store.get(make_ids(ix)), want[ix])
    assert torch.equal(store.get(torch.arange(N)), want)


@pytest.mark.parametrize("make_vals", [
    lambda v: v.double(),
    lambda v: v.t().contiguous().t(),  # non-contiguous
    lambda v: v.clone().requires_grad_(True),
    lambda v: v.numpy(),
    lambda v: v.to(torch.int64),
    lambda v: v.half(),
], ids=["float64", "transposed", "requires-grad", "numpy", "int64", "float16"])
def test_value_forms_are_cast_to_the_store_dtype(store, make_vals):
    ids = torch.tensor([7, 8, 100])
    vals = torch.tensor([[1.0, -2.0, 3.5, 0.25, 8.0, 1024.0]]).repeat(3, 1) * torch.tensor([[1.0], [2.0], [-1.0]])
    given = make_vals(vals)
    store.update(ids, given)
    got = store.get(ids)
    want = (torch.from_numpy(given) if isinstance(given, np.ndarray) else given.detach()).to(torch.float32)
    assert got.dtype == torch.float32 and not got.requires_grad
    assert torch.equal(got, want)


def test_empty_ids(store):
    assert tuple(store.get(torch.tensor([], dtype=torch.int64)).shape) == (0, DIM)
    store.update([], torch.zeros(0, DIM))
    assert store.stats().dirty_rows == 0


def test_callable_init_must_be_given_again_on_open(shm_path):
    def init(ids):
        return ids.float()[:, None].expand(len(ids), DIM).contiguous()

    EmbeddingStore.create(shm_path / "c", N, DIM, init=init).close()
    with pytest.raises(InvalidArgumentError, match="init="):
        EmbeddingStore.open(shm_path / "c")
    with EmbeddingStore.open(shm_path / "c", readonly=True, init=init) as s:
        assert torch.equal(s.get([3]), torch.full((1, DIM), 3.0))


def test_pin_of_an_unknown_version_is_refused(shm_path):
    with EmbeddingStore.create(shm_path / "p", N, DIM) as s:
        with pytest.raises(VersionNotFoundError, match="version=42"):
            s.pin(42)
        assert s.pinned() == []
