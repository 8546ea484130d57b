"""Rank functions of test_stream.py (importable by spawned processes): stream a checkpoint's old
shards to a new world size, each rank seeing only its own node's folder."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import lightning_embcache
from lightning_embcache.distributed import stream
from lightning_embcache.distributed.exchange import store_group
from lightning_embcache.distributed.sharding import GlobalNormalInit, RowSharding, shard_dir
from lightning_embcache.distributed.store import ShardFactory
from lightning_embcache.store import EmbeddingStore, StoreError

N, DIM = 103, 4
FIELDS = {"m": (torch.float32, DIM), "n": (torch.float32, 1)}
SEED = 5


def table(n: int = N) -> dict[str, torch.Tensor]:
    """The whole table's fields as the old run left them (row i of each field from i alone)."""
    ids = torch.arange(n, dtype=torch.float32)[:, None]
    return {"weight": torch.sin(ids + torch.arange(DIM)), "m": torch.cos(ids * 0.1 + torch.arange(DIM)),
            "n": ids * 0.5}


def write_old_shards(root: Path, nodes: list[list[int]], old_world: int, touched: int) -> dict:
    """Old shards of `old_world` ranks, shard k under ``root/node<j>/t`` for k in nodes[j]: ids below
    `touched` written, the rest left at their initial rows. Returns the checkpoint's shard record."""
    old = RowSharding(N, old_world)
    whole = table()
    versions, sums = [], []
    for k in range(old_world):
        node = next(j for j, ks in enumerate(nodes) if k in ks)
        store = EmbeddingStore.create(shard_dir(root / f"node{node}" / "t", k, old_world), old.shard_rows(k), DIM,
                                      init=GlobalNormalInit(old, k, DIM, SEED, 1.0), seed=SEED, fields=FIELDS,
                                      chunk_rows=8)
        ids = old.global_ids(k, torch.arange(old.shard_rows(k)))
        keep = ids < touched
        store.update_fields(torch.arange(old.shard_rows(k))[keep], {n: v[ids[keep]] for n, v in whole.items()})
        versions.append(store.flush())
        sums.append(store.manifest_checksum(versions[-1]))
        store.close()
    return {"world_size": old_world, "rule": "id % world_size", "num_rows": N, "dim": DIM, "init": "normal",
            "seed": SEED, "init_std": 1.0, "versions": versions, "manifest_checksums": sums}


def expected(touched: int) -> dict[str, torch.Tensor]:
    """Every field of every row after the old run: written rows, else the initial rows (zeros for
    the other fields)."""
    whole = table()
    init = EmbeddingStore.create(None, N, DIM, init="normal", seed=SEED, fields=FIELDS).get_fields(
        torch.arange(N), ("weight", "m", "n"))
    return {n: torch.where((torch.arange(N) < touched)[:, None], whole[n], init[n]) for n in whole}


def stream_to_new_world(rank: int, world_size: int, root: str, record: dict, touched: int, slice_rows: int) -> None:
    assert Path(lightning_embcache.__file__).parents[1] == Path(__file__).parents[2]  # this checkout
    stream.SLICE = slice_rows  # many exchanges, a different number of slices per rank
    mine = Path(root) / f"node{rank}" / "t"  # this rank's node: no rank sees another node's folder
    factory = ShardFactory(N, DIM, {"init": "normal", "seed": SEED, "fields": FIELDS, "chunk_rows": 8})
    sent: list[int] = []
    real = stream.Route.push

    def push(self, rows, wait=True):
        sent.append(sum(self.send_splits))
        return real(self, rows, wait)

    stream.Route.push = push
    try:
        version, checksum = stream.stream_shards("t", mine, record, factory, "/ck/last.ckpt", store_group())
    finally:
        stream.Route.push = real
    assert max(sent) <= max(1, slice_rows // world_size), sent
    new = RowSharding(N, world_size)
    shard = EmbeddingStore.open(shard_dir(mine, rank, world_size), version=version, readonly=True)
    try:
        assert shard.manifest_checksum(version) == checksum and version in shard.pinned()
        got = shard.get_fields(torch.arange(new.shard_rows(rank)), ("weight", "m", "n"))
    finally:
        shard.close()
    want = expected(touched)
    ids = new.global_ids(rank, torch.arange(new.shard_rows(rank)))
    for n in want:
        assert torch.equal(got[n], want[n][ids]), n
    # a second resume from the same checkpoint file finds what the first one made
    again, _ = stream.stream_shards("t", mine, record, factory, "/ck/last.ckpt", store_group())
    assert again == version
    dist.barrier()


def _refusal(mine: Path, record: dict, factory: ShardFactory, streamed: str) -> str:
    """The StoreError a stream that must not go through raises, as "Type: message"."""
    try:
        stream.stream_shards("t", mine, record, factory, "/ck/last.ckpt", store_group())
    except StoreError as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(streamed)


def refuse_missing_shards(rank: int, world_size: int, root: str, record: dict) -> None:
    stream.SLICE = 1 << 16
    mine = Path(root) / f"node{rank}" / "t"
    factory = ShardFactory(N, DIM, {"init": "normal", "seed": SEED, "fields": FIELDS, "chunk_rows": 8})
    text = _refusal(mine, record, factory, "streamed with a shard missing")
    assert "VersionNotFoundError" in text and "rank-00002-of-00003" in text and "rank-00000" not in text, text
    assert not shard_dir(mine, rank, world_size).exists()  # nothing was made
    dist.barrier()


def refuse_and_leave_nothing(rank: int, world_size: int, root: str, record: dict, case: str) -> None:
    """A stream that cannot go through fails on every rank with a StoreError naming the problem,
    and leaves no new shard folder behind (the other rank's included)."""
    stream.SLICE = 1 << 16  # the pool's processes may keep another test's slice
    mine = Path(root) / f"node{rank}" / "t"
    fields = dict(FIELDS)
    if case == "existing" and rank == 1:
        shard_dir(mine, rank, world_size).mkdir(parents=True)
        (shard_dir(mine, rank, world_size) / "notes.txt").write_text("someone else's")
    if case == "checksum":
        record = {**record, "manifest_checksums": [*record["manifest_checksums"][:2], "00000000"]}
    if case == "fields":
        del fields["n"]  # another row optimizer's state than the checkpoint's
    factory = ShardFactory(N, DIM, {"init": "normal", "seed": SEED, "fields": fields, "chunk_rows": 8})
    text = _refusal(mine, record, factory, f"{case}: streamed")
    want = {"existing": ["InvalidArgumentError", "rank 1:", "rank-00001-of-00002 already exists"],
            "checksum": ["InvalidArgumentError", "rank-00002-of-00003", "manifest checksum", "00000000"],
            "fields": ["InvalidArgumentError", "fields", "'n'"]}[case]
    assert all(w in text for w in want), text
    if case != "existing" or rank == 0:
        assert not shard_dir(mine, rank, world_size).exists(), case
    else:
        assert sorted(p.name for p in shard_dir(mine, rank, world_size).iterdir()) == ["notes.txt"]
    dist.barrier()
