"""`embcache bench flush` runs end to end and reports what it measured."""

from __future__ import annotations

import json

import pytest

from benchmarks import flush


@pytest.mark.bench
def test_bench_flush_quick_run_reports_the_flush_against_msync_and_a_sequential_write(tmp_path):
    out = tmp_path / "flush.json"
    assert flush.main(["--rows", "4000", "--dim", "16", "--reps", "2", "--dir", str(tmp_path / "w"),
                       "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["runs"]) == 2
    for r in res["runs"]:
        assert r["bytes"] == 2000 * 16 * 4
        assert r["flush_s"] > 0 and r["sequential_s"] > 0
        assert abs(r["ratio"] - r["sequential_s"] / r["flush_s"]) < 1e-9
        assert r["msync_s"] > 0 and abs(r["vs_msync"] - r["msync_s"] / r["flush_s"]) < 1e-9
        assert r["flush_cpu_s"] >= 0 and r["msync_cpu_s"] >= 0
    assert res["range_vs_msync"][0] <= res["median_vs_msync"] <= res["range_vs_msync"][1]
    assert not (tmp_path / "w" / "sequential").exists()
