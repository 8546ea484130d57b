"""Totals.add_steps (the ledger's batched fold) against Totals.add called once per step."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_embcache.profiling.timeline import Totals

_phase = st.floats(0.0, 1.0, allow_nan=False)
_step = st.tuples(st.sampled_from([0, 1]), st.lists(_phase, min_size=7, max_size=7),
                  st.one_of(st.none(), st.lists(_phase, min_size=7, max_size=7)),
                  st.integers(0, 64), st.booleans(), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(_step, max_size=40))
def test_add_steps_equals_one_add_per_step(steps):
    ref, got = Totals(), Totals()
    for s in steps:
        ref.add(*s)
    got.add_steps(steps)
    for k in Totals.__slots__:
        a, b = getattr(ref, k), getattr(got, k)
        if isinstance(a, list):
            assert all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-12) for x, y in zip(a, b)), k
        else:
            assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12), (k, a, b)


def test_the_ledger_sums_pending_steps_however_rarely_it_is_asked():
    from lightning_embcache.profiling.ledger import FOLD_EVERY, EpochLedger

    led = EpochLedger()
    led.open_epoch_at(0)
    host = [0.001] * 6 + [0.0]
    for _ in range(3 * FOLD_EVERY + 5):
        led.add_step(0, 1, host, host, 2, True, True)
        assert len(led._steps) < FOLD_EVERY
    led.fold()
    assert led.open.batches == 3 * FOLD_EVERY + 5 and led.interval.batches == 3 * FOLD_EVERY + 5
    assert math.isclose(led.open.wall_s, (3 * FOLD_EVERY + 5) * 0.006)
