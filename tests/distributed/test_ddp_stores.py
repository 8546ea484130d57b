"""Stores under Lightning DDP with 2 real Gloo processes: the three ways they used to break, resume,
world-size changes and kill -9 of one rank. The reference is one process fed the same global batches
(`CombinedBatches`): row sharding must train exactly what a single process would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _launch import launch, max_diff  # noqa: E402

DDP = dict(strategy="ddp", devices=2, accelerator="cpu")
TOL = 1e-5  # the same float sums in another order (gradients averaged across ranks)


def _reference(tmp_path, name="ref", **cfg):
    return launch(tmp_path, name, path=str(tmp_path / name / "store"), combined_world=2, **cfg)["ranks"][0]


def test_ddp_on_a_fresh_path_trains_the_rows_one_process_would(tmp_path):
    """Once: rank 1 hit CorruptStoreError (no META) racing rank 0's creation of the same folder."""
    run = launch(tmp_path, "ddp", path=str(tmp_path / "store"), **DDP)
    r0, r1 = run["ranks"]
    assert r0["world"] == 2 and r0["paths"]["latents"].endswith("store/rank-00000-of-00002")
    assert r1["paths"]["latents"].endswith("store/rank-00001-of-00002")
    for k in r0["rows"]:  # every rank sees the whole table, not only its shard
        assert torch.equal(r0["rows"][k], r1["rows"][k]), k
    assert max_diff(r0, _reference(tmp_path)) < TOL
    # the callbacks acted per rank and logged the job's figures: max fraction, summed bytes and rows
    assert r0["mem_metrics"] == {"embcache/mem_used_fraction": 5 / 8, "embcache/rss_bytes": float(3 << 28),
                                 "embcache/evicted_bytes": 0.0}
    assert r0["deferred_syncs"] >= 5 and r1["deferred_syncs"] >= 5
    assert set(r0["sync_metrics"]) == {"embcache/sync_seconds", "embcache/synced_rows", "embcache/dirty_rows"}
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [
        "rank-00000-of-00002", "rank-00000-of-00002.checkpoints.json",
        "rank-00001-of-00002", "rank-00001-of-00002.checkpoints.json"] or not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_ddp_with_path_none_shards_in_memory_and_never_diverges(tmp_path):
    """Once: each rank trained its own in-memory table (rows trained only on rank 1 missing on rank 0)."""
    run = launch(tmp_path, "ddp", path=None, **DDP)
    r0, r1 = run["ranks"]
    for k in r0["rows"]:
        assert torch.equal(r0["rows"][k], r1["rows"][k]), k
    ref = launch(tmp_path, "ref", path=None, combined_world=2)["ranks"][0]
    assert max_diff(r0, ref) < TOL


@pytest.mark.slow
def test_ddp_on_an_existing_path_resumes_each_shard_without_store_locked_error(tmp_path):
    """Once: rank 1 raised StoreLockedError opening the path rank 0 held."""
    path = str(tmp_path / "store")
    launch(tmp_path, "first", path=path, epochs=1, **DDP)
    again = launch(tmp_path, "again", path=path, epochs=1, if_exists="resume", **DDP)
    ref = _reference(tmp_path, "ref", epochs=1)
    moved = max(float((again["ranks"][0]["rows"]["latents"] - ref["rows"]["latents"]).abs().max()), 0)
    assert moved > 1e-3  # the second fit continued the first one's rows, it did not start over
    refused = launch(tmp_path, "refused", path=path, epochs=1, expect_ok=False, **DDP)
    assert refused["proc"].returncode != 0
    assert "already holds a store" in refused["proc"].stderr + refused["proc"].stdout


@pytest.mark.slow
def test_ddp_resume_from_a_checkpoint_restores_every_shard(tmp_path):
    full = launch(tmp_path, "full", path=str(tmp_path / "s1"), epochs=3, ckpt_dir=str(tmp_path / "ck1"), **DDP)
    first = launch(tmp_path, "first", path=str(tmp_path / "s2"), epochs=1, ckpt_dir=str(tmp_path / "ck2"), **DDP)
    ckpt = tmp_path / "ck2" / "epoch=0-step=8.ckpt"
    refs = torch.load(ckpt, weights_only=False)["embedding_stores"]
    assert refs["latents"]["shards"]["world_size"] == 2 and len(refs["latents"]["shards"]["versions"]) == 2
    resumed = launch(tmp_path, "resumed", path=str(tmp_path / "s2"), epochs=3, resume=str(ckpt),
                     ckpt_dir=str(tmp_path / "ck2"), **DDP)
    assert first["ranks"][0]["world"] == 2
    assert max_diff(resumed["ranks"][0], full["ranks"][0]) == 0.0


