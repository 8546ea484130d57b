"""Rows reach a CUDA module through pinned staging buffers (runs only where CUDA is available)."""

from __future__ import annotations

import pytest
import torch
from _lightning_helpers import tiny_model, tiny_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_get_returns_rows_on_the_module_device_and_buffers_are_not_overwritten_in_flight(tmp_path):
    model = tiny_model(tmp_path / "latents").cuda()
    store = model.latents.store
    rows = model.latents.get(torch.arange(100, device="cuda"))
    assert rows.device.type == "cuda" and rows.dtype == torch.float32
    assert torch.equal(rows.cpu(), store.get(torch.arange(100)))
    # many gets queued back to back: two pinned buffers alternate behind CUDA events
    outs = [model.latents.get(torch.arange(i, i + 64, device="cuda")) for i in range(0, 448, 64)]
    torch.cuda.synchronize()
    for i, out in zip(range(0, 448, 64), outs):
        assert torch.equal(out.cpu(), store.get(torch.arange(i, i + 64)))
    model.latents.update(torch.arange(100, device="cuda"), rows * 2)  # values on the GPU
    assert torch.equal(model.latents.get(torch.arange(100)).cpu(), (rows * 2).cpu())
    model.latents._release()


def test_fit_on_gpu_keeps_the_store_on_the_host(tmp_path):
    from lightning.pytorch.callbacks import Callback

    seen = []

    class Devices(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.append((next(pl_module.decoder.parameters()).device.type,
                         pl_module.latents.get(torch.arange(4)).device.type))

    model = tiny_model(tmp_path / "latents")
    tiny_trainer(tmp_path, accelerator="gpu", devices=1, max_steps=4, callbacks=[Devices()]).fit(model)
    assert seen == [("cuda", "cuda")] * 4
    assert model.latents.store.get(torch.arange(4)).device.type == "cpu"
