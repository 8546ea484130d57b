"""Rank functions of test_sharded_grow.py (importable by spawned processes): growing a row-sharded
table on real Gloo ranks, against a plain tensor grown by concatenating a fresh table's rows."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import lightning_embcache
from lightning_embcache import EmbeddingStore, InvalidArgumentError, InvalidTypeError, ReadOnlyError, StoreError
from lightning_embcache.distributed import ShardedStore
from lightning_embcache.distributed.exchange import store_group
from lightning_embcache.distributed.sharding import RowSharding, shard_dir
from lightning_embcache.distributed.store import ShardFactory
from lightning_embcache.store.validate import MAX_ROWS

DIM = 4


def sine_init(ids: torch.Tensor) -> torch.Tensor:
    """A callable init of the global ids (top level: spawned ranks import it)."""
    return torch.sin(ids[:, None].to(torch.float32) * 0.3 + torch.arange(DIM))


def _options(init: str) -> dict:
    return {"init": sine_init if init == "callable" else init, "seed": 11, "init_std": 0.5, "chunk_rows": 8}


def _writes(step: int, n: int, world: int, count: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's writes of one step (ids below `n`, duplicates within and across ranks)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(100 * step + r)
        ids = torch.randint(0, n, (count,), generator=g)
        out.append((ids, torch.randn(count, DIM, generator=g)))
    return out


def _apply(store: ShardedStore, ref: torch.Tensor, step: int, n: int, rank: int, world: int) -> None:
    """This rank's writes to the store, every rank's to the reference (in rank order: the highest rank wins)."""
    every = _writes(step, n, world)
    for ids, vals in every:
        ref[ids] = vals
    store.update(*every[rank])


def _fresh_rows(n: int, init: str) -> torch.Tensor:
    """The rows of a row-sharded table created at `n` rows (every rank makes its own, in memory)."""
    fresh = ShardedStore.open_or_create(None, n, DIM, **_options(init))
    try:
        return fresh.get(torch.arange(n))
    finally:
        fresh.close()


def grown_table_equals_one_created_at_the_new_size(rank: int, world: int, root: str, init: str, n0: int,
                                                   n1: int) -> None:
    """Grow a table with flushed and unflushed writes; its rows equal the old rows followed by the
    rows of a table created at the new size, bit for bit; the new ids land on their owners; the
    growth is durable with the next flush and a version from before it reopens the old size."""
    assert Path(lightning_embcache.__file__).parents[1] == Path(__file__).parents[2]  # this checkout
    path = Path(root) / "t"
    store = ShardedStore.open_or_create(path, n0, DIM, hot_bytes=6 * (DIM * 4 + 64), **_options(init))
    ref = _fresh_rows(n0, init)
    assert torch.equal(store.get(torch.arange(n0)), ref)
    _apply(store, ref, 0, n0, rank, world)
    before = store.flush()  # each rank's own version
    store.pin(before)  # kept, as a checkpoint keeps its versions
    at_before = ref.clone()
    _apply(store, ref, 1, n0, rank, world)  # not flushed when the table grows: carried over
    store.grow(n1)
    ref = torch.cat([ref, _fresh_rows(n1, init)[n0:]])
    assert store.num_rows == n1 and store.local.num_rows == max(len(range(rank, n1, world)), 1)
    assert torch.equal(store.get(torch.arange(n1)), ref)
    if init == "normal":  # and the rows a single process makes at that size
        whole = EmbeddingStore.create(None, n1, DIM, **_options(init)).get(torch.arange(n0, n1))
        assert torch.equal(ref[n0:], whole)
    _apply(store, ref, 2, n1, rank, world)  # writes to new and old ids
    assert torch.equal(store.get(torch.arange(n1)), ref)
    mine = RowSharding(n1, world)
    local = torch.arange(mine.shard_rows(rank))
    assert torch.equal(store.local.get(local), ref[mine.global_ids(rank, local)])  # each id at its owner
    store.grow(n1)  # the same size again: nothing happens
    after = store.flush()
    assert after > before
    store.close()
    # reopened with the size declared at first: the shards' manifests say the table grew
    again = ShardedStore.open_or_create(path, n0, DIM, **_options(init))
    assert again.num_rows == n1 and torch.equal(again.get(torch.arange(n1)), ref)
    with pytest.raises(InvalidArgumentError, match=rf"ids must be in \[0, {n1}\)"):
        again.get(torch.tensor([n1]))
    again.close()
    old = ShardedStore.open_or_create(path, n0, DIM, version=before, readonly=True, **_options(init))
    assert old.num_rows == n0 and torch.equal(old.get(torch.arange(n0)), at_before)
    with pytest.raises(InvalidArgumentError, match=rf"ids must be in \[0, {n0}\)"):
        old.get(torch.tensor([n0]))
    old.close()
    # in memory (path=None) the same
    mem = ShardedStore.open_or_create(None, n0, DIM, **_options(init))
    mem.update(torch.arange(n0), at_before)
    mem.grow(n1)
    assert torch.equal(mem.get(torch.arange(n1)), torch.cat([at_before, _fresh_rows(n1, init)[n0:]]))
    mem.close()
    dist.barrier()


def refusals_change_nothing(rank: int, world: int, root: str) -> None:
    """Shrinking, past the id limit, not an int, ranks passing different values, a read-only
    shard: refused by name on every rank (none left waiting), and nothing changed anywhere."""
    n0 = 50
    path = Path(root) / "t"
    store = ShardedStore.open_or_create(path, n0, DIM, **_options("normal"))
    ref = _fresh_rows(n0, "normal")
    _apply(store, ref, 0, n0, rank, world)
    version = store.flush()
    rows = len(range(rank, n0, world))
    cases = [
        (InvalidArgumentError, rf"num_rows must be in \[{n0}, {MAX_ROWS}\]; got {n0 - 1}: .* never shrinks",
         lambda: store.grow(n0 - 1)),
        (InvalidArgumentError, rf"num_rows must be in \[{n0}, {MAX_ROWS}\] \(the id limit\); got {MAX_ROWS + 1}",
         lambda: store.grow(MAX_ROWS + 1)),
        (InvalidTypeError, r"num_rows must be an int; got float 60.0", lambda: store.grow(60.0)),
        (InvalidArgumentError, r"num_rows must be the same on every rank .*got \{0: 60, 1: 70\}",
         lambda: store.grow(60 + 10 * rank)),
        # one rank's bad value: its own error there, the others name it
        (InvalidArgumentError, rf"num_rows must be in \[{n0}, {MAX_ROWS}\]; got 10" if rank == 1 else
         r"grow\(num_rows=60\) was refused by rank\(s\) \[1\] .*nothing changed on any rank",
         lambda: store.grow(10 if rank == 1 else 60)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
        assert store.num_rows == n0 and store.local.num_rows == rows
        assert torch.equal(store.get(torch.arange(n0)), ref)  # every rank still takes part
    # rows on the owners' GPUs (`ShardedDeviceRows`, not made here: no GPU): a refused growth
    # leaves them open; they are released only by a growth that goes ahead (GPU test)
    closed = []
    store.device_rows = SimpleNamespace(close=lambda: closed.append(1), write_down=lambda: None)
    with pytest.raises(InvalidArgumentError, match="num_rows must be in"):
        store.grow(10)
    assert not closed and store.device_rows is not None
    store.device_rows = None
    assert store.num_rows == n0 and store.local.num_rows == rows
    assert store.flush() == version  # nothing to make durable: nothing changed
    # one shard fails to grow (rank 0's grows): every rank raises, the table keeps its size;
    # rank 0's extra rows stay unreachable, and hold their initial rows when a growth reaches them
    if rank == 1:
        def fail(num_rows):
            raise OSError("No space left on device")
        store.local.grow = fail
    with pytest.raises(StoreError, match=r"grow\(num_rows=60\) failed: rank 1: OSError: No space left on device\. "
                                         r"The table keeps its 50 rows on every rank"):
        store.grow(60)
    assert store.num_rows == n0 and torch.equal(store.get(torch.arange(n0)), ref)
    with pytest.raises(InvalidArgumentError, match=r"ids must be in \[0, 50\)"):
        store.get(torch.tensor([n0]))
    if rank == 1:
        del store.local.grow
    store.grow(60)
    assert torch.equal(store.get(torch.arange(60)), torch.cat([ref, _fresh_rows(60, "normal")[n0:]]))
    store.close()
    store = ShardedStore.open_or_create(path, n0, DIM, **_options("normal"))  # unflushed: back to 50 rows
    assert store.num_rows == n0 and torch.equal(store.get(torch.arange(n0)), ref)
    store.close()
    reader = ShardedStore.open_or_create(path, n0, DIM, readonly=True, **_options("normal"))
    with pytest.raises(ReadOnlyError, match=r"grow\(num_rows=60\): rank \d's shard is open read-only"):
        reader.grow(60)
    assert reader.num_rows == n0 and torch.equal(reader.get(torch.arange(n0)), ref)
    reader.close()
    dist.barrier()


def growth_one_shard_did_not_flush(rank: int, world: int, root: str) -> None:
    """A crash between the ranks' flushes after a growth: rank 0's shard flushed it, rank 1's did
    not. Reopened, the ranks see different sizes; the first exchange refuses on every rank, and
    grow() to the larger size completes the growth: rank 1's new ids hold their initial rows,
    rank 0's the rows it flushed."""
    n0, n1 = 40, 61
    path = Path(root) / "t"
    store = ShardedStore.open_or_create(path, n0, DIM, **_options("normal"))
    ref = _fresh_rows(n0, "normal")
    _apply(store, ref, 0, n0, rank, world)
    store.flush()
    store.grow(n1)
    ref = torch.cat([ref, _fresh_rows(n1, "normal")[n0:]])
    written = ref.clone()
    _apply(store, written, 1, n1, rank, world)
    if rank == 0:
        store.flush()
    store.close()  # rank 1 drops its unflushed growth and writes, as a crash would
    owner = RowSharding(n1, world).owner(torch.arange(n1))
    ref = torch.where((owner == 0)[:, None], written, ref)  # what each shard flushed
    again = ShardedStore.open_or_create(path, n0, DIM, **_options("normal"))
    assert again.num_rows == (n1 if rank == 0 else n0)
    with pytest.raises(InvalidArgumentError, match=rf"different sizes \(rows by rank: \{{0: {n1}, 1: {n0}\}}\).*"
                                                   rf"grow\(num_rows={n1}\)"):
        again.get(torch.arange(3))
    again.grow(n1)
    assert again.num_rows == n1 and torch.equal(again.get(torch.arange(n1)), ref)
    again.flush()
    again.close()
    dist.barrier()