@pytest.mark.slow
def test_ddp_checkpoints_before_and_after_a_growth_resume_their_sizes_exactly(tmp_path):
    """Both stores grow from 256 to 293 rows when epoch 1 starts (every rank calls grow). The
    checkpoint of epoch 0 resumes the old table (training on without growing ends where a run
    that never grew ends), that of epoch 1 the grown one (training on ends where the uninterrupted
    run ended)."""
    from lightning_embcache import EmbeddingStore

    n, grown = 256, 293
    ck = tmp_path / "ck"
    full = launch(tmp_path, "full", path=str(tmp_path / "s"), epochs=3, ckpt_dir=str(ck), grow_epoch=1,
                  grow_to=grown, **DDP)
    r0, r1 = full["ranks"]
    for k in r0["rows"]:
        assert r0["rows"][k].shape[0] == grown and torch.equal(r0["rows"][k], r1["rows"][k]), k
    # the new ids (the data never reads them) hold the rows of a table created at that size
    fresh = EmbeddingStore.create(None, grown, 8, init="normal", seed=1, chunk_rows=16).get(torch.arange(n, grown))
    assert torch.equal(r0["rows"]["latents"][n:], fresh) and not r0["rows"]["bank"][n:].any()
    for epoch, size in ((0, n), (1, grown)):
        assert torch.load(ck / f"epoch={epoch}-step={8 * (epoch + 1)}.ckpt",
                          weights_only=False)["embedding_stores"]["latents"]["shards"]["num_rows"] == size
    never_grown = launch(tmp_path, "never_grown", path=str(tmp_path / "s1"), epochs=2, **DDP)
    before = launch(tmp_path, "before", path=str(tmp_path / "s"), epochs=2, resume=str(ck / "epoch=0-step=8.ckpt"),
                    **DDP)
    assert before["ranks"][0]["rows"]["latents"].shape[0] == n
    assert max_diff(before["ranks"][0], never_grown["ranks"][0]) == 0.0
    after = launch(tmp_path, "after", path=str(tmp_path / "s"), epochs=3, resume=str(ck / "epoch=1-step=16.ckpt"),
                   **DDP)
    assert after["ranks"][0]["rows"]["latents"].shape[0] == grown
    assert max_diff(after["ranks"][0], r0) == 0.0


@pytest.mark.slow
def test_a_grown_two_rank_checkpoint_resumes_on_three_ranks_at_its_size(tmp_path):
    """The ranks stream the grown shards to three new ones at the checkpoint's size (the model
    still declares 256 rows): every rank reads the checkpoint's rows, the grown ones too."""
    ck = tmp_path / "ck"
    full = launch(tmp_path, "full", path=str(tmp_path / "s"), epochs=2, ckpt_dir=str(ck), grow_epoch=1, grow_to=293,
                  **DDP)
    three = launch(tmp_path, "three", path=str(tmp_path / "s"), epochs=2, resume=str(ck / "epoch=1-step=16.ckpt"),
                   **{**DDP, "devices": 3})
    assert len(three["ranks"]) == 3
    for r in three["ranks"]:
        assert r["world"] == 3 and r["rows"]["latents"].shape[0] == 293
        assert max_diff(r, full["ranks"][0]) == 0.0


@pytest.mark.slow
def test_resuming_a_two_rank_checkpoint_in_one_process_names_the_reshard_command(tmp_path):
    launch(tmp_path, "first", path=str(tmp_path / "s"), epochs=1, ckpt_dir=str(tmp_path / "ck"), **DDP)
    one = launch(tmp_path, "one", path=str(tmp_path / "s"), epochs=2, resume=str(tmp_path / "ck" / "last.ckpt"),
                 expect_ok=False)
    err = one["proc"].stderr
    assert one["proc"].returncode != 0
    assert "world_size=[2]" in err and "embcache reshard" in err, err[-2000:]


@pytest.mark.slow
def test_kill_9_of_one_rank_then_resume_equals_an_uninterrupted_run(tmp_path):
    full = launch(tmp_path, "full", path=str(tmp_path / "s1"), epochs=3, ckpt_dir=str(tmp_path / "ck1"), **DDP)
    killed = launch(tmp_path, "killed", path=str(tmp_path / "s2"), epochs=3, ckpt_dir=str(tmp_path / "ck2"),
                    kill_rank=1, kill_step=20, expect_ok=False, timeout=300, **DDP)
    assert killed["proc"].returncode != 0 and not (killed["out"] / "result.json").exists()
    last = tmp_path / "ck2" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 16
    resumed = launch(tmp_path, "resumed", path=str(tmp_path / "s2"), epochs=3, resume=str(last),
                     ckpt_dir=str(tmp_path / "ck2"), **DDP)
    assert max_diff(resumed["ranks"][0], full["ranks"][0]) == 0.0
    assert max_diff(resumed["ranks"][1], full["ranks"][1]) == 0.0


