"""Two nodes simulated on one machine: Lightning's launcher run once per node (``NODE_RANK``, a
shared ``MASTER_ADDR``/``MASTER_PORT``), each node in its own working folder, so the relative
store path resolves to node-local shards; checkpoints go to one shared folder. Real Gloo processes,
4 at most (2 nodes x 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _launch import launch, launch_nodes, max_diff  # noqa: E402

# DDP rebuilds its gradient buckets in the order gradients became ready after the first step of
# every fit, so a resumed fit sums its first step's dense gradients in another bucket layout than
# the uninterrupted one: with 4 ranks a ring all-reduce then adds them in another order (1 ulp off;
# with 2 ranks a + b == b + a). find_unused_parameters=True keeps the first layout for good.
EXACT_DDP = "ddp_find_unused_parameters_true"
NODES_2x2 = dict(strategy=EXACT_DDP, devices=2, accelerator="cpu")  # 2 nodes x 2 ranks: world size 4
NODES_2x1 = dict(strategy=EXACT_DDP, devices=1, accelerator="cpu")  # 2 nodes x 1 rank: world size 2
TOL = 1e-5  # the same float sums in another order (as the reshard test of tests/distributed/test_ddp_stores.py)


def _shards_on(root: Path, node: int, store: str) -> list[str]:
    folder = root / f"node{node}" / store
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.exists() else []


def test_two_nodes_of_two_ranks_train_what_one_process_would_with_node_local_shards(tmp_path):
    """The default CI run's two-node check: 2 nodes x 2 Gloo ranks, one epoch. Every rank sees the
    whole table, the rows equal one process fed the same global batches, and each node's folder
    holds its own ranks' shards only."""
    run = launch_nodes(tmp_path, "nodes", path="s", epochs=1, **NODES_2x2)
    assert [r["world"] for r in run["ranks"]] == [4] * 4
    assert [Path(r["paths"]["latents"]).parent for r in run["ranks"]] == [tmp_path / "node0" / "s"] * 2 + [
        tmp_path / "node1" / "s"] * 2
    for r in run["ranks"][1:]:
        for k in r["rows"]:
            assert torch.equal(r["rows"][k], run["ranks"][0]["rows"][k]), k
    for store in ("s", "s_bank"):
        assert _shards_on(tmp_path, 0, store) == ["rank-00000-of-00004", "rank-00001-of-00004"]
        assert _shards_on(tmp_path, 1, store) == ["rank-00002-of-00004", "rank-00003-of-00004"]
    ref = launch(tmp_path, "ref", path=str(tmp_path / "one"), epochs=1, combined_world=4)["ranks"][0]
    assert max_diff(run["ranks"][0], ref) < TOL


@pytest.mark.slow
def test_kill_9_of_one_node_then_resume_equals_an_uninterrupted_run(tmp_path):
    """Node 1's two ranks die together (kill -9 of its process group) in epoch 3, after two
    checkpoints; the whole job resumes from the shared last.ckpt and ends with every row of both
    stores, on every rank, bit for bit equal to an uninterrupted run. Each node's folder holds its
    own ranks' shards and nothing else."""
    ck_full, ck = tmp_path / "ck_full", tmp_path / "ck"
    full = launch_nodes(tmp_path, "full", path="s1", epochs=3, ckpt_dir=str(ck_full), **NODES_2x2)
    assert [r["world"] for r in full["ranks"]] == [4] * 4
    for store in ("s1", "s1_bank"):
        assert _shards_on(tmp_path, 0, store) == ["rank-00000-of-00004", "rank-00001-of-00004"]
        assert _shards_on(tmp_path, 1, store) == ["rank-00002-of-00004", "rank-00003-of-00004"]
    killed = launch_nodes(tmp_path, "killed", path="s2", epochs=3, ckpt_dir=str(ck), kill_node=1, kill_step=10,
                          expect_ok=False, timeout=300, **NODES_2x2)
    assert killed["procs"][1].returncode == -9, killed["log"]
    assert killed["procs"][0].returncode != 0 and not (killed["out"] / "result.json").exists()
    last = ck / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 8  # 4 steps per epoch, killed in the third
    resumed = launch_nodes(tmp_path, "resumed", path="s2", epochs=3, resume=str(last), ckpt_dir=str(ck), **NODES_2x2)
    assert len(resumed["ranks"]) == 4
    for rank in range(4):
        assert max_diff(resumed["ranks"][rank], full["ranks"][rank]) == 0.0, rank
    assert _shards_on(tmp_path, 0, "s2") == ["rank-00000-of-00004", "rank-00001-of-00004"]
    assert _shards_on(tmp_path, 1, "s2") == ["rank-00002-of-00004", "rank-00003-of-00004"]


