"""Combining per-rank figures with one collective.

Each rank writes its values into its own slot of a ``world_size x k`` buffer of zeros and the
buffer is summed with one ``all_reduce``: every rank then holds every rank's row, from which sums,
maxima, the slowest rank and the spread follow locally. One collective of ``world_size * k``
doubles (a few KiB even for a thousand ranks) replaces a SUM and a MAX reduction and also says
*which* rank is slowest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_embcache.distributed.exchange import world


def _collective_device(device: torch.device | None) -> torch.device:
    if device is not None and device.type == "cuda" and dist.get_backend() == "nccl":
        return device
    return torch.device("cpu")


def gather_rows(values: list[float], device: torch.device | None = None) -> list[list[float]]:
    """Every rank's ``values`` (same length on all ranks), in rank order. Blocking; all ranks join."""
    rank, size = world()
    if size == 1:
        return [list(values)]
    k = len(values)
    buf = torch.zeros(size * k, dtype=torch.float64)
    buf[rank * k:(rank + 1) * k] = torch.tensor(values, dtype=torch.float64)
    buf = buf.to(_collective_device(device))
    dist.all_reduce(buf)
    return buf.view(size, k).tolist()


class PendingRows:
    """A :func:`gather_rows` that never blocks the host on CUDA: pinned buffers, non-blocking
    copies, an event; :meth:`result` is None until the event has completed."""

    def __init__(self, values: list[float], device: torch.device) -> None:
        rank, size = world()
        k = len(values)
        self._shape = (size, k)
        host = torch.zeros(size * k, dtype=torch.float64, pin_memory=True)
        host[rank * k:(rank + 1) * k] = torch.tensor(values, dtype=torch.float64)
        dev = host.to(device, non_blocking=True)
        dist.all_reduce(dev)
        self._out = torch.empty(size * k, dtype=torch.float64, pin_memory=True)
        self._out.copy_(dev, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))
        self._keep: tuple[torch.Tensor, torch.Tensor] | None = (host, dev)  # alive until the copies are done

    def result(self) -> list[list[float]] | None:
        if not self._event.query():
            return None
        self._keep = None
        return self._out.view(*self._shape).tolist()
