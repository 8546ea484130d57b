"""One kernel that swaps rows between a device pool and the mapped host table.

A device tier smaller than its table replaces, at every step, the rows it evicts by the rows the
next batch reads. Done as separate torch calls (gather the evicted records, check their weights,
scatter them to the host, gather the new ones, copy them into the pool) that is a dozen kernel
launches and index uploads a step, and on the training path each launch costs host time that
the model's own step does not have to spare. `swap_rows` does it in one launch over one index
array: program ``i`` writes the record in ``slots[i]`` to the host row ``out[i]`` (if ``>= 0``),
flags NaN/Inf among its weights, then loads host row ``in[i]`` (if ``>= 0``) into the slot. Each
program reads its slot before it writes it, so a slot may be both emptied and refilled.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the tier falls back to separate torch calls
    triton = None

#: weight dtypes whose NaN/Inf the kernel can see in 32-bit words: (kind, bytes per value)
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MAX_BLOCK = 4096


def available(pool: Tensor) -> bool:
    """Whether `swap_rows` can run on ``pool`` (Triton present, a CUDA pool of 4-byte words)."""
    return triton is not None and pool.is_cuda and pool.shape[1] % 4 == 0 and pool.data_ptr() % 4 == 0


def weight_words(pool: Tensor, weight: Tensor) -> tuple[int, int, int] | None:
    """``(first word, end word, kind)`` of the weight field ``weight`` (a view of ``pool``) in a
    record of 4-byte words, or None where the kernel cannot check it (unaligned, odd dtype)."""
    kind = _KINDS.get(weight.dtype)
    offset = weight.data_ptr() - pool.data_ptr()
    nbytes = weight.shape[1] * weight.element_size()
    if kind is None or offset % 4 or nbytes % 4:
        return None
    return offset // 4, (offset + nbytes) // 4, kind


if triton is not None:

    @triton.jit
    def _bad(x, KIND: tl.constexpr):
        """Per 32-bit word: does it hold a NaN/Inf of the weight dtype (all exponent bits set)."""
        if KIND == 0:
            return (x & 0x7F800000) == 0x7F800000
        elif KIND == 1:
            return ((x & 0x7F80) == 0x7F80) | ((x & 0x7F800000) == 0x7F800000)
        else:
            return ((x & 0x7C00) == 0x7C00) | ((x & 0x7C000000) == 0x7C000000)

    @triton.jit
    def _swap_kernel(POOL, HOST, IDX, FLAG, n, words, w_lo, w_hi,
                     BLOCK: tl.constexpr, CHECK: tl.constexpr, KIND: tl.constexpr):
        i = tl.program_id(0)
        slot = tl.load(IDX + i)
        out = tl.load(IDX + n + i)
        inn = tl.load(IDX + 2 * n + i)
        offs = tl.arange(0, BLOCK)
        if out >= 0:
            bad = tl.zeros((BLOCK,), dtype=tl.int32)
            for start in range(0, words, BLOCK):
                o = start + offs
                m = o < words
                x = tl.load(POOL + slot * words + o, mask=m, other=0)
                tl.store(HOST + out * words + o, x, mask=m)
                if CHECK:
                    w = m & (o >= w_lo) & (o < w_hi)
                    bad = tl.maximum(bad, (w & _bad(x, KIND)).to(tl.int32))
            if CHECK:
                if tl.max(bad, axis=0) > 0:
                    tl.atomic_max(FLAG, 1)
        if inn >= 0:
            for start in range(0, words, BLOCK):
                o = start + offs
                m = o < words
                x = tl.load(HOST + inn * words + o, mask=m, other=0)
                tl.store(POOL + slot * words + o, x, mask=m)


def swap_rows(pool: Tensor, host: Tensor, idx: Tensor, flag: Tensor | None,
              check: tuple[int, int, int] | None) -> None:
    """For ``n = len(idx) // 3``, ``slots, out, in = idx.view(3, n)`` (int64 on the device):
    ``host[out[i]] = pool[slots[i]]`` where ``out[i] >= 0`` (setting ``flag`` to 1 if a weight in
    words ``check[0]:check[1]`` is NaN/Inf), then ``pool[slots[i]] = host[in[i]]`` where
    ``in[i] >= 0``. ``pool`` and ``host``: uint8 ``(rows, row_bytes)``, ``row_bytes % 4 == 0``;
    ``host`` may be mapped host memory. ``check`` None: no NaN/Inf check (``flag`` unused)."""
    n = idx.numel() // 3
    if n == 0:
        return
    words = pool.shape[1] // 4
    block = min(_MAX_BLOCK, triton.next_power_of_2(words))
    lo, hi, kind = check if check is not None else (0, 0, 0)
    _swap_kernel[(n,)](pool.view(torch.int32), host.view(torch.int32), idx, flag if flag is not None else idx,
                       n, words, lo, hi, BLOCK=block, CHECK=check is not None, KIND=kind)
