"""The per-tensor id validation cache never lets a changed tensor through unchecked."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache import EmbeddingStore, InvalidArgumentError


def test_ids_changed_in_place_after_a_get_are_validated_again():
    store = EmbeddingStore.create(None, 10, 2)
    ids = torch.tensor([1, 2, 3])
    store.get(ids)
    ids[0] = 10  # out of range now; the tensor's version counter moved
    with pytest.raises(InvalidArgumentError, match=r"\[0, 10\)"):
        store.update(ids, torch.ones(3, 2))
    assert torch.equal(store.get(torch.arange(10)), torch.zeros(10, 2))  # nothing written
