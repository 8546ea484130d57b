"""Every embcache command works on a healthy row-sharded table created with init="normal": each
shard's META records how its never-written rows are made (global id = local * world + rank), so the
commands rebuild them from the shard folder alone."""

from __future__ import annotations

import json

import numpy as np
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.cli import main as embcache
from lightning_embcache.distributed.sharding import GlobalNormalInit, RowSharding, shard_dir
from lightning_embcache.store.initrows import normal_rows

N, DIM, WORLD, SEED, STD = 1000, 4, 2, 7, 0.5


def _sharded_table(root):
    """Two shards as ShardedStore makes them for init="normal", a few rows written in each."""
    sharding = RowSharding(N, WORLD)
    written = {}
    for r in range(WORLD):
        init = GlobalNormalInit(sharding, r, DIM, SEED, STD)
        with EmbeddingStore.create(shard_dir(root, r, WORLD), sharding.shard_rows(r), DIM, chunk_rows=64,
                                   init=init, seed=SEED, init_std=STD) as s:
            local = torch.arange(0, sharding.shard_rows(r), 7)
            vals = torch.full((len(local), DIM), float(r + 1))
            s.update(local, vals)
            s.flush()
            for i, v in zip(sharding.global_ids(r, local).tolist(), vals):
                written[i] = v
    want = torch.from_numpy(normal_rows(np.arange(N), DIM, SEED, STD))
    for i, v in written.items():
        want[i] = v
    return want


def test_inspect_verify_compact_and_export_work_on_a_sharded_normal_table(tmp_path, capsys):
    root = tmp_path / "table"
    want = _sharded_table(root)
    assert embcache(["inspect", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == N
    assert embcache(["verify", str(root)]) == 0, capsys.readouterr().out
    assert embcache(["compact", str(root)]) == 0
    capsys.readouterr()
    out = tmp_path / "rows.npy"
    assert embcache(["export", str(root), str(out)]) == 0
    assert torch.equal(torch.from_numpy(np.load(out)), want)
    # and a shard opened alone, without init=, gives the whole table's rows at its global ids
    sharding = RowSharding(N, WORLD)
    with EmbeddingStore.open(shard_dir(root, 1, WORLD), readonly=True) as s:
        local = torch.arange(sharding.shard_rows(1))
        assert torch.equal(s.get(local), want[sharding.global_ids(1, local)])


def test_a_shard_of_a_users_own_init_still_asks_for_it(tmp_path, capsys):
    root = tmp_path / "table"
    for r in range(WORLD):
        EmbeddingStore.create(shard_dir(root, r, WORLD), 10, DIM, init=lambda ids: ids[:, None].float().expand(-1, DIM)).close()
    assert embcache(["verify", str(root)]) != 0
    cap = capsys.readouterr()
    assert "callable init" in cap.out + cap.err