def stream_a_grown_checkpoint(rank: int, world: int, root: str, record: dict, declared: int, want: torch.Tensor
                              ) -> None:
    """Shards of a grown 3-rank table stream to this world at the checkpoint's size (the model
    declares fewer rows): every row at its new owner, and the new shards record the size."""
    from lightning_embcache.distributed import stream

    factory = ShardFactory(declared, DIM, _options("normal"))
    factory.resize(max(int(record["num_rows"]), declared))  # what local_ref does with the record
    table = Path(root) / "t"
    version, _ = stream.stream_shards("t", table, record, factory, "/ck/last.ckpt", store_group())
    n = int(record["num_rows"])
    store = ShardedStore.open_or_create(table, declared, DIM, version=version, **_options("normal"))
    assert store.num_rows == n and store.local.num_rows == len(range(rank, n, world))
    assert torch.equal(store.get(torch.arange(n)), want)
    store.close()
    dist.barrier()


def write_grown_shards(root: Path, old_world: int, n0: int, n1: int) -> tuple[dict, torch.Tensor]:
    """A checkpoint's shards of `old_world` ranks (one process writes them): made at `n0` rows,
    written, grown to `n1` and written again (new ids too). Returns its record and every row."""
    from lightning_embcache.distributed.sharding import GlobalNormalInit

    old = RowSharding(n1, old_world)
    want = EmbeddingStore.create(None, n1, DIM, **_options("normal")).get(torch.arange(n1))
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(n1, generator=g)[: n1 // 2]
    want[ids] = torch.randn(len(ids), DIM, generator=g)
    versions, sums = [], []
    for k in range(old_world):
        store = EmbeddingStore.create(shard_dir(root / "t", k, old_world), RowSharding(n0, old_world).shard_rows(k),
                                      DIM, init=GlobalNormalInit(old, k, DIM, 11, 0.5), seed=11, init_std=0.5,
                                      chunk_rows=8)
        store.flush()
        store.grow(old.shard_rows(k))
        store._versions.table_rows = n1
        local = torch.arange(old.shard_rows(k))
        store.update(local, want[old.global_ids(k, local)])
        versions.append(store.flush())
        sums.append(store.manifest_checksum(versions[-1]))
        store.close()
    record = {"world_size": old_world, "rule": "id % world_size", "num_rows": n1, "dim": DIM, "init": "normal",
              "seed": 11, "init_std": 0.5, "versions": versions, "manifest_checksums": sums}
    return record, want


def grow_with_gpu_rows(rank: int, world: int, root: str) -> None:
    """Rows trained on the owners' GPUs (`ShardedDeviceRows`, NCCL): grow writes them down and
    releases the GPU rows; the grown table holds the trained rows and, at the new ids, the rows of
    a table created at the new size; new trainable rows train on, new ids included."""
    from lightning_embcache import make_row_optimizer, trainable_fields

    n, n1 = 300, 400
    opt = make_row_optimizer("adam", lr=0.1)
    store = ShardedStore.open_or_create(Path(root) / "rows", n, DIM, init="normal", seed=1, chunk_rows=16,
                                        fields=trainable_fields(opt, DIM, torch.float32))
    cuda = torch.device("cuda", torch.cuda.current_device())
    rows = store.trainable_rows(opt, device=cuda, device_bytes=1 << 20)
    ids = torch.arange(rank, n, 3)
    rows.lookup(ids).sum().backward()
    rows.collect()
    rows.apply(1)
    trained = store.get(torch.arange(n))
    store.grow(n1)
    assert store.num_rows == n1 and store.device_rows is None
    fresh = EmbeddingStore.create(None, n1, DIM, init="normal", seed=1, chunk_rows=16).get(torch.arange(n1))
    got = store.get(torch.arange(n1))
    assert torch.equal(got[:n], trained) and torch.equal(got[n:], fresh[n:])
    rows = store.trainable_rows(opt, device=cuda, device_bytes=1 << 20)
    new = torch.arange(n + rank, n1, 3)
    rows.lookup(new).sum().backward()
    rows.collect()
    rows.apply(2)
    after = store.get(torch.arange(n1))
    assert not torch.equal(after[n:], fresh[n:])  # the new rows trained on the owners' GPUs
    store.close()


def grow_sequence(rank: int, world: int, root: str, ops: list) -> None:
    """Replay `ops` (updates from every rank, reads, grow, flush, close + reopen) on a disk-mode
    sharded table and on a plain tensor grown by concatenating a larger table's initial rows,
    keeping what was durable (rows and size) at each flush. Ids are drawn modulo the current size."""
    n0, dim = 13, 3
    opts = dict(init="normal", seed=2, chunk_rows=4, hot_bytes=4 * (dim * 4 + 64))
    path = Path(root) / "seq"
    store = ShardedStore.open_or_create(path, n0, dim, **opts)
    whole = EmbeddingStore.create(None, n0 + 40 * len(ops), dim, init="normal", seed=2).get(
        torch.arange(n0 + 40 * len(ops)))
    ref = whole[:n0].clone()
    durable = ref.clone()
    try:
        for op in ops:
            kind, n = op[0], len(ref)
            if kind == "update":
                for r in range(world):  # the owners apply the ranks' rows in rank order: last wins
                    ids, seed = op[1][r]
                    vals = torch.randn(len(ids), dim, generator=torch.Generator().manual_seed(seed))
                    for i, v in zip(ids, vals):
                        ref[i % n] = v
                ids, seed = op[1][rank]
                store.update(torch.tensor(ids, dtype=torch.int64) % n,
                             torch.randn(len(ids), dim, generator=torch.Generator().manual_seed(seed)))
            elif kind == "get":
                ids = torch.tensor(op[1][rank], dtype=torch.int64) % n
                assert torch.equal(store.get(ids), ref[ids]), op
            elif kind == "grow":
                store.grow(n + op[1])
                ref = torch.cat([ref, whole[n:n + op[1]]])
                assert store.num_rows == len(ref)
            elif kind == "flush":
                store.flush()
                durable = ref.clone()
            elif kind == "reopen":  # what was not flushed is dropped, a growth too
                store.close()
                store = ShardedStore.open_or_create(path, n0, dim, **opts)
                ref = durable.clone()
                assert store.num_rows == len(ref)
        assert torch.equal(store.get(torch.arange(len(ref))), ref)
    finally:
        store.close()
