"""The device tier's rows-ahead pipeline (`Staging`) on the host, with no GPU: announcements
queued by `upcoming` are made by the job after the next lookup (a batch looked up before then
is dropped, never protecting rows), the job's slots for the next lookup are exactly the map's,
and they are refused once a row moved or for another batch. A stand-in tier holds a real
`SlotMap`; only the kernel's queueing (`launch`) needs CUDA and is not called here."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_embcache import device_slots
from lightning_embcache.device_ahead import Staging
from lightning_embcache.device_slots import SlotMap


@pytest.fixture(params=["native", "numpy"])
def backend(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(device_slots, "native_lib", lambda: None)
    return request.param


class _Store:
    def _device_read(self, ids):
        return True


class _Tier:
    """What `Staging` reads of a `DeviceTier`, on the host: the map, dirty flags, a mapped table."""

    def __init__(self, rows: int, capacity: int) -> None:
        self._lock = threading.RLock()
        self._map = SlotMap(rows, capacity)
        self.capacity, self.budget_bytes = capacity, capacity * 100
        self.dirty = np.zeros(capacity, np.bool_)
        self._mapped, self._down, self._swap_check = object(), [], (0, 1, 0)
        self.store = _Store()
        self.staged_ahead_rows = 0
        self.synchronous: list[np.ndarray] = []

    def _timed_store(self, fn, *args):
        return fn(*args)

    def _slots(self, ids, keep, ahead=False):
        self.synchronous.append(ids)


def _run(tier: _Tier, staging: Staging, announced: list[np.ndarray], prefetch: np.ndarray | None = None):
    """A job as the prefetch thread runs it, its planned swap then taken as queued."""
    staging.job(None if prefetch is None else prefetch.copy(), announced, None,
                None if prefetch is None else prefetch)
    staging.pending = None  # (`launch` would queue it on the device and upload the slots:)
    staging._next, staging._ahead = staging._ahead, None


def test_the_jobs_slots_for_the_next_lookup_are_the_maps_until_a_row_moves(backend):
    tier = _Tier(1000, 100)
    staging = Staging(tier)  # type: ignore[arg-type]
    batch = np.array([7, 3, 7, 900, 5], np.int64)
    _run(tier, staging, [], prefetch=batch)
    nxt = staging._next
    assert nxt is not None and (nxt.pos == tier._map.slot_of[batch] - 1).all() and (nxt.pos >= 0).all()
    with tier._lock:
        assert staging.next_positions(batch.copy()) is nxt.pos  # the same ids, another array
    # a row moved in between: the slots are not used
    _run(tier, staging, [], prefetch=batch)
    tier._map.release(np.array([tier._map.slot_of[900] - 1], np.int64))
    with tier._lock:
        assert staging.next_positions(batch) is None
    # another batch: not used either
    _run(tier, staging, [], prefetch=batch)
    with tier._lock:
        assert staging.next_positions(batch[::-1].copy()) is None


def test_announcements_are_made_by_the_job_and_a_batch_looked_up_first_is_dropped(backend):
    tier = _Tier(1000, 100)
    staging = Staging(tier)  # type: ignore[arg-type]
    a, b = np.array([1, 2, 3], np.int64), np.array([4, 5, 4], np.int64)
    staging.upcoming(a)
    staging.upcoming(b)
    assert tier._map.window_rows == 0  # only queued: no sort on the caller's thread
    with tier._lock:
        staging.consume(a.copy())  # looked up before any job announced it
    assert [x.tolist() for x in staging.queued] == [b.tolist()]
    todo, staging.queued = staging.queued, []
    _run(tier, staging, todo)
    assert tier._map.window_rows == 2 and tier._map.want[[1, 2, 3]].sum() == 0
    assert tier._map.want[[4, 5]].tolist() == [1, 1]
    assert staging._next is not None and staging._next.ids is tier._map.oldest_announced()
    with tier._lock:
        staging.consume(b)
    assert tier._map.window_rows == 0 and tier._map.want[[4, 5]].sum() == 0


def test_a_window_past_half_the_tier_is_not_announced_and_warns_once(backend):
    tier = _Tier(1000, 20)
    staging = Staging(tier)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _run(tier, staging, [np.arange(8, dtype=np.int64), np.arange(100, 104, dtype=np.int64),
                             np.arange(200, 210, dtype=np.int64)])
        _run(tier, staging, [np.arange(300, 311, dtype=np.int64)])
    assert tier._map.window_rows == 8  # 8 + 4 would pass 10 rows, half of the 20 slots
    assert len([w for w in seen if "lookahead window holds" in str(w.message)]) == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 199), min_size=1, max_size=12), st.booleans()),
                min_size=1, max_size=30))
def test_slots_given_to_a_lookup_always_hold_its_rows(ops):
    """Any interleaving of prefetches, announced batches, lookups and other calls moving rows:
    whenever `next_positions` gives slots, every one of them holds the looked-up id."""
    tier = _Tier(200, 40)
    staging = Staging(tier)  # type: ignore[arg-type]
    for ids, move in ops:
        batch = np.asarray(ids, np.int64)
        _run(tier, staging, [], prefetch=batch)
        if move:  # a synchronous call takes some slots away meanwhile
            held = np.flatnonzero(tier._map.id_of >= 0)[:3]
            tier._map.release(held)
        with tier._lock:
            pos = staging.next_positions(batch)
        if pos is not None:
            assert (tier._map.id_of[pos] == batch).all()
        elif not move:
            pytest.fail("slots worked out for this very batch, with no row moved, were refused")
