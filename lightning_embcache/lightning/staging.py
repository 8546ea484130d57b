"""Host-to-device copies of store rows through pinned staging buffers."""

from __future__ import annotations

import torch


class PinnedStaging:
    """Copies CPU rows to a CUDA device with ``non_blocking=True`` through reused pinned buffers.

    Two buffers alternate. Each remembers a CUDA event recorded after its copy was queued, and the
    event is waited on before the buffer is refilled, so a copy still in flight is never
    overwritten while the next batch is staged. Buffers grow to the largest batch seen.
    """

    SLOTS = 2

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * self.SLOTS
        self._events: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self._next = 0

    def to_device(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return rows.to(device)
        slot = self._next
        self._next = (slot + 1) % self.SLOTS
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        buf = self._buffers[slot]
        n = rows.numel()
        if buf is None or buf.dtype != rows.dtype or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=rows.dtype, pin_memory=True)
            self._buffers[slot] = buf
        staged = buf[:n].view(rows.shape)
        staged.copy_(rows)
        out = staged.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._events[slot] = event
        return out