def _rows_at(folder: Path, version: int, rank: int, world: int, store: str) -> dict[str, torch.Tensor]:
    """Every field of a shard at `version`, read in the test process (which sees both nodes)."""
    from lightning_embcache import EmbeddingStore
    from lightning_embcache.distributed.sharding import GlobalNormalInit, RowSharding

    init = GlobalNormalInit(RowSharding(256, world), rank, 8, 1, 1.0) if store == "latents" else None
    shard = EmbeddingStore.open(folder, version=version, readonly=True, init=init)
    try:
        return shard.get_fields(torch.arange(RowSharding(256, world).shard_rows(rank)), tuple(shard.field_names))
    finally:
        shard.close()


def _assert_streamed_rows_equal_the_checkpoints(tmp_path: Path, ckpt: Path, old_nodes: list[list[int]],
                                                new_nodes: list[list[int]]) -> None:
    """Each new shard's first version (the one its registry pins for `ckpt`) holds, field by field,
    exactly the rows the old shards held at the versions `ckpt` names."""
    import json

    refs = torch.load(ckpt, weights_only=False)["embedding_stores"]
    old_world, new_world = sum(map(len, old_nodes)), sum(map(len, new_nodes))
    for name, folder in (("latents", "s"), ("bank", "s_bank")):
        shards = refs[name]["shards"]
        whole: dict[str, torch.Tensor] = {}
        for node, ranks in enumerate(old_nodes):
            for k in ranks:
                got = _rows_at(tmp_path / f"node{node}" / folder / f"rank-{k:05d}-of-{old_world:05d}",
                               shards["versions"][k], k, old_world, name)
                for f, v in got.items():
                    whole.setdefault(f, torch.empty((256, v.shape[1]), dtype=v.dtype))[k::old_world] = v
        assert name == "bank" or len(whole) > 2, sorted(whole)  # weights and the row optimizer's state
        for node, ranks in enumerate(new_nodes):
            for q in ranks:
                base = tmp_path / f"node{node}" / folder / f"rank-{q:05d}-of-{new_world:05d}"
                registry = json.loads(base.with_name(base.name + ".checkpoints.json").read_text())["versions"]
                version = [int(v) for v, files in registry.items() if str(ckpt) in files]
                assert len(version) == 1, registry
                got = _rows_at(base, version[0], q, new_world, name)
                assert set(got) == set(whole), (set(got), set(whole))
                for f, v in got.items():
                    assert torch.equal(v, whole[f][q::new_world]), (name, q, f)


