"""examples/disk_mode_lookahead.py runs at a small size and does what it says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "disk_mode_lookahead.py"


def _load():
    spec = importlib.util.spec_from_file_location("example_disk_mode_lookahead", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("chunk_order", [False, True])
def test_the_example_trains_with_rows_arriving_ahead(tmp_path, capsys, chunk_order):
    argv = ["--rows", "8000", "--dim", "64", "--batch", "200", "--epochs", "2", "--workers", "0",
            "--root", str(tmp_path)] + (["--chunk-order"] if chunk_order else [])
    report = _load().main(argv)
    out = capsys.readouterr().out
    assert "epoch 1: loss" in out and "announced rows already in memory" in out
    assert report["loss"] < 0.6, report  # the rows moved towards their targets (~1.0 at the start)
    assert report["prefetch_hit_rate"] > 0.5, report
    # flushed 8 times an epoch (the default), the rows evicted between flushes stay few: the
    # documented bound is ~1.4x the table plus the rows written since the last flush (an eighth),
    # +0.05 for segment headers and chunk granularity at this small size (1.52-1.54 measured; at
    # 8,000 x 64 the 256 KiB of segments below which no flush waits for compaction is an eighth
    # of the table); one flush an epoch peaks at 2.0-2.2x here
    assert report["peak_disk_use_ratio"] <= 1.4 + 1 / 8 + 0.05, report
