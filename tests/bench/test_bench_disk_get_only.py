"""`embcache bench disk --get-only`: the read-only phases read rows and write none."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.disk import _rows
from lightning_embcache import cli


@pytest.mark.bench
def test_get_only_phases_leave_the_shared_table_as_set_up(tmp_path):
    """memmap's warm runs use the shared file itself: a run that updated would leave it changed
    (+1 per row read); the get-only run leaves every row as set up, and each system reports."""
    rows, dim = 4096, 8
    out = tmp_path / "r.json"
    assert cli.main(["bench", "disk", "--get-only", "--phases", "warm", "--reps", "1", "--rows", str(rows),
                     "--dim", str(dim), "--batch", "256", "--batches", "8", "--workdir", str(tmp_path / "w"),
                     "--json", str(out)]) == 0
    table = np.load(tmp_path / "w" / "table.npy")
    assert np.array_equal(table, _rows(0, rows, dim))
    runs = json.loads(out.read_text())["runs"]
    assert {r["system"] for r in runs if r["phase"] == "warm"} == {"memmap", "store", "store+lookahead"}
    assert all(r["rows_per_s"] > 0 for r in runs if r["phase"] == "warm")
