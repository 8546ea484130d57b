"""A fused CUDA kernel (Triton) for the Adam/AdamW step on rows of tables resident on the GPU.

`step_rows` and the device tier use it, when Triton is importable, for `Adam`/`AdamW` with the
global step on CUDA tables with contiguous rows: float32 rows, or bfloat16/float16 rows (float32
moments) computed in float32 and rounded back once, to nearest or stochastically with the bits
`rounding.stochastic_round` gives the same values (noise keyed by ``(seed, step, id)``). One kernel
does the whole step in place on the tables, one program per position of the batch; duplicates are
found on the GPU, never on the host:

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
    def _noise24(z):
        """`rounding.uniform_noise` for int64 keys ``z``: splitmix64, the top 24 bits in [0, 1)."""
        z = z.to(tl.uint64, bitcast=True)
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        return (z >> 40).to(tl.float32) * (1.0 / 16777216.0)

    @triton.jit
    def _next16(bits, up):
        """The 16-bit float after ``bits`` (int32 holding the pattern) toward +inf where ``up``,
        toward -inf elsewhere: what ``torch.nextafter`` gives, signed zeros included."""
        neg = (bits & 0x8000) != 0
        mag = bits & 0x7FFF
        away = up != neg                        # moving away from zero: one more in magnitude
        toward_zero = tl.where(mag == 0, 0x0001 | tl.where(up, 0, 0x8000), bits - 1)
        return tl.where(away, bits + 1, toward_zero)

    @triton.jit
    def _round_rows(x, z, OUT: tl.constexpr, STOCHASTIC: tl.constexpr):
        """``x`` (float32) rounded into ``OUT``: to nearest even, or (``STOCHASTIC``) to the upper
        neighbour with probability (x - lo) / (hi - lo), exactly as `rounding.stochastic_round`
        picks it with the noise of keys ``z``."""
        near = x.to(OUT)
        if STOCHASTIC:
            back = near.to(tl.float32)
            bits = near.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            up = back <= x
            other = _next16(bits, up).to(tl.int16).to(OUT, bitcast=True).to(tl.float32)
            lo = tl.where(up, back, other)
            hi = tl.where(up, other, back)
            gap = hi - lo
            exact = (back == x) | ~(tl.abs(gap) <= 3.4028234663852886e38) | (gap == 0.0)
            frac = tl.where(exact, 0.0, tl.div_rn(x - lo, tl.where(exact, 1.0, gap)))
            out = tl.where(_noise24(z) < frac, hi, lo).to(OUT)
            near = tl.where(exact, near, out)
        return near

    @triton.jit
    def _adam_update(W, M, V, row, cols, mask, g, stride_w, stride_m, stride_v,
                     step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay,
                     key, dim, offset, ROUND: tl.constexpr):
        w = tl.load(W + row * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(M + row * stride_m + cols, mask=mask, other=0.0)
        v = tl.load(V + row * stride_v + cols, mask=mask, other=0.0)
        g = g + l2 * w                          # Adam's coupled weight decay (0 by default)
        w = w * decay                           # AdamW's decoupled weight decay (1 if none)
        m = m + one_minus_beta1 * (g - m)
        v = v + one_minus_beta2 * (g * g - v)
        w = w - step_size * tl.div_rn(m, tl.sqrt_rn(v) + eps)
        if ROUND == 0:                          # float32 rows
            tl.store(W + row * stride_w + cols, w, mask=mask)
        else:                                   # 16-bit rows: rounded once (1: nearest, 2: stochastic)
            z = key * dim + cols.to(tl.int64) + offset
            tl.store(W + row * stride_w + cols, _round_rows(w, z, W.dtype.element_ty, ROUND == 2), mask=mask)
        tl.store(M + row * stride_m + cols, m, mask=mask)
        tl.store(V + row * stride_v + cols, v, mask=mask)

    @triton.jit
    def _adam_rows_scan_kernel(W, M, V, G, IDS, KEYS, LAST, UPD, n, num_rows, dim,
                               stride_w, stride_m, stride_v, stride_g, stride_last, stride_upd, step_no,
                               step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay, offset,
                               BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, ROUND: tl.constexpr,
                               META: tl.constexpr):
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
        if ROUND == 2:                          # rounding noise keyed by the row's id, not its slot
            key = tl.load(KEYS + p).to(tl.int64)
        else:
            key = rid.to(tl.int64)
        _adam_update(W, M, V, rid.to(tl.int64), cols, (cmask & valid) != 0, g, stride_w, stride_m, stride_v,
                     step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay,
                     key, dim, offset, ROUND)
        if META:
            _count_update(LAST, UPD, rid.to(tl.int64), valid, stride_last, stride_upd, step_no)

    @triton.jit
    def _count_update(LAST, UPD, row, valid, stride_last, stride_upd, step_no):
        """The row's metadata (`TrainableRows.row_meta`): the step of its last update, and one
        more update, written once per row by the program that updated it."""
        if valid:
            tl.store(LAST + row * stride_last, step_no)
            tl.store(UPD + row * stride_upd, tl.load(UPD + row * stride_upd) + 1)

    @triton.jit
    def _adam_rows_sort_kernel(W, M, V, G, SORTED, ORDER, KEYS, LAST, UPD, n, num_rows, dim,
                               stride_w, stride_m, stride_v, stride_g, stride_last, stride_upd, step_no,
                               step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay, offset,
                               BLOCK_D: tl.constexpr, ROUND: tl.constexpr, META: tl.constexpr):
        p = tl.program_id(0)
        rid = tl.load(SORTED + p)
        prev = tl.load(SORTED + p - 1, mask=p > 0, other=-1)
        head = prev != rid                      # first position of a run of equal ids
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < dim
        src = tl.load(ORDER + p).to(tl.int64)
        if ROUND == 2:
            key = tl.load(KEYS + src).to(tl.int64)
        else:
            key = rid.to(tl.int64)
        g = tl.load(G + src * stride_g + cols, mask=cmask, other=0.0)
        q = p + 1
        nxt = tl.load(SORTED + q, mask=q < n, other=-1)
        while nxt == rid:                       # sum the run's other rows, in sorted order
            src = tl.load(ORDER + q).to(tl.int64)
            g += tl.load(G + src * stride_g + cols, mask=cmask, other=0.0)
            q += 1
            nxt = tl.load(SORTED + q, mask=q < n, other=-1)
        valid = head & (rid >= 0) & (rid < num_rows)
        _adam_update(W, M, V, rid.to(tl.int64), cols, (cmask & valid) != 0, g, stride_w, stride_m, stride_v,
                     step_size, one_minus_beta1, one_minus_beta2, eps, l2, decay,
                     key, dim, offset, ROUND)
        if META:
            _count_update(LAST, UPD, rid.to(tl.int64), valid, stride_last, stride_upd, step_no)


#: row dtypes the kernels update (moments are float32 in every case)
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_adam_step_rows(optimizer, weight: Tensor, state: dict[str, Tensor], ids: Tensor,
                         grads: Tensor, *, step: int, lr: float, stochastic_rounding: bool = False,
                         seed: int = 0, keys: Tensor | None = None,
                         meta: tuple[Tensor, Tensor] | None = None) -> bool:
    """Run the fused step if this case is covered; return False (doing nothing) otherwise.

    16-bit rows (bfloat16/float16; float32 moments) are computed in float32 and rounded back once
    inside the kernel: to nearest, or with ``stochastic_rounding`` exactly as
    `rounding.stochastic_round` rounds them with `rounding.uniform_noise` of ``(seed, step, key)``.
    ``keys``: the id each position's noise is keyed by (default ``ids``; a device tier passes the
    rows' ids where ``ids`` are its slots). ``meta``: int32 ``(rows, 1)`` views of the rows'
    ``last_step`` and ``updates``, set to ``step`` and counted up once per updated row by the same
    kernel (a device tier's rows: four launches fewer a step)."""
    from lightning_embcache.optim.adam import Adam
    from lightning_embcache.optim.rounding import noise_offset

    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if (triton is None or not isinstance(optimizer, Adam) or optimizer.per_row_step
            or m is None or v is None or len(state) != 2
            or weight.dtype not in ROW_DTYPES
            or not all(t.is_cuda and t.dim() == 2 and t.stride(1) == 1 for t in (weight, m, v))
            or m.dtype != torch.float32 or v.dtype != torch.float32
            or grads.shape[1] != weight.shape[1] or ids.numel() == 0
            or isinstance(step, bool) or not isinstance(step, int) or step < 1
            or (meta is not None and not all(t.is_cuda and t.dtype == torch.int32 and t.shape[0] == weight.shape[0]
                                             for t in meta))):
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
    rounding = 0 if weight.dtype == torch.float32 else 2 if stochastic_rounding else 1
    key_ids = ids if keys is None else keys.to(device=ids.device, dtype=torch.int64)
    offset = noise_offset(step, seed)
    last, upd = meta if meta is not None else (ids, ids)  # (not read without META)
    counts = (*strides, last.stride(0), upd.stride(0), step)
    if n <= SCAN_MAX_IDS:
        _adam_rows_scan_kernel[(n,)](weight, m, v, grads, ids, key_ids, last, upd, n, num_rows, dim, *counts,
                                     *scalars, offset, BLOCK_D=block, BLOCK_Q=32, ROUND=rounding,
                                     META=meta is not None, num_warps=2 if block <= 128 else 4)
    else:
        sorted_ids, order = torch.sort(ids, stable=True)
        _adam_rows_sort_kernel[(n,)](weight, m, v, grads, sorted_ids, order, key_ids, last, upd, n, num_rows, dim,
                                     *counts, *scalars, offset, BLOCK_D=block, ROUND=rounding,
                                     META=meta is not None, num_warps=1 if block <= 128 else 4)
    return True
