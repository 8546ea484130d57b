"""How the device tier's background threads split a row set into store calls (CPU only)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lightning_embcache.device_tier import STORE_CALL_ROWS, store_spans
from lightning_embcache.store import rowcopy


def test_a_store_call_stays_on_the_calling_thread():
    # above the threshold the store splits a copy over its copy threads, whose hand-offs wait for
    # the GIL the training thread keeps busy
    assert STORE_CALL_ROWS < rowcopy.PARALLEL_MIN_ROWS


@given(st.integers(0, 50_000))
def test_store_spans_cover_every_row_once_in_the_fewest_calls(n):
    spans = store_spans(n)
    assert [a for a, _ in spans] == ([0] + [b for _, b in spans[:-1]] if spans else [])  # no gap, no overlap
    assert sum(b - a for a, b in spans) == n
    assert all(0 < b - a <= STORE_CALL_ROWS for a, b in spans)
    assert len(spans) == -(-n // STORE_CALL_ROWS)
    if spans:  # about equal parts: no call of a few rows left over
        sizes = [b - a for a, b in spans]
        assert max(sizes) - min(sizes) <= len(spans)
