"""`handle.grow` on a CUDA module: the device tier (a whole-table tier, a cache of a disk-mode table,
host rows mapped for the GPU) is written down and made again at the new size; rows match the CPU."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_embcache import EmbeddingStore, EmbeddingStoreMixin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, GROWN, DIM = 1000, 2500, 8
ROW = DIM * 4 * 3  # weight + Adam's two moments


class Codes(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path, hot_bytes, device_bytes):
        super().__init__()
        self.codes = self.add_embedding_store("codes", num_rows=N, dim=DIM, path=path, hot_bytes=hot_bytes,
                                              device_bytes=device_bytes, chunk_rows=128, init="normal", seed=2,
                                              optimizer="adam", lr=0.1, if_exists="resume")


def train(model, steps, rows):
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        ids = torch.randint(0, rows, (64,), generator=g)
        z = model.codes.lookup(ids.to(model.device))
        z.pow(2).sum().backward()
        model.codes.step(step)


@pytest.mark.parametrize(("hot_bytes", "device_bytes"), [(None, None), (None, 0), (200 * (ROW + 11), 300 * (ROW + 26))],
                         ids=["whole-table-tier", "mapped-host-rows", "disk-mode-cache"])
def test_grow_under_a_device_tier_matches_the_same_steps_on_the_cpu(tmp_path, hot_bytes, device_bytes):
    got = {}
    for device in ("cuda", "cpu"):
        model = Codes(tmp_path / device, hot_bytes, device_bytes).to(device)
        train(model, 5, N)
        before = model.codes.get(torch.arange(N)).cpu()
        model.codes.grow(GROWN)
        assert model.codes.num_rows == GROWN
        assert torch.equal(model.codes.get(torch.arange(N)).cpu(), before)
        with EmbeddingStore.create(None, GROWN, DIM, chunk_rows=128, init="normal", seed=2) as fresh:
            assert torch.equal(model.codes.get(torch.arange(N, GROWN)).cpu(), fresh.get(torch.arange(N, GROWN)))
        train(model, 5, GROWN)
        model.codes.flush()
        got[device] = model.codes.get(torch.arange(GROWN)).cpu()
        model.codes.close()
        with EmbeddingStore.open(tmp_path / device) as store:
            assert store.num_rows == GROWN and torch.equal(store.get(torch.arange(GROWN)), got[device])
    torch.testing.assert_close(got["cuda"], got["cpu"], rtol=1e-5, atol=1e-6)