@pytest.mark.slow
def test_a_checkpoint_of_2x2_ranks_resumes_on_2x1_ranks_by_streaming_each_nodes_shards(tmp_path):
    """4 ranks (2 nodes x 2) checkpoint after epoch 1; 2 ranks (2 nodes x 1) resume it: rank 0 reads
    node 0's old shards, rank 1 node 1's, and the rows reach their new owners through collectives.
    The new shards hold the checkpoint's rows exactly (weights and Adam moments), and with twice the
    per-rank batch (the same global batches) the fit ends as an uninterrupted 2-rank run does."""
    ck = tmp_path / "ck"
    launch_nodes(tmp_path, "first", path="s", epochs=1, ckpt_dir=str(ck), batch=16, **NODES_2x2)
    ckpt = ck / "epoch=0-step=4.ckpt"
    assert torch.load(ckpt, weights_only=False)["embedding_stores"]["latents"]["shards"]["world_size"] == 4
    # without the checkpoint, shards of 4 ranks cannot serve 2: refused naming the reshard command
    fresh = launch_nodes(tmp_path, "fresh", path="s", epochs=1, if_exists="resume", batch=32, expect_ok=False,
                         timeout=300, **NODES_2x1)
    assert all(p.returncode != 0 for p in fresh["procs"])
    assert "world_size=[4]" in fresh["log"] and "embcache reshard" in fresh["log"], fresh["log"]
    # node 1's shards out of reach: refused on every rank, naming them, and nothing is written
    (tmp_path / "node1" / "s").rename(tmp_path / "node1" / "away")
    refused = launch_nodes(tmp_path, "refused", path="s", epochs=3, resume=str(ckpt), ckpt_dir=str(ck), batch=32,
                           expect_ok=False, timeout=300, **NODES_2x1)
    assert all(p.returncode != 0 for p in refused["procs"])
    assert "VersionNotFoundError" in refused["log"] and "rank-00002-of-00004, rank-00003-of-00004" in refused["log"]
    assert _shards_on(tmp_path, 0, "s") == ["rank-00000-of-00004", "rank-00001-of-00004"]
    assert not (tmp_path / "node1" / "s").exists()
    (tmp_path / "node1" / "away").rename(tmp_path / "node1" / "s")

    resumed = launch_nodes(tmp_path, "resumed", path="s", epochs=3, resume=str(ckpt), ckpt_dir=str(ck), batch=32,
                           **NODES_2x1)
    for store in ("s", "s_bank"):
        assert _shards_on(tmp_path, 0, store) == ["rank-00000-of-00002", "rank-00000-of-00004", "rank-00001-of-00004"]
        assert _shards_on(tmp_path, 1, store) == ["rank-00001-of-00002", "rank-00002-of-00004", "rank-00003-of-00004"]
    _assert_streamed_rows_equal_the_checkpoints(tmp_path, ckpt, [[0, 1], [2, 3]], [[0], [1]])
    ref = launch_nodes(tmp_path, "ref", path="r", epochs=3, batch=32, **NODES_2x1)
    for rank in range(2):
        assert max_diff(resumed["ranks"][rank], ref["ranks"][rank]) < TOL


@pytest.mark.slow
def test_a_checkpoint_of_2x1_ranks_resumes_on_2x2_ranks_by_streaming_each_nodes_shard(tmp_path):
    """2 -> 4: node 0's old shard goes to ranks 0 and 1, node 1's to ranks 2 and 3."""
    ck = tmp_path / "ck"
    launch_nodes(tmp_path, "first", path="s", epochs=1, ckpt_dir=str(ck), batch=16, **NODES_2x1)
    ckpt = ck / "epoch=0-step=8.ckpt"
    resumed = launch_nodes(tmp_path, "resumed", path="s", epochs=3, resume=str(ckpt), ckpt_dir=str(ck), batch=8,
                           **NODES_2x2)
    assert _shards_on(tmp_path, 0, "s") == ["rank-00000-of-00002", "rank-00000-of-00004", "rank-00001-of-00004"]
    assert _shards_on(tmp_path, 1, "s") == ["rank-00001-of-00002", "rank-00002-of-00004", "rank-00003-of-00004"]
    _assert_streamed_rows_equal_the_checkpoints(tmp_path, ckpt, [[0], [1]], [[0, 1], [2, 3]])
    ref = launch_nodes(tmp_path, "ref", path="r", epochs=3, batch=8, **NODES_2x2)
    for rank in range(4):
        assert max_diff(resumed["ranks"][rank], ref["ranks"][rank]) < TOL
    # the same file resumed on 4 ranks again (as after a crash before the first new checkpoint):
    # each rank reopens the shard the first resume streamed, and the fit ends as the first did
    again = launch_nodes(tmp_path, "again", path="s", epochs=3, resume=str(ckpt), ckpt_dir=str(tmp_path / "ck2"),
                         batch=8, **NODES_2x2)
    for rank in range(4):
        assert max_diff(again["ranks"][rank], resumed["ranks"][rank]) == 0.0
