"""The scaling benchmark's ``--variants`` on CPU (Gloo, host rows): every variant is timed at every
world size in the same processes, and each ratio is against the same variant at the first size."""

from __future__ import annotations

import json

import pytest

from benchmarks import distributed as bench


@pytest.mark.bench
def test_each_variant_runs_at_each_world_size_and_is_compared_with_itself(tmp_path):
    out = tmp_path / "scaling.json"
    bench.main(["--world-sizes", "1", "2", "--rows", "2000", "--batch", "64", "--steps", "2", "--warmup", "1",
                "--variants", "default", "si=0.001+finite=off", "--repeat", "2", "--out", str(out)])
    res = json.loads(out.read_text())["results"]
    assert [(r["world_size"], r["variant"]) for r in res] == [
        (w, v) for w in (1, 2) for v in ("default", "si=0.001+finite=off") * 2]
    for r in res:
        same = sorted(b["samples_per_s"] for b in res if b["world_size"] == 1 and b["variant"] == r["variant"])
        assert r["speedup_vs_first"] == pytest.approx(r["samples_per_s"] / same[1])
        assert r["samples_per_s"] > 0 and r["ms_per_step"] > 0
    assert all(r["lookups_exchanged_ahead_min_rank"] == 2 for r in res if r["world_size"] == 2)


def test_an_unknown_variant_setting_is_refused_before_any_process_starts():
    with pytest.raises(SystemExit, match="unknown setting 'uploads=thread'"):
        bench.main(["--world-sizes", "1", "--variants", "uploads=thread"])
    assert bench.parse_variant("si=0.0005+uploads=lookup+finite=off") == {"si": 0.0005, "uploads": "lookup",
                                                                           "finite": "off"}
    assert bench.parse_variant("store=checked+prepare=lookup") == {"store": "checked", "prepare": "lookup"}
    with pytest.raises(SystemExit, match="unknown setting 'store=fast'"):
        bench.parse_variant("store=fast")
