"""A row-sharded store on a CUDA module: the handle's get/update/prefetch/upcoming are the sharded
store's collectives (its owners keep their rows on their GPUs themselves), never a device tier
of the handle's own over the whole sharded table (which crashed on the 2-GPU DDP cell: a
ShardedStore has no row_bytes)."""

from __future__ import annotations

import torch

from lightning_embcache.lightning.handle import EmbeddingStoreHandle

N, DIM = 100, 4


class _ShardedStub:
    """What the handle sees of a ShardedStore: no row_bytes, no record layout, only collectives."""

    sharded, closed, readonly, num_rows, dim = True, False, False, N, DIM

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def get(self, ids):
        self.calls.append(("get", ids.tolist()))
        return torch.zeros(len(ids), DIM)

    def update(self, ids, values):
        self.calls.append(("update", ids.tolist()))

    def prefetch(self, ids):
        self.calls.append(("prefetch", ids.tolist()))

    def upcoming(self, ids):
        self.calls.append(("upcoming", ids.tolist()))


def test_a_sharded_store_on_a_cuda_module_is_served_by_its_collectives(monkeypatch):
    h = EmbeddingStoreHandle("codes", N, DIM, path=None, create_options={}, open_options={}, optim_config={})
    stub = _ShardedStub()
    h._store = stub  # type: ignore[assignment]
    monkeypatch.setattr(h, "_device", lambda: torch.device("cuda", 0))  # the module sits on a GPU
    ids = torch.tensor([3, 1, 4])
    h.prefetch(ids)
    h.upcoming(ids)
    h.update(ids, torch.ones(3, DIM))
    assert stub.calls == [("prefetch", [3, 1, 4]), ("upcoming", [3, 1, 4]), ("update", [3, 1, 4])]
    assert h._device_tier is None
