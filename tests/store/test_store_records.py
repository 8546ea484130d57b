"""read_records/write_records: whole records (weight + fields) against get_fields/update_fields."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore, InvalidArgumentError
from lightning_embcache.store import rowcopy

FIELDS = {"m": (torch.float32, 4), "n": (torch.int32, 1)}


@pytest.mark.parametrize("hot_bytes", [None, 2048], ids=["memory", "disk"])
def test_records_round_trip_against_fields(tmp_path, hot_bytes):
    s = EmbeddingStore.create(tmp_path / "s", 500, 8, chunk_rows=32, hot_bytes=hot_bytes, init="normal", fields=FIELDS)
    s.get(torch.arange(500))
    ids = torch.tensor([5, 499, 0, 77, 300])
    rec = s.read_records(ids)
    ref = s.get_fields(ids, ("weight", "m", "n"))
    for name in ("weight", "m", "n"):
        torch.testing.assert_close(s.record_view(rec, name), ref[name])
    s.record_view(rec, "weight").add_(1.0)
    s.record_view(rec, "m").fill_(2.5)
    s.record_view(rec, "n").fill_(7)
    s.write_records(ids, rec)
    got = s.get_fields(ids, ("weight", "m", "n"))
    torch.testing.assert_close(got["weight"], ref["weight"] + 1.0)
    assert (got["m"] == 2.5).all() and (got["n"] == 7).all()
    out = torch.empty((len(ids), s.row_bytes), dtype=torch.uint8)
    assert s.read_records(ids, out=out) is out
    torch.testing.assert_close(out, s.read_records(ids))
    s.close()


def test_bad_records_are_rejected_and_change_nothing(tmp_path):
    s = EmbeddingStore.create(None, 100, 8, fields=FIELDS)
    ids = torch.tensor([1, 2])
    before = s.read_records(torch.arange(100)).clone()
    with pytest.raises(InvalidArgumentError, match="records must be"):
        s.write_records(ids, torch.zeros(2, 3, dtype=torch.uint8))
    rec = s.read_records(ids)
    s.record_view(rec, "weight")[0, 0] = float("nan")
    with pytest.raises(InvalidArgumentError, match="finite"):
        s.write_records(ids, rec)
    with pytest.raises(InvalidArgumentError, match="out must be"):
        s.read_records(ids, out=torch.empty(3, s.row_bytes, dtype=torch.uint8))
    torch.testing.assert_close(s.read_records(torch.arange(100)), before)
    s.close()


def test_threaded_row_copies_match_numpy(monkeypatch):
    monkeypatch.setattr(rowcopy, "PARALLEL_MIN_ROWS", 8)
    table = np.random.default_rng(0).integers(0, 255, (10_000, 40), dtype=np.uint8)
    idx = np.random.default_rng(1).permutation(10_000)[:3001]
    np.testing.assert_array_equal(rowcopy.gather(table, idx), table[idx])
    rows = np.random.default_rng(2).integers(0, 255, (3001, 40), dtype=np.uint8)
    expect = table.copy()
    expect[idx] = rows
    rowcopy.scatter(table, idx, rows)
    np.testing.assert_array_equal(table, expect)
