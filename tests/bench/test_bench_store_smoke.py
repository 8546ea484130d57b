"""Smoke test of `embcache bench store --quick`: it runs end to end and its JSON names every
system, mode and workload. No timing is asserted (the figures live in docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from benchmarks import store as bench_store
from benchmarks.store_systems import ALL_SYSTEMS

PHASES = ("get", "update", "get_update")


@pytest.mark.bench
@pytest.mark.timeout(240)
def test_quick_run_reports_every_system_and_workload(tmp_path):
    out = tmp_path / "store.json"
    assert bench_store.main(["--quick", "--json", str(out), "--workdir", str(tmp_path / "data")]) == 0
    doc = json.loads(out.read_text())

    assert set(doc["systems"]) == set(ALL_SYSTEMS)
    assert set(doc["workloads"]) == {"epoch", "zipf"}
    assert set(doc["modes"]) == {"ram", "disk"}
    for mode in ("ram", "disk"):
        for wl in ("epoch", "zipf"):
            cell = doc["results"][mode][wl]
            assert set(cell) == set(ALL_SYSTEMS), (mode, wl)
            for system in ALL_SYSTEMS:
                entry = cell[system]
                if system == "store" and "error" in entry:
                    # the engine may legitimately fail here; the harness must still say why
                    assert entry["error"]
                    continue
                assert "error" not in entry, (mode, wl, system, entry.get("error"))
                for ph in PHASES:
                    assert entry[ph]["median_ms"] > 0, (mode, wl, system, ph)
                    assert entry[ph]["rows_per_s"] > 0
                assert entry["peak_rss_mib"] > 0
    # the durable systems other than the naive one report a flush; the bare tables do not
    ram_epoch = doc["results"]["ram"]["epoch"]
    assert ram_epoch["memmap"]["flush"]["median_dirty_bytes"] > 0
    assert ram_epoch["torch"]["flush"] is None
    assert "thp" in ram_epoch["torch_thp"]
    assert {t["target"][:12] for t in doc["targets"]} and len(doc["targets"]) == 4
    assert all(t["status"] in {"PASS", "FAIL", "N/A"} for t in doc["targets"])
    assert doc["machine"]["cpus"] >= 1 and "thp_enabled" in doc["machine"]
    assert doc["table_markdown"]


def test_cli_dispatches_to_store_benchmark():
    from lightning_embcache import cli

    assert cli.BENCHMARKS["store"] == "benchmarks.store"
    assert callable(bench_store.main)
