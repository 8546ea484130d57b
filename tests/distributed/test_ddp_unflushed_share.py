"""DeferredSync's disk-use flushes under DDP with 2 real Gloo processes: each rank flushes its own
shard when its rows written since its last flush pass the share, at steps the other rank does not
flush at, and the fit completes with the rows one process fed the same global batches trains."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _launch import launch, max_diff  # noqa: E402

DDP = dict(strategy="ddp", devices=2, accelerator="cpu")
SYNC = dict(hot_bytes=2048, sync_every=None, sync_background=False)  # a ~20-row hot tier


def test_each_rank_flushes_its_shard_on_its_own_share(tmp_path):
    run = launch(tmp_path, "ddp", path=str(tmp_path / "store"), timeout=300, **SYNC, **DDP)
    r0, r1 = run["ranks"]
    # 2 epoch-end flushes (every_n_epochs=1) and the share's, on each rank
    assert r0["deferred_syncs"] > 2 and r1["deferred_syncs"] > 2, (r0["deferred_syncs"], r1["deferred_syncs"])
    print("syncs", r0["deferred_syncs"], r1["deferred_syncs"])
    ref = launch(tmp_path, "ref", path=str(tmp_path / "ref" / "store"), combined_world=2, timeout=300, **SYNC)
    assert max_diff(r0, ref["ranks"][0]) < 1e-5
