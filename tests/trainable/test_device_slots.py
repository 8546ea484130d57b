"""The device tier's host bookkeeping (`SlotMap`), on any machine: slots and ids stay a
bijection under any sequence of calls, eviction never takes a slot in use or a row an announced
batch reads while another row can go, and rows staged for an announced window are all still there
when their batch comes (against a reference: every access of the trace, counted)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import device_slots, native
from lightning_embcache.device_slots import MAX_WINDOW, SlotMap, TooFewSlots

sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
import fastpaths  # noqa: E402  (tests/store/fastpaths.py: skip here, fail on the reference CI machine)


@pytest.fixture(autouse=True, params=["native", "numpy"])
def backend(request, monkeypatch):
    """Every test runs on the C loops and on the numpy reference; without a C compiler the C
    runs skip, except on the reference CI machine (EMBCACHE_REQUIRE_FAST_PATHS=1), where they fail."""
    if request.param == "numpy":
        monkeypatch.setattr(device_slots, "native_lib", lambda: None)
    elif native.library() is None:
        fastpaths.missing("the C bookkeeping loops (no C compiler built them)")
    return request.param


def _check_bijection(m: SlotMap) -> None:
    held = np.flatnonzero(m.id_of >= 0)
    assert len(held) == m.used
    assert (m.slot_of[m.id_of[held]] == held + 1).all()
    assert np.count_nonzero(m.slot_of) == m.used


def _bring(m: SlotMap, ids: np.ndarray, keep: np.ndarray, replace: bool = False) -> np.ndarray:
    """What the tier does for a batch: find, make room, assign the misses (``replace``: in one
    call, as the tier over a mapped table does)."""
    ids = np.unique(ids)
    s = m.find(ids)
    miss = s < 0
    if miss.any():
        k = int(miss.sum())
        victims = m.victims(k - m.nfree, np.concatenate([s[~miss], keep])) if k > m.nfree else np.empty(0, np.int64)
        if replace:
            planned = m.slots_for(victims, k)
            got = m.replace(victims, ids[miss])
            assert (got == planned).all()
        else:
            m.release(victims)
            got = m.take(k)
            m.assign(got, ids[miss])
        s[miss] = got
    return s


@settings(max_examples=60, deadline=None)
# batches of at most 20 ids: a kept batch and a new one always fit the 40 slots together
@given(st.lists(st.tuples(st.lists(st.integers(0, 199), min_size=1, max_size=20), st.booleans()),
                min_size=1, max_size=40), st.booleans())
def test_any_sequence_keeps_slots_and_ids_a_bijection_and_spares_kept_slots(ops, replace):
    m = SlotMap(200, 40)
    prev = np.empty(0, np.int64)
    for ids, announce in ops:
        ids = np.asarray(ids, np.int64)
        if announce:
            m.announce(ids)
            continue
        before = {int(i): int(m.slot_of[i]) for i in prev}
        s = _bring(m, ids, keep=m.find(prev)[m.find(prev) >= 0] if len(prev) else prev, replace=replace)
        assert (m.id_of[s] == np.unique(ids)).all()
        for i, slot in before.items():  # the previous batch (kept) did not move
            assert m.slot_of[i] == slot
        m.consume(ids)
        prev = np.unique(ids)
        _check_bijection(m)


def test_announced_rows_are_spared_while_others_can_go():
    m = SlotMap(1000, 100)
    _bring(m, np.arange(100), np.empty(0, np.int64))  # full
    m.announce(np.arange(0, 100, 2))  # even rows: a coming batch reads them
    victims = m.victims(50, np.empty(0, np.int64))
    assert (m.id_of[victims] % 2 == 1).all() and len(victims) == 50
    # with no unannounced row left, announced ones go rather than failing the step
    m.release(victims)
    _bring(m, np.arange(500, 550), np.empty(0, np.int64))
    m.announce(np.arange(500, 550))
    assert len(m.victims(10, np.empty(0, np.int64))) == 10


def test_too_few_slots_is_refused_and_changes_no_pick():
    m = SlotMap(100, 10)
    s = _bring(m, np.arange(10), np.empty(0, np.int64))
    with pytest.raises(TooFewSlots):
        m.victims(3, s[:8])
    assert len(m.victims(2, s[:8])) == 2  # the failed call left no slot marked as chosen


def test_a_batch_looked_up_ends_its_protection_and_a_stale_window_is_bounded():
    m = SlotMap(1000, 100)
    m.announce(np.array([5, 3, 3]))
    assert m.want[[3, 5]].tolist() == [1, 1] and m.window_rows == 2
    assert not m.consume(np.array([3]))  # not the oldest announced batch
    assert m.consume(np.array([3, 5, 5]))
    assert m.want[[3, 5]].tolist() == [0, 0] and m.window_rows == 0
    for i in range(MAX_WINDOW + 5):  # batches never looked up
        m.announce(np.array([i]))
    assert m.window_rows == MAX_WINDOW and m.want[:5].sum() == 0


def test_a_batch_is_matched_to_its_announcement_as_given_or_in_any_order():
    m = SlotMap(1000, 100)
    first = m.announce(np.array([9, 2, 9, 4]))
    second = m.announce(np.array([7, 1]))
    assert m.announced(first) and m.announced(second) and not m.announced(np.array([9, 2, 4]))
    assert not m.consume(np.array([7, 1]))  # the newer batch first: not matched
    assert m.consume(np.array([4, 9, 2, 2]))  # the same rows in another order
    assert not m.announced(first) and m.announced(second)
    assert m.consume(np.array([7, 1]))  # as announced
    assert m.window_rows == 0 and m.want[[1, 2, 4, 7, 9]].sum() == 0


def _misses(trace, capacity, k):
    """Misses of a batch trace through a SlotMap, announcing each batch ``k`` batches ahead."""
    m = SlotMap(int(max(b.max() for b in trace)) + 1, capacity)
    misses = 0
    staged_lost = 0
    for i, batch in enumerate(trace):
        if k:
            if i == 0:
                for j in range(min(k, len(trace))):
                    m.announce(trace[j])
                    _bring(m, trace[j], np.empty(0, np.int64))
            elif i + k - 1 < len(trace):
                m.announce(trace[i + k - 1])
                _bring(m, trace[i + k - 1], m.find(np.unique(batch))[m.find(np.unique(batch)) >= 0])
        s = m.find(np.unique(batch))
        if k:
            staged_lost += int((s < 0).sum())
        misses += int((s < 0).sum())
        _bring(m, batch, np.empty(0, np.int64))
        m.consume(batch)
    return misses, staged_lost


def test_rows_staged_for_the_window_are_all_there_when_their_batch_comes():
    rng = np.random.default_rng(0)
    # a hot set reused across batches plus a cold tail: recency alone evicts reused rows
    trace = [np.concatenate([rng.integers(0, 300, 40), rng.integers(300, 20_000, 60)]) for _ in range(300)]
    plain, _ = _misses(trace, 500, 0)
    ahead, lost = _misses(trace, 500, 4)  # the window: ~400 rows of 500 slots
    assert lost == 0  # every row announced and staged was still on the device at its lookup
    assert ahead == 0 and plain > 0


def test_an_id_out_of_range_is_refused_by_the_c_loops_and_changes_nothing(backend):
    if backend == "numpy":
        pytest.skip("numpy raises its own IndexError")
    m = SlotMap(100, 10)
    _bring(m, np.arange(10), np.empty(0, np.int64))
    before = (m.slot_of.copy(), m.id_of.copy(), m.ref.copy())
    for bad in (np.array([3, 100]), np.array([-1])):
        with pytest.raises(IndexError, match="100 rows, 10 slots"):
            m.find(bad)
        with pytest.raises(IndexError):
            m.replace(np.array([0]), bad)
        with pytest.raises(IndexError):
            m.announce(bad)
    assert all(np.array_equal(a, b) for a, b in zip(before, (m.slot_of, m.id_of, m.ref)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["plan", "bring", "victims", "announce", "consume", "dirty"]),
                          st.lists(st.integers(0, 149), min_size=1, max_size=25)), min_size=1, max_size=50))
def test_the_c_loops_choose_exactly_what_the_numpy_reference_chooses(backend, ops):
    """In lockstep, C against numpy: `plan` in one C call against `find`, `victims` and `replace`
    in numpy, and each of those alone: the same results (refusals included), slots, victims,
    reference bits, stamps, hand, window and dirty flags after every call."""
    if backend == "numpy":
        return  # one lockstep run is enough: it builds both maps itself
    c, ref = SlotMap(150, 30, native=True), SlotMap(150, 30, native=False)
    assert c._c is not None and ref._c is None
    dirty = {m: np.zeros(30, np.bool_) for m in (c, ref)}
    prev = np.empty(0, np.int64)
    for op, ids in ops:
        ids = np.asarray(ids, np.int64)
        out = []
        for m in (c, ref):
            kept = m.find(prev)
            kept = kept[kept >= 0]
            try:
                if op == "announce":
                    out.append(m.announce(ids))
                elif op == "consume":
                    out.append(np.array([m.consume(ids)]))
                elif op == "dirty":
                    held = m.find(ids)
                    dirty[m][held[held >= 0]] = True
                    out.append(held)
                elif op == "victims":
                    out.append(m.victims(min(len(ids), m.used), kept))
                elif op == "bring":
                    out.append(_bring(m, ids[:12], kept, replace=True))
                else:
                    p = m.plan(np.unique(ids), kept, dirty[m])
                    out.append(np.concatenate([p.idx, p.victims, p.victim_ids, p.dirty]) if p else np.array([-7]))
            except TooFewSlots as exc:
                out.append(np.array([-1, exc.kept, exc.needed]))
        assert np.array_equal(out[0], out[1]), op
        for name in ("slot_of", "id_of", "_free", "_stamp"):
            assert np.array_equal(getattr(c, name), getattr(ref, name)), name
        assert np.array_equal(c.ref[:-1], ref.ref[:-1])  # the last bit: numpy's spare, set by misses
        assert np.array_equal(dirty[c], dirty[ref])
        assert (c._hand, c.nfree, c.window_rows, c._stamp_id) == (ref._hand, ref.nfree, ref.window_rows, ref._stamp_id)
        if op in ("plan", "bring") and out[0][0] != -1:
            prev = np.unique(ids if op == "plan" else ids[:12])


def test_a_plan_brings_every_miss_in_and_writes_out_only_dirty_victims(backend):
    m = SlotMap(100, 10)
    dirty = np.zeros(10, np.bool_)
    first = m.plan(np.arange(10), None, dirty)
    assert first is not None and len(first.victims) == 0 and (first.idx[10:20] == -1).all()
    dirty[m.find(np.arange(0, 10, 2))] = True  # the even rows changed on the device
    p = m.plan(np.arange(10, 14), m.find(np.arange(2, 4)), dirty)  # 2 and 3 in use: not evicted
    assert p is not None and len(p.victims) == 4 and not set(p.victim_ids) & {2, 3}
    k = 4
    assert (p.idx[2 * k:] == np.arange(10, 14)).all() and (m.find(np.arange(10, 14)) == p.idx[:k]).all()
    assert (p.idx[:k] == p.victims).all()  # no free slot was left: every miss took a victim's
    # each victim's row goes out to the host exactly where it was dirty (an even row)
    assert (p.dirty == (p.victim_ids % 2 == 0)).all()
    assert (p.idx[k:2 * k] == np.where(p.victim_ids % 2 == 0, p.victim_ids, -1)).all()
    assert not dirty[p.victims].any()  # the slots now hold clean rows
    _check_bijection(m)
    assert m.plan(np.arange(10, 14), None, dirty) is None  # all here now
