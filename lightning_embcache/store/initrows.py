"""Initial values of never-written rows, per row and deterministic in (seed, id).

``init="normal"`` draws row ``i`` from a counter-based generator keyed by (seed, i): a
splitmix64 hash of (seed, i, column pair) gives two 24-bit uniforms, Box-Muller turns them into two
standard normals. Every row is computed on its own in vectorised numpy, so a miss of one row costs
one row (a per-chunk generator made a miss cost a whole chunk), and a row's initial value does not
depend on which other rows are read with it or in what order.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_S40 = np.uint64(40)
_LOW24 = np.uint64(0xFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> _S30)
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def normal_rows(ids: np.ndarray, dim: int, seed: int, std: float) -> np.ndarray:
    """float32 (len(ids), dim): N(0, std^2) values that depend only on (seed, id, column)."""
    pairs = (dim + 1) // 2
    with np.errstate(over="ignore"):
        key = _mix(np.asarray([(int(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & (2**64 - 1)], np.uint64))
        ctr = ids.astype(np.uint64)[:, None] * np.uint64(pairs) + np.arange(pairs, dtype=np.uint64)
        ctr *= _GOLDEN
        ctr += key
        h = _mix(ctr)
    u1 = ((h >> _S40).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    u2 = ((h & _LOW24).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    r = np.sqrt(np.float32(-2.0) * np.log(u1)) * np.float32(std)
    t = np.float32(2 * np.pi) * u2
    out = np.empty((len(ids), 2 * pairs), np.float32)
    out[:, 0::2] = r * np.cos(t)
    out[:, 1::2] = r * np.sin(t)
    return out[:, :dim] if dim != 2 * pairs else out
