"""`embcache bench first-touch` runs every figure at a tiny size and writes paired ratios (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from lightning_embcache.cli import main as embcache


@pytest.mark.slow
def test_first_touch_reports_paired_ratios_for_every_figure(tmp_path):
    out = tmp_path / "r.json"
    assert embcache(["bench", "first-touch", "--rows", "4000", "--dim", "8", "--batch", "64", "--steps", "3",
                     "--small", "1000", "--reps", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for figure, key in (("first_batch", "store_vs_anchor"), ("first_epoch", "first_vs_steady"),
                        ("table_size", "large_vs_small")):
        ratio = doc[figure][key]
        assert ratio["reps"] == 1 and ratio["low"] <= ratio["median"] <= ratio["high"] and ratio["median"] > 0
    assert set(doc["first_batch"]["seconds"]) == {"anchor", "store", "materialized"}
