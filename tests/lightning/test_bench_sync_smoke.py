"""`embcache bench sync --quick` runs and writes its JSON (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from lightning_embcache.cli import main as embcache


@pytest.mark.slow
def test_bench_sync_quick_writes_every_system(tmp_path, capsys):
    out = tmp_path / "sync.json"
    assert embcache(["bench", "sync", "--quick", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"naive", "no_sync", "deferred_bg", "deferred_fg"}
    assert results["deferred_fg"]["flushes"] >= 20  # one per step
    assert results["deferred_bg"]["flushes"] + results["deferred_bg"]["coalesced"] >= 20
    assert "| deferred_bg |" in capsys.readouterr().out
