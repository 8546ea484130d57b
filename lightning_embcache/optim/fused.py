"""A fused CUDA kernel (Triton) for the Adam/AdamW step on rows of tables resident on the GPU.

`step_rows` uses it, when Triton is importable, for `Adam`/`AdamW` with the global step on
contiguous float32 CUDA tables. One kernel does the whole step in place on the tables, one
program per position of the batch; duplicates are found on the GPU, never on the host:

* ``scan`` (batches of at most `SCAN_MAX_IDS` ids): no sort at all. Each program scans the batch
  for its id; the program of the id's first position sums the gradient rows of all its positions
  (in position order, so deterministically), loads the row and its two moments, updates them and
  stores them back; the programs of later positions mask themselves out. One launch per step.
* ``sort`` (larger batches, where scanning costs O(B^2)): ids are sorted first (stable) and the
  program of the first position of each run of equal ids sums the run. A sort and one launch.

Unlike `coalesce`, neither waits for the GPU (the number of unique ids is never needed on the host),
so steps queue back to back and can be captured in a CUDA graph. Ids outside the table are skipped
by the kernel (never written); validating them is the caller's job, as for every inner function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU-only installs don't have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def fused_available(weight: Tensor) -> bool:
    return triton is not None and weight.is_cuda


#: batches up to this many ids use the sort-free scan kernel
SCAN_MAX_IDS = 2048

if triton is not None:

    @triton.jit
    def _adam_update(W, M, V, row, cols, mask, g, stride_w, stride_m, stride_v,
                     step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay):
        w = tl.load(W + row * stride_w + cols, mask=mask, other=0.0)
        m = tl.load(M + row * stride_m + cols, mask=mask, other=0.0)
        v = tl.load(V + row * stride_v + cols, mask=mask, other=0.0)
        g = g + l2 * w                          # Adam's coupled weight decay (0 by default)
        w = w * decay                           # AdamW's decoupled weight decay (1 if none)
        m = m + one_minus_beta1 * (g - m)
        v = v + one_minus_beta2 * (g * g - v)
        w = w - step_size * tl.div_rn(m, tl.sqrt_rn(v) + eps)
        tl.store(W + row * stride_w + cols, w, mask=mask)
        tl.store(M + row * stride_m + cols, m, mask=mask)
        tl.store(V + row * stride_v + cols, v, mask=mask)

    @triton.jit
    def _adam_rows_scan_kernel(W, M, V, G, IDS, n, num_rows, dim,
                               stride_w, stride_m, stride_v, stride_g,
                               step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay,
                               BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr):
        p = tl.program_id(0)
        rid = tl.load(IDS + p)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < dim
        qs = tl.arange(0, BLOCK_Q)
        g = tl.zeros([BLOCK_D], dtype=tl.float32)
        first = p
        start = 0
        while start < n:
            q = start + qs
            start += BLOCK_Q
            eq = (tl.load(IDS + q, mask=q < n, other=-1) == rid) & (q < n)
            hits = tl.sum(eq.to(tl.int32), axis=0)
            if hits > 0:                        # only blocks holding this id load gradient rows
                first = tl.minimum(first, tl.min(tl.where(eq, q, n), axis=0))
                rows = tl.load(G + q[:, None].to(tl.int64) * stride_g + cols[None, :],
                               mask=eq[:, None] & cmask[None, :], other=0.0)
                g += tl.sum(rows, axis=0)
        valid = (first == p) & (rid >= 0) & (rid < num_rows)
        _adam_update(W, M, V, rid.to(tl.int64), cols, cmask & valid, g, stride_w, stride_m, stride_v,
                     step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay)

    @triton.jit
    def _adam_rows_sort_kernel(W, M, V, G, SORTED, ORDER, n, num_rows, dim,
                          stride_w, stride_m, stride_v, stride_g,
                          step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay,
                          BLOCK_D: tl.constexpr):
        p = tl.program_id(0)
        rid = tl.load(SORTED + p)
        prev = tl.load(SORTED + p - 1, mask=p > 0, other=-1)
        head = prev != rid                      # first position of a run of equal ids
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < dim
        src = tl.load(ORDER + p).to(tl.int64)
        g = tl.load(G + src * stride_g + cols, mask=cmask, other=0.0)
        q = p + 1
        nxt = tl.load(SORTED + q, mask=q < n, other=-1)
        while nxt == rid:                       # sum the run's other rows, in sorted order
            src = tl.load(ORDER + q).to(tl.int64)
            g += tl.load(G + src * stride_g + cols, mask=cmask, other=0.0)
            q += 1
            nxt = tl.load(SORTED + q, mask=q < n, other=-1)
        valid = head & (rid >= 0) & (rid < num_rows)
        _adam_update(W, M, V, rid.to(tl.int64), cols, cmask & valid, g, stride_w, stride_m, stride_v,
                     step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay)


def fused_adam_step_rows(optimizer, weight: Tensor, state: dict[str, Tensor], ids: Tensor,
                         grads: Tensor, *, step: int, lr: float) -> bool:
    """Run the fused step if this case is covered; return False (doing nothing) otherwise."""
    from lightning_embcache.optim.adam import Adam

    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if (triton is None or not isinstance(optimizer, Adam) or optimizer.per_row_step
            or m is None or v is None or len(state) != 2
            or not all(t.is_cuda and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1
                       for t in (weight, m, v))
            or grads.shape[1] != weight.shape[1] or ids.numel() == 0
            or isinstance(step, bool) or not isinstance(step, int) or step < 1):
        return False
    beta1, beta2 = optimizer.betas
    wd = optimizer.weight_decay
    step_size = lr * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
    ids = ids.to(torch.int64)
    grads = grads.to(torch.float32)
    if grads.stride(1) != 1:
        grads = grads.contiguous()
    n, num_rows, dim = ids.numel(), weight.shape[0], weight.shape[1]
    block = triton.next_power_of_2(dim)
    scalars = (step_size, 1.0 - beta1, 1.0 - beta2, optimizer.eps,
               0.0 if optimizer._decoupled else wd, 1.0 - lr * wd if optimizer._decoupled else 1.0)
    strides = (weight.stride(0), m.stride(0), v.stride(0), grads.stride(0))
    if n <= SCAN_MAX_IDS:
        _adam_rows_scan_kernel[(n,)](weight, m, v, grads, ids, n, num_rows, dim, *strides, *scalars,
                                     BLOCK_D=block, BLOCK_Q=32, num_warps=2 if block <= 128 else 4)
    else:
        sorted_ids, order = torch.sort(ids, stable=True)
        _adam_rows_sort_kernel[(n,)](weight, m, v, grads, sorted_ids, order, n, num_rows, dim,
                                     *strides, *scalars,
                                     BLOCK_D=block, num_warps=1 if block <= 128 else 4)
    return True
