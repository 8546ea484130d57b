"""EmbeddingStore.export / `embcache export`: every row, in id order, into a .npy file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore, InvalidArgumentError, StoreError, VersionNotFoundError
from lightning_embcache.cli import EXIT_USAGE, main
from lightning_embcache.distributed.sharding import GlobalNormalInit, RowSharding, shard_dir
from lightning_embcache.store import export as export_mod
from lightning_embcache.store.export import export_path

N, DIM = 5000, 12


def _filled(path, hot_bytes=None, dtype=torch.float32, **kw):
    store = EmbeddingStore.create(path, N, DIM, dtype=dtype, hot_bytes=hot_bytes, chunk_rows=256, init="normal",
                                  seed=2, fields={"count": (torch.int32, 1)}, **kw)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(N, generator=g)[: N // 3]
    store.update_fields(ids, {"weight": torch.randn(len(ids), DIM, generator=g),
                              "count": torch.arange(len(ids), dtype=torch.int32)[:, None]})
    return store


@pytest.mark.parametrize("hot_bytes", [None, 40_000], ids=["memory", "disk-small-hot"])
def test_export_equals_get_of_all_ids_unflushed_rows_included(tmp_path, hot_bytes, monkeypatch):
    monkeypatch.setattr(export_mod, "EXPORT_BLOCK_BYTES", 7 * DIM * 4 * 11)  # many blocks, a partial last one
    store = _filled(tmp_path / "s", hot_bytes)
    out = store.export(tmp_path / "rows.npy")
    got = np.load(out, mmap_mode="r")
    assert got.shape == (N, DIM) and got.dtype == np.float32
    assert np.array_equal(got, store.get(torch.arange(N)).numpy())
    counts = np.load(store.export(tmp_path / "count.npy", field="count"))
    assert np.array_equal(counts, store.get_fields(torch.arange(N), ("count",))["count"].numpy())
    if hot_bytes:
        assert store.stats().hot_bytes <= hot_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["count.npy", "rows.npy", "s"]  # no temporaries
    store.close()


def test_export_of_a_retained_version_and_through_the_cli(tmp_path):
    store = _filled(tmp_path / "s", 40_000)
    v1 = store.flush()
    store.pin(v1)  # a checkpoint's version: kept after the next flush
    at_v1 = store.get(torch.arange(N)).numpy().copy()
    store.update(torch.arange(10), torch.full((10, DIM), 7.0))
    store.flush()
    assert np.array_equal(np.load(store.export(tmp_path / "v1.npy", version=v1)), at_v1)
    store.close()
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "cli.npy"), "--version", str(v1)]) == 0
    assert np.array_equal(np.load(tmp_path / "cli.npy"), at_v1)
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "latest.npy")]) == 0
    assert (np.load(tmp_path / "latest.npy")[:10] == 7.0).all()


def test_bfloat16_rows_export_as_exact_float32(tmp_path):
    store = _filled(None, None, dtype=torch.bfloat16)
    got = np.load(store.export(tmp_path / "b.npy"))
    assert got.dtype == np.float32 and np.array_equal(got, store.get(torch.arange(N)).float().numpy())
    store.close()


def test_bad_exports_are_refused_and_change_nothing(tmp_path, capsys):
    store = _filled(tmp_path / "s", None)
    (tmp_path / "taken.npy").write_bytes(b"keep me")
    with pytest.raises(InvalidArgumentError, match="overwrite=True"):
        store.export(tmp_path / "taken.npy")
    assert (tmp_path / "taken.npy").read_bytes() == b"keep me"
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        store.export(tmp_path / "no" / "such" / "x.npy")
    with pytest.raises(InvalidArgumentError, match="field"):
        store.export(tmp_path / "x.npy", field="nope")
    with pytest.raises(VersionNotFoundError):
        store.export(tmp_path / "x.npy", version=99)
    with pytest.raises(StoreError, match="version"):
        store.export(tmp_path / "x.npy", version=-1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s", "taken.npy"]
    store.export(tmp_path / "taken.npy", overwrite=True)
    assert np.array_equal(np.load(tmp_path / "taken.npy"), store.get(torch.arange(N)).numpy())
    store.close()
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "taken.npy")]) == EXIT_USAGE
    assert "overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("world", [1, 3])
def test_sharded_table_exports_in_global_id_order(tmp_path, world, monkeypatch):
    monkeypatch.setattr(export_mod, "EXPORT_BLOCK_BYTES", 13 * DIM * 4)
    rows = 1001
    sharding = RowSharding(rows, world)
    for r in range(world):
        shard = EmbeddingStore.create(shard_dir(tmp_path / "t", r, world), sharding.shard_rows(r), DIM,
                                      init=GlobalNormalInit(sharding, r, DIM, 4, 1.0), seed=4, hot_bytes=20_000)  # as ShardFactory
        local = torch.arange(0, sharding.shard_rows(r), 2)
        glob = sharding.global_ids(r, local)
        shard.update(local, glob[:, None].float().expand(-1, DIM))
        shard.flush()
        shard.close()
    ref = EmbeddingStore.create(None, rows, DIM, init="normal", seed=4)
    want = ref.get(torch.arange(rows)).numpy()
    ref.close()
    for r in range(world):
        glob = np.arange(r, rows, world)[::2]
        want[glob] = glob[:, None]
    # the shards record their strided normal init: no init= needed (and "normal" agrees)
    assert np.array_equal(np.load(export_path(tmp_path / "t", tmp_path / "x.npy")), want)
    assert np.array_equal(np.load(export_path(tmp_path / "t", tmp_path / "t.npy", init="normal")), want)
    assert main(["export", str(tmp_path / "t"), str(tmp_path / "c.npy"), "--init", "normal"]) == 0
    assert np.array_equal(np.load(tmp_path / "c.npy"), want)


_EXPORT_RSS = r"""
import sys, torch, numpy as np
from lightning_embcache import EmbeddingStore

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

path, out = sys.argv[1], sys.argv[2]
store = EmbeddingStore.open(path, hot_bytes=8 << 20, readonly=True)
before = hwm()
store.export(out)
print(hwm() - before)
"""


@pytest.mark.slow
def test_export_of_a_table_larger_than_its_budget_stays_in_bounded_memory(tmp_path):
    import subprocess
    import sys

    rows, dim = 600_000, 64          # 147 MiB of rows, exported through an 8 MiB hot tier
    store = EmbeddingStore.create(tmp_path / "s", rows, dim, hot_bytes=8 << 20, chunk_rows=4096)
    for a in range(0, rows, 65536):
        ids = torch.arange(a, min(a + 65536, rows))
        store.update(ids, ids[:, None].float().expand(-1, dim))
    store.flush()
    store.close()
    script = tmp_path / "probe.py"
    script.write_text(_EXPORT_RSS)
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "s"), str(tmp_path / "all.npy")],
                         capture_output=True, text=True, check=True)
    grew = int(res.stdout.split()[-1])
    assert grew < (8 << 20) + (64 << 20), grew
    got = np.load(tmp_path / "all.npy", mmap_mode="r")
    assert got.shape == (rows, dim)
    assert np.array_equal(got[::9973, 0], np.arange(0, rows, 9973, dtype=np.float32))
    assert (got[-1] == rows - 1).all()
