"""Apply a row optimizer to rows of tensors held in memory (flat tables), and allocate such tables.

`step_rows` is the whole sparse step for a table that is a plain tensor: coalesce, gather the rows
and their state, `RowOptimizer.step`, scatter back. The store does the same with its own get/update.
`empty_hugepage` allocates a CPU table on transparent huge pages: a batch of random rows touches one
4 KiB page per row, so with 2 MiB pages far fewer TLB misses are paid per step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_embcache.optim import fused_cpu
from lightning_embcache.optim.base import RowOptimizer
from lightning_embcache.optim.coalesce import check_rows, coalesce
from lightning_embcache.optim.fused import fused_adam_step_rows, fused_available
from lightning_embcache.store.errors import InvalidArgumentError
from lightning_embcache.store.memory import HUGE_PAGE, PageBuffer

#: rows per gather-update-scatter pass on CPU: the gathered rows, moments and temporaries of one
#: pass (about 10 x chunk x dim x 4 bytes) stay in L2, and the scatter writes lines still cached
CPU_CHUNK_ROWS = 512


@torch.no_grad()
def step_rows(optimizer: RowOptimizer, weight: Tensor, state: dict[str, Tensor], ids: Tensor,
              grads: Tensor, *, step: int, lr: float | None = None,
              coalesced: bool = False, chunk_rows: int | None = None,
              fused: bool | None = None, stochastic_rounding: bool = False, seed: int = 0) -> None:
    """Update rows `ids` of `weight` (Tensor[N, dim]) and of each `state[name]` (Tensor[N, cols]).

    Args:
        optimizer: the row optimizer; `state` must hold every column of its `state_fields`.
        ids, grads: gradient rows, duplicates allowed (they are summed) unless `coalesced=True`
            promises each id once.
        step, lr: as `RowOptimizer.step`.
        chunk_rows: rows per pass (the update is row-independent, so any split gives the same
            result). Default: `CPU_CHUNK_ROWS` on CPU, all rows at once on CUDA.
        fused: one fused pass for Adam/AdamW with the global step on float32 tables. CUDA: the
            Triton kernels of `lightning_embcache.optim.fused` (one launch, no host sync). CPU: the
            compiled loop of `lightning_embcache.optim.fused_cpu`, built on first `fused=True`.
            None (default): CUDA kernels where they apply, the CPU loop only once loaded; False
            never; True requires it (raises where it does not apply).
        stochastic_rounding, seed: 16-bit tables: write rows back with unbiased stochastic
            rounding keyed by ``(seed, step, id)`` (see `RowOptimizer.step`).
    """
    check_rows(ids, grads)              # before any kernel reads them
    lr_now = optimizer.lr if lr is None else lr
    if fused is not False and fused_available(weight):
        if fused_adam_step_rows(optimizer, weight, state, ids, grads, step=step, lr=lr_now,
                                stochastic_rounding=stochastic_rounding, seed=seed):
            return
    if weight.device.type == "cpu" and (fused or (fused is None and fused_cpu.loaded())):
        if fused_cpu.fused_cpu_adam_step_rows(optimizer, weight, state, ids, grads, step=step, lr=lr_now,
                                              stochastic_rounding=stochastic_rounding, seed=seed):
            return
    if fused:
        raise InvalidArgumentError(
            "fused=True needs Adam/AdamW without per_row_step on float32 tables with contiguous rows "
            f"(CPU: bfloat16 rows too; CUDA: and Triton); got {type(optimizer).__name__} on {weight.device} "
            f"{weight.dtype}"
        )
    if not coalesced:
        ids, grads = coalesce(ids, grads)
    if chunk_rows is None:
        chunk_rows = ids.numel() if ids.is_cuda else CPU_CHUNK_ROWS
    for start in range(0, ids.numel(), max(chunk_rows, 1)):
        part = ids[start : start + chunk_rows]
        w = weight.index_select(0, part)
        rows = {name: t.index_select(0, part) for name, t in state.items()}
        optimizer.step(
            w,
            rows,
            grads[start : start + chunk_rows],
            step=step,
            lr=lr,
            ids=part,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
        )
        weight.index_copy_(0, part, w)
        for name, t in state.items():
            t.index_copy_(0, part, rows[name])


def empty_hugepage(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, fill: float | None = 0.0) -> Tensor:
    """A CPU tensor backed by an anonymous mapping advised `MADV_HUGEPAGE` (falls back silently).

    The mapping lives as long as the tensor. Transparent huge pages must be `always` or `madvise`
    in /sys/kernel/mm/transparent_hugepage/enabled for the advice to take effect; the memory is
    faulted in (zeroed, or filled with `fill`) here so the first training step does not pay for it.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(math.prod(shape) * itemsize, 1)
    # the store's huge-page buffer (2 MiB-rounded anonymous mapping, MADV_HUGEPAGE, safe fallback)
    array = PageBuffer(-(-nbytes // HUGE_PAGE) * HUGE_PAGE).array[:nbytes]
    tensor = torch.from_numpy(array).view(dtype).view(shape)  # keeps array (and its mapping) alive
    if fill is not None:
        tensor.fill_(fill)
    return tensor


def hugepage_bytes() -> int:
    """AnonHugePages of this process in bytes (0 where /proc is unavailable), to check the advice took."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
