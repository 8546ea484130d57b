"""LookaheadSampler hints each batch as one int64 tensor of its indices, whatever form the batch
sampler yields (lists, tuples, numpy arrays, tensors), and never changes what it yields."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_embcache import LookaheadSampler


class _Recorder:
    hot_bytes = None
    row_bytes = 64

    def __init__(self):
        self.hints: list[torch.Tensor] = []

    def upcoming(self, ids):
        self.hints.append(ids)


_BATCHES = [[5, 3, 9], [0, 7], [8, 1, 2, 4], [6]]
_FORMS = {
    "list": list,
    "tuple": tuple,
    "int64 array": lambda b: np.asarray(b, np.int64),
    "int32 array": lambda b: np.asarray(b, np.int32),
    "int64 tensor": lambda b: torch.tensor(b, dtype=torch.int64),
    "int32 tensor": lambda b: torch.tensor(b, dtype=torch.int32),
}


@pytest.mark.parametrize("form", list(_FORMS))
@pytest.mark.parametrize("id_fn", [None, lambda ix: ix * 10 + 1])
def test_each_batch_is_hinted_as_an_int64_tensor_of_its_ids(form, id_fn):
    batches = [_FORMS[form](b) for b in _BATCHES]
    store = _Recorder()
    got = list(LookaheadSampler(batches, store, lookahead=2, id_fn=id_fn))
    assert len(got) == len(batches) and all(g is b for g, b in zip(got, batches))  # yielded as they came
    for hint, b in zip(store.hints, _BATCHES):
        assert isinstance(hint, torch.Tensor) and hint.dtype == torch.int64
        want = torch.tensor(b) if id_fn is None else torch.tensor(b) * 10 + 1
        assert torch.equal(hint, want)


def test_a_hint_is_not_changed_by_the_caller_reusing_a_batch_list():
    store = _Recorder()
    batch = [1, 2, 3]
    it = iter(LookaheadSampler([batch, [4]], store, lookahead=1))
    next(it)
    batch[:] = [7, 7, 7]  # the loader's consumer changes the yielded list in place
    assert store.hints[0].tolist() == [1, 2, 3]
