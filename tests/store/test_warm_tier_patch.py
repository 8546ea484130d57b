"""WarmTier.patch keeps every copy it returns equal to a plain model of the chunks' records,
whether the chunk is held raw (patched) or compressed (the caller is told to drop it), and
within the budget."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_embcache.store.warm import WarmTier

ROWS, RB = 32, 16


def _records(seed: int, compressible: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if compressible:
        return np.repeat(rng.integers(0, 4, (ROWS, 1), dtype=np.uint8), RB, axis=1)
    return rng.integers(0, 256, (ROWS, RB), dtype=np.uint8)


op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 5), st.booleans(), st.integers(0, 999)),
    st.tuples(st.just("patch"), st.integers(0, 5), st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=8),
              st.integers(0, 255)),
    st.tuples(st.just("get"), st.integers(0, 5)),
    st.tuples(st.just("shrink"), st.integers(0, 4 * ROWS * RB)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), budget_chunks=st.sampled_from([1, 2, 4]))
def test_patched_copies_match_a_model(ops, budget_chunks):
    w = WarmTier(budget_chunks * ROWS * RB + 64)
    model: dict[int, np.ndarray] = {}
    for o in ops:
        if o[0] == "put":
            _, c, comp, seed = o
            recs = _records(seed, comp)
            w.put(c, recs.copy())
            model[c] = recs.copy()
        elif o[0] == "patch":
            _, c, rows, val = o
            rows = np.unique(rows)
            vals = np.full((len(rows), RB), val, np.uint8)
            if c in w:
                if w.patch(c, rows, vals):
                    model[c][rows] = vals
                else:  # held only compressed: the caller drops it
                    w.discard(c)
            else:
                assert w.patch(c, rows, vals)  # nothing held: nothing to do
        elif o[0] == "get":
            got = w.get(o[1])
            if got is not None:
                assert np.array_equal(got.reshape(ROWS, RB), model[o[1]])
                assert not got.flags.writeable  # readers never write the tier's copies
        else:
            w.shrink(o[1])
        assert w.nbytes <= max(w.budget, 0) or len(w) == 0
    for c in list(model):
        got = w.get(c)
        if got is not None:
            assert np.array_equal(got.reshape(ROWS, RB), model[c])
