"""Sum the gradients of duplicate ids, and collect gradient rows across micro-batches.

A sparse optimizer's update is not linear in the gradient, so each id must reach it once, with
the sum of all its gradient rows (what `torch.sparse_coo_tensor(...).coalesce()` does for
`torch.optim.SparseAdam`).

Cost on CUDA: the number of unique ids decides the output's size, so it must reach the host:
one device-to-host sync per call is unavoidable for an exact-size result (`torch.unique` and
`torch.unique_consecutive` both make it). `coalesce` makes exactly one (inside
`unique_consecutive`); the sort, the reduction and the gather are queued without waiting. On CPU
nothing waits.

Determinism: `index_add_` on CUDA adds with atomics, so the order of the additions (and the
float result) can change between runs. `coalesce` therefore sorts the rows by id (stable) and sums
each run of equal ids with `torch.segment_reduce` on CUDA, which adds in a fixed order (on CPU
`index_add_` over the sorted rows, a sequential loop).
On CPU it first checks for duplicates (a free host-side test there) and, when there are none (the
usual case for a few thousand ids out of millions), only reorders the rows: a sort and one gather,
about 40 us for 512 x 128 against 130 us for `unique` + `index_add_`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_embcache.store.errors import InvalidArgumentError, InvalidTypeError


def check_rows(ids: Tensor, grads: Tensor) -> None:
    """Raise unless `ids` is 1-D integer, `grads` 2-D floating with one row per id, on one device."""
    if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
        raise InvalidTypeError(
            f"ids must be a 1-D int64 or int32 tensor; got {getattr(ids, 'dtype', type(ids).__name__)} "
            f"of shape {tuple(getattr(ids, 'shape', ()))}")
    if not isinstance(grads, Tensor) or not grads.is_floating_point() or grads.dim() != 2:
        raise InvalidTypeError(f"grads must be a 2-D floating tensor; got "
                               f"{getattr(grads, 'dtype', type(grads).__name__)} of shape "
                               f"{tuple(getattr(grads, 'shape', ()))}")
    if grads.shape[0] != ids.shape[0]:
        raise InvalidArgumentError(
            f"grads must have one row per id; got {grads.shape[0]} rows for {ids.shape[0]} ids")
    if grads.device != ids.device:
        raise InvalidArgumentError(f"ids and grads must be on one device; got {ids.device} and {grads.device}")


def coalesce(ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Return `(unique_ids, summed_grads)`: ids sorted ascending, each once, with its rows summed.

    Args:
        ids: Tensor[N] of int64 (or int32) row ids, any order, duplicates allowed.
        grads: Tensor[N, dim], one gradient row per id.

    Returns:
        unique_ids: Tensor[U] int64, ascending. summed_grads: Tensor[U, dim]; float16/bfloat16
        gradients are summed and returned in float32, so that many duplicates lose no precision.

    Deterministic on CPU and CUDA; one host sync on CUDA (see the module docstring).
    """
    check_rows(ids, grads)
    ids = ids.to(torch.int64)
    if grads.dtype in (torch.float16, torch.bfloat16):
        grads = grads.float()
    if ids.numel() == 0:
        return ids, grads
    return _coalesce_sorted(ids, grads)


def _coalesce_sorted(ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    sorted_ids, order = torch.sort(ids, stable=True)
    rows = grads.index_select(0, order)
    if not ids.is_cuda and not bool((sorted_ids[1:] == sorted_ids[:-1]).any()):
        return sorted_ids, rows                 # CPU, no duplicates: reordering is all
    unique_ids, inverse, counts = torch.unique_consecutive(   # the CUDA sync
        sorted_ids, return_inverse=True, return_counts=True)
    if unique_ids.numel() == ids.numel():
        return unique_ids, rows
    if ids.is_cuda:
        return unique_ids, torch.segment_reduce(rows, "sum", lengths=counts, axis=0)
    # CPU index_add_ is a sequential loop, so deterministic, and 10x faster than segment_reduce
    out = torch.zeros(unique_ids.numel(), rows.shape[1], dtype=rows.dtype)
    return unique_ids, out.index_add_(0, inverse, rows)


def _coalesce_index_add(ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """`unique` + `index_add_`: the textbook version, kept as the tests' second opinion.

    Not used on CUDA: `index_add_` there adds duplicates with atomics, in no fixed order.
    """
    unique_ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    out = torch.zeros(unique_ids.numel(), grads.shape[1], dtype=grads.dtype, device=grads.device)
    out.index_add_(0, inverse, grads)
    return unique_ids, out


class RowGradBuffer:
    """Collects `(ids, grads)` of several micro-batches and hands them back coalesced.

    Gradient accumulation for rows: `add` after each backward, `pop` at the optimizer step. The
    rows of an id seen in several micro-batches are summed, as autograd sums a dense parameter's
    gradients across backward passes.

    Example::

        buf = RowGradBuffer()
        for micro in batches:
            buf.add(micro.ids, z.grad)
        ids, grads = buf.pop()             # unique ids, summed gradient rows; buffer is empty again
    """

    def __init__(self) -> None:
        self._ids: list[Tensor] = []
        self._grads: list[Tensor] = []

    def add(self, ids: Tensor, grads: Tensor) -> None:
        check_rows(ids, grads)
        self._ids.append(ids.detach().to(torch.int64))
        self._grads.append(grads.detach())

    def __len__(self) -> int:
        """Number of gradient rows held (before coalescing)."""
        return sum(int(i.numel()) for i in self._ids)

    def pop(self) -> tuple[Tensor, Tensor]:
        """The coalesced rows of everything added since the last `pop`; empties the buffer."""
        if not self._ids:
            raise InvalidArgumentError("RowGradBuffer.pop() needs at least one add(); got none")
        ids, grads = self._ids, self._grads
        self._ids, self._grads = [], []
        if len(ids) == 1:
            return coalesce(ids[0], grads[0])
        return coalesce(torch.cat(ids), torch.cat(grads))   # cat promotes mixed dtypes

    def clear(self) -> None:
        self._ids, self._grads = [], []
