"""max_norm and stochastic rounding on the GPU device tier, against nn.Embedding on the same GPU and
against the host path (the rounding is keyed by (seed, step, id): the same bits on both)."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache import EmbeddingStore, TrainableRows, make_row_optimizer, trainable_fields
from lightning_embcache.device_tier import SLOT_OVERHEAD, DeviceTier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, DIM, STEPS = 2000, 16, 100


@pytest.mark.parametrize("fraction", [1.0, 0.25], ids=["inside-budget", "4x-over-budget"])
def test_max_norm_on_the_device_tier_trains_like_nn_embedding(tmp_path, fraction):
    opt = make_row_optimizer("adam", lr=0.05)
    store = EmbeddingStore.create(tmp_path / "s", N, DIM, init="normal", seed=1, chunk_rows=128,
                                  hot_bytes=None if fraction == 1.0 else 400 * 200,
                                  fields=trainable_fields(opt, DIM, torch.float32))
    tier = DeviceTier(store, "cuda", int(N * fraction) * (store.row_bytes + SLOT_OVERHEAD))
    rows = TrainableRows(store, opt, device_tier=tier, max_norm=1.0)
    emb = torch.nn.Embedding(N, DIM, max_norm=1.0, sparse=True, device="cuda")
    with torch.no_grad():
        emb.weight.copy_(store.get(torch.arange(N)).cuda())
    ref = torch.optim.SparseAdam(emb.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for step in range(1, STEPS + 1):
        ref.zero_grad()
        for _ in range(2):
            ids = torch.randint(0, N, (96,), generator=g)
            tgt = 3 * torch.randn(96, DIM, generator=g).cuda()
            ((emb(ids.cuda()) - tgt) ** 2).sum().backward()
            ((rows.lookup(ids) - tgt) ** 2).sum().backward()
            rows.collect()
        ref.step()
        rows.apply(step=step)
    rows.write_down()
    torch.testing.assert_close(store.get(torch.arange(N)), emb.weight.detach().cpu(), rtol=1e-5, atol=1e-5)
    store.close()


def _climb(tmp_path, device: bool, steps: int = 2000, optimizer: str = "sgd", rounding: bool | None = None):
    """bfloat16 rows of 1.0 under a constant gradient of -1: SGD and Adam at lr 1e-4 move each row
    by 1e-4 a step, a quarter of the rounding's half-step at 1.0."""
    opt = make_row_optimizer(optimizer, lr=1e-4)
    store = EmbeddingStore.create(None, 64, DIM, dtype=torch.bfloat16, init=lambda i: torch.ones(len(i), DIM),
                                  seed=7, fields=trainable_fields(opt, DIM, torch.bfloat16))
    tier = DeviceTier(store, "cuda", 64 * (store.row_bytes + SLOT_OVERHEAD)) if device else None
    rows = TrainableRows(store, opt, device_tier=tier, stochastic_rounding=rounding)
    ids = torch.arange(64)
    for step in range(1, steps + 1):
        (-rows.lookup(ids, device="cuda").float().sum()).backward()
        rows.apply(step=step)
    rows.write_down()
    rows.settle()
    out = store.get(ids).float()
    store.close()
    return out


def test_bf16_rows_learn_on_the_device_tier_with_the_host_paths_bits(tmp_path):
    on_device = _climb(tmp_path, True)
    assert abs(on_device.mean().item() - 1.2) < 0.02 * 1.2
    assert torch.equal(on_device, _climb(tmp_path, False, ))
