"""Running out of pinned host memory raises the store's `OutOfMemoryError`, naming what to
lower, never a raw CUDA error (the allocation is mocked: no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache import OutOfMemoryError, StoreError, pinned


def _failing(exc: BaseException):
    def empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise exc
        return torch.zeros(*args, **{k: v for k, v in kwargs.items() if k != "pin_memory"})
    return empty


@pytest.mark.parametrize("exc", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("CUDA error: out of memory")])
def test_pinned_allocation_failure_is_a_store_error_naming_what_to_lower(monkeypatch, exc):
    monkeypatch.setattr(pinned.torch, "empty", _failing(exc))
    ring = pinned.PinnedRing(2)
    with pytest.raises(OutOfMemoryError) as info:
        ring.take(1 << 20)
    assert isinstance(info.value, StoreError) and isinstance(info.value, MemoryError)
    msg = str(info.value)
    assert "pin" in msg and "batch size" in msg and "device_bytes" in msg
    assert ring._bufs == [None, None]  # nothing half-made is kept


def test_other_runtime_errors_pass_through(monkeypatch):
    monkeypatch.setattr(pinned.torch, "empty", _failing(RuntimeError("Cannot access accelerator device")))
    with pytest.raises(RuntimeError, match="accelerator") as info:
        pinned.pinned_empty(4096)
    assert not isinstance(info.value, StoreError)