@pytest.mark.slow
def test_reshard_a_two_rank_checkpoint_then_resume_in_one_process(tmp_path):
    """`embcache reshard` rewrites every shard for one process; a single process fed the same global
    batches then finishes the run as the two ranks would have."""
    from lightning_embcache.cli import main as cli

    full = launch(tmp_path, "full", path=str(tmp_path / "s1"), epochs=3, **DDP)
    launch(tmp_path, "first", path=str(tmp_path / "s2"), epochs=1, ckpt_dir=str(tmp_path / "ck"), **DDP)
    ckpt = tmp_path / "ck" / "last.ckpt"
    one = tmp_path / "one"
    assert cli(["reshard", "--checkpoint", str(ckpt), "--world-size", "1", "--path", f"latents={one}",
                "--path", f"bank={one}_bank"]) == 0
    new = tmp_path / "ck" / "last.world1.ckpt"
    refs = torch.load(new, weights_only=False)["embedding_stores"]
    assert "shards" not in refs["latents"] and refs["latents"]["path"] == str(one)
    resumed = launch(tmp_path, "resumed", path=str(one), epochs=3, resume=str(new), combined_world=2)
    assert max_diff(resumed["ranks"][0], full["ranks"][0]) < TOL
    # and back to two ranks, beside the old shards
    assert cli(["reshard", "--checkpoint", str(new), "--world-size", "2", "--path", f"latents={tmp_path / 's3'}",
                "--path", f"bank={tmp_path / 's3'}_bank"]) == 0
    again = launch(tmp_path, "again", path=str(tmp_path / "s3"), epochs=3,
                   resume=str(tmp_path / "ck" / "last.world1.world2.ckpt"), **DDP)
    assert max_diff(again["ranks"][0], full["ranks"][0]) < TOL


@pytest.mark.slow
def test_every_rank_releases_the_versions_of_checkpoints_modelcheckpoint_removed(tmp_path):
    """Lightning writes and removes checkpoint files on rank 0 only; rank 1's shard must still
    unpin the versions whose files are gone, and keep those of the files that remain."""
    import json

    from lightning_embcache import EmbeddingStore

    launch(tmp_path, "run", path=str(tmp_path / "s"), epochs=3, ckpt_dir=str(tmp_path / "ck"), save_top_k=1, **DDP)
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == ["epoch=2-step=24.ckpt", "last.ckpt"], files
    refs = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)["embedding_stores"]["latents"]["shards"]
    for rank in range(2):
        registry = json.loads((tmp_path / "s" / f"rank-0000{rank}-of-00002.checkpoints.json").read_text())
        assert registry["versions"] == {str(refs["versions"][rank]): [
            str(tmp_path / "ck" / "epoch=2-step=24.ckpt"), str(tmp_path / "ck" / "last.ckpt")]}, registry
        shard = EmbeddingStore.open(tmp_path / "s" / f"rank-0000{rank}-of-00002", readonly=True,
                                    init=lambda ids: torch.zeros(len(ids), 8))
        try:
            assert shard.pinned() == [refs["versions"][rank]], (rank, shard.pinned())
        finally:
            shard.close()


def test_a_lookahead_sampler_under_ddp_has_every_lookup_exchanged_ahead(tmp_path):
    """Once, under sharding the handle's prefetch only hinted the rows a rank owns: no lookup of a
    Trainer.fit found its exchange done ahead. Both fits see the same batches; rows equal bit for bit."""
    import os
    import subprocess

    script = Path(__file__).with_name("_lookahead_script.py")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOBAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=str(script.parent))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for got in ranks:
        ann, plain = got["announced"], got["plain"]
        assert ann["steps"] == plain["steps"] == 2 * 6  # 96 ids, 2 ranks, batches of 8, 2 epochs
        assert ann["hits"] == ann["steps"] and ann["announced"] == ann["steps"], ann
        assert plain["hits"] == 0
        assert torch.equal(ann["rows"], plain["rows"])
    assert torch.equal(ranks[0]["announced"]["rows"], ranks[1]["announced"]["rows"])
    assert not torch.equal(ranks[0]["plain"]["rows"][:8], torch.zeros(8, 8))
