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


def _mix_inplace(x: np.ndarray, tmp: np.ndarray) -> None:
    """`_mix` without temporaries of its own (``tmp``: scratch of x's shape)."""
    np.right_shift(x, _S30, out=tmp)
    x ^= tmp
    x *= _M1
    np.right_shift(x, _S27, out=tmp)
    x ^= tmp
    x *= _M2
    np.right_shift(x, _S31, out=tmp)
    x ^= tmp


# Rows are made in blocks of about this many column pairs: a block's temporaries stay in the CPU's
# cache, where whole-batch temporaries went to memory and back once per operation.
_BLOCK_PAIRS = 8192


def normal_rows(ids: np.ndarray, dim: int, seed: int, std: float, out: np.ndarray | None = None) -> np.ndarray:
    """float32 (len(ids), dim): N(0, std^2) values that depend only on (seed, id, column), written
    into ``out`` (any (len(ids), dim) float32 view, e.g. the weight field of records) if given."""
    pairs = (dim + 1) // 2
    with np.errstate(over="ignore"):
        key = _mix(np.asarray([(int(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & (2**64 - 1)], np.uint64))[0]
    if out is None:
        out = np.empty((len(ids), dim), np.float32)
    step = max(1, _BLOCK_PAIRS // pairs)
    for a in range(0, len(ids), step):
        _block(ids[a : a + step], pairs, key, float(std), out[a : a + step])
    return out


def _block(ids: np.ndarray, pairs: int, key: np.uint64, std: float, out: np.ndarray) -> None:
    with np.errstate(over="ignore"):
        h = np.add(np.multiply(ids.astype(np.uint64)[:, None], np.uint64(pairs)), np.arange(pairs, dtype=np.uint64))
        h *= _GOLDEN
        h += key
        tmp = np.empty_like(h)
        _mix_inplace(h, tmp)
    # both halves are below 2**24: exact through int32 into float32 (a uint64 -> float32 cast is slow)
    u1 = np.right_shift(h, _S40, out=tmp).astype(np.int32).astype(np.float32)
    u2 = np.bitwise_and(h, _LOW24, out=h).astype(np.int32).astype(np.float32)
    u1 += np.float32(0.5)
    u1 *= np.float32(2.0**-24)
    u2 += np.float32(0.5)
    u2 *= np.float32(2.0**-24)
    np.log(u1, out=u1)  # r = sqrt(-2 log u1) * std, in float32 as ever: values never change
    u1 *= np.float32(-2.0)
    np.sqrt(u1, out=u1)
    u1 *= np.float32(std)
    u2 *= np.float32(2 * np.pi)
    cos = np.cos(u2)
    sin = np.sin(u2, out=u2)
    cos *= u1
    sin *= u1
    dim = out.shape[1]
    if dim == 2 * pairs:
        out[:, 0::2] = cos
        out[:, 1::2] = sin
    else:  # odd dim: the last pair's second value is dropped
        out[:, 0::2] = cos
        out[:, 1::2] = sin[:, : dim // 2]
