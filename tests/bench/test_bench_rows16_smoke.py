"""`embcache bench rows16` runs end to end and reports what docs/benchmarks.md quotes."""

import pytest

from benchmarks.rows16 import main


@pytest.mark.bench
def test_rows16_bench_reports_loss_speed_and_bytes(tmp_path):
    res = main(["--samples", "256", "--steps", "30", "--batch", "32", "--reps", "2", "--out", str(tmp_path / "r.json")])
    s = res["summary"]
    assert set(s) == {"float32", "bf16+SR", "bf16 nearest"}
    assert s["float32"]["loss_vs_float32"] == 0.0 and s["float32"]["speed_vs_float32_median"] == 1.0
    assert s["bf16+SR"]["row_bytes"] < s["float32"]["row_bytes"]
    assert s["bf16+SR"]["weight_bytes_per_row"] * 2 == s["float32"]["weight_bytes_per_row"]
    assert (tmp_path / "r.json").is_file()
