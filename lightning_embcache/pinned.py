"""Reused pinned host buffers for copies between host RAM and a GPU that never wait for the GPU.

A buffer is handed out again only after the copy that last used it has finished (a CUDA event
recorded behind it), which by then it normally has: the host can stage the next batch while the
previous copy is still in flight, and no buffer is allocated per step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


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
            buf = torch.empty(max(nbytes, 4096) * 5 // 4, dtype=torch.uint8, pin_memory=True)
            self._bufs[i] = buf
        return i, buf

    def done(self, i: int, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Mark buffer ``i`` in use by the copies queued on ``stream`` so far."""
        ev = torch.cuda.Event()
        ev.record(stream)
        self._events[i] = ev
        return ev

    def to_device(self, src: Tensor | np.ndarray, device: torch.device) -> Tensor:
        """``src`` (host tensor or array) copied to ``device`` through the next buffer, without waiting."""
        t = torch.from_numpy(np.ascontiguousarray(src)) if isinstance(src, np.ndarray) else src.contiguous()
        if device.type != "cuda":
            return t.to(device)
        nbytes = t.numel() * t.element_size()
        i, buf = self.take(nbytes)
        staged = buf[:nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = staged.to(device, non_blocking=True)
        self.done(i, torch.cuda.current_stream(device))
        return out
