"""CLOCK eviction hands out as many distinct victims as asked whenever enough slots can go.

Reference: the set of slots that may be evicted (occupied, not in flight, not protected). A scan
that had to go round the whole pool (most reference bits set, as after a pass of training) used
to pick the slots of its first lap again on the second: fewer victims than asked, and the store
then wrote a batch around the hot tier instead of installing it.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_embcache.store.hot import HotTier


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(1, 700), need=st.integers(1, 700), seed=st.integers(0, 2**16),
       ref_share=st.sampled_from([0.0, 0.5, 0.95, 1.0]), inflight_share=st.sampled_from([0.0, 0.3]),
       hand=st.integers(0, 699))
def test_victims_are_distinct_and_as_many_as_can_go(cap, need, seed, ref_share, inflight_share, hand):
    rng = np.random.default_rng(seed)
    h = HotTier(10_000, 8, 64, cap)
    slots = h.take_free(cap)
    h.install(rng.choice(10_000, cap, replace=False), slots, np.zeros((cap, 8), np.uint8))
    h.ref[:cap] = rng.random(cap) < ref_share
    h.inflight[:cap] = rng.random(cap) < inflight_share
    h.hand = hand % cap
    protect = rng.choice(cap, min(cap, 5), replace=False)
    can_go = np.setdiff1d(np.flatnonzero(~h.inflight[:cap]), protect)
    got = h.victims(need, protect)
    assert len(np.unique(got)) == len(got)
    assert np.isin(got, can_go).all()
    assert len(got) == min(need, len(can_go))
