"""Reused pinned host buffers for copies between host RAM and a GPU that never wait for the GPU.

A buffer is handed out again only after the copy that last used it has finished (a CUDA event
recorded behind it), which by then it normally has: the host can stage the next batch while the
previous copy is still in flight, and no buffer is allocated per step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lightning_embcache.store.errors import OutOfMemoryError

#: torch dtype of each numpy dtype (a view of the pinned uint8 buffer keeps it pinned for torch)
_TORCH_DTYPE = {np.dtype(t): torch.from_numpy(np.zeros(1, t)).dtype
                for t in (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32,
                          np.float64)}


def pinned_empty(nbytes: int) -> Tensor:
    """``nbytes`` of page-locked host memory (uint8); running out of it raises the store's
    `OutOfMemoryError` naming what to lower, not a raw CUDA error."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            raise OutOfMemoryError(
                f"could not pin {nbytes} bytes of host memory for copies to the GPU ({exc}); these buffers "
                f"hold one batch's rows (or one transfer of {nbytes} bytes): lower the batch size, the "
                f"lookahead or device_bytes, or free host memory (other pinned buffers, DataLoader "
                f"pin_memory)") from None
        raise


class PinnedRing:
    """``slots`` pinned buffers used round robin; each grows to the largest request it served."""

    def __init__(self, slots: int = 4) -> None:
        self.size = slots
        self._bufs: list[Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, Tensor]:
        """The next buffer (uint8, at least ``nbytes``) and its index for `done`."""
        i = self._next
        self._next = (i + 1) % self.size
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()  # waits for that one old copy, not for the device
            self._events[i] = None
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            self._bufs[i] = None  # a failed allocation keeps no stale, too small buffer
            buf = pinned_empty(max(nbytes, 4096) * 5 // 4)
            self._bufs[i] = buf
        return i, buf

    def done(self, i: int, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Mark buffer ``i`` in use by the copies queued on ``stream`` so far."""
        ev = torch.cuda.Event()
        ev.record(stream)
        self._events[i] = ev
        return ev

    def to_device(self, src: Tensor | np.ndarray, device: torch.device,
                  stream: torch.cuda.Stream | None = None) -> Tensor:
        """``src`` (host tensor or array) copied to ``device`` through the next buffer, without
        waiting; ``stream``: the current stream of ``device``, where the caller knows it."""
        if isinstance(src, np.ndarray) and device.type == "cuda" and src.dtype in _TORCH_DTYPE:
            # index arrays (the tier's slots, several per step): numpy fills the buffer on the
            # calling thread, with no torch dispatch and no release of the GIL that a background
            # thread would then have to wait to take back
            i, buf = self.take(src.nbytes)
            staged = buf[: src.nbytes]
            np.copyto(staged.numpy().view(src.dtype).reshape(src.shape), src)
            out = staged.view(_TORCH_DTYPE[src.dtype]).view(src.shape).to(device, non_blocking=True)
            self.done(i, stream if stream is not None else torch.cuda.current_stream(device))
            return out
        t = torch.from_numpy(np.ascontiguousarray(src)) if isinstance(src, np.ndarray) else src.contiguous()
        if device.type != "cuda":
            return t.to(device)
        nbytes = t.numel() * t.element_size()
        i, buf = self.take(nbytes)
        staged = buf[:nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = staged.to(device, non_blocking=True)
        self.done(i, stream if stream is not None else torch.cuda.current_stream(device))
        return out
