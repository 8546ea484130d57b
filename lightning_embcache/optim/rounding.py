"""Unbiased stochastic rounding of float32 values into bfloat16/float16 rows.

Round-to-nearest drops every update smaller than half the spacing of the row's values (at 1.0 a
bfloat16 step is 2**-7), so small learning rates stop moving 16-bit rows. Stochastic rounding
rounds up with probability equal to the distance from the lower neighbour, so the rounded value
equals the exact one on average and small updates accumulate.

The random numbers are a hash of ``(seed, step, row id, column)``, not a generator's stream: the
rounding of a row does not depend on which other rows share its batch, on how the batch is split
into passes, on the device, or on where a resumed run restarted. Same inputs, same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: row dtypes stochastic rounding applies to
ROUNDED_DTYPES = (torch.bfloat16, torch.float16)


def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_SEED_MUL = _signed(0xD6E8FEB86659FD93)


def _shr(z: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch shifts signed values arithmetically)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def noise_offset(step: int, seed: int) -> int:
    """The hash input's offset for ``(step, seed)``, as an int64 (the compiled CPU step uses it too)."""
    return _signed((int(step) * _GOLDEN + int(seed) * _SEED_MUL) % (1 << 64))


def uniform_noise(ids: Tensor, dim: int, *, step: int, seed: int) -> Tensor:
    """Float32 values in [0, 1) for every (row ``ids[i]``, column ``j``), from a splitmix64 hash."""
    cols = torch.arange(dim, dtype=torch.int64, device=ids.device)
    z = ids.to(torch.int64)[:, None] * dim + cols[None, :]
    z = z + noise_offset(step, seed)  # tensor int64 arithmetic wraps, as splitmix64's uint64 does
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))   # the top 24 bits


def stochastic_round(values: Tensor, dtype: torch.dtype, noise: Tensor) -> Tensor:
    """``values`` (float32) rounded into ``dtype`` to one of its two neighbours, the upper one with
    probability (value - lower) / (upper - lower): unbiased. ``noise``: uniform [0, 1), same shape.

    Values a 16-bit type holds exactly are returned unchanged; values beyond its range become
    infinite, as round-to-nearest makes them.
    """
    near = values.to(dtype)
    back = near.to(values.dtype)
    # the other neighbour, on the far side of the value from the nearest one
    toward = torch.where(back > values, torch.full_like(near, float("-inf")), torch.full_like(near, float("inf")))
    other = torch.nextafter(near, toward)
    lo = torch.where(back <= values, back, other.to(values.dtype))
    hi = torch.where(back <= values, other.to(values.dtype), back)
    gap = hi - lo
    exact = (back == values) | ~torch.isfinite(gap) | (gap == 0)
    frac = torch.where(exact, torch.zeros_like(values), (values - lo) / torch.where(exact, torch.ones_like(gap), gap))
    up = noise < frac
    out = torch.where(up, hi, lo).to(dtype)
    return torch.where(exact, near, out)
