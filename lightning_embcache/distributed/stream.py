"""Resuming a checkpoint of N ranks on M ranks: every rank streams the old shards it can see.

`embcache reshard` rewrites a checkpoint from one process that opens every old shard, so every
shard must be on that machine. Under Lightning the ranks do it themselves when `fit(ckpt_path=...)`
names shards of another world size (both > 1), with no shard leaving its node's disk:

1. each rank lists which old shards (``<path>/rank-KKKKK-of-NNNNN/``) its node holds, and one
   ``all_gather_object`` tells every rank what every node holds. An old shard held by no rank
   fails every rank with the missing folders named, before anything is written;
2. every old shard gets one reader among the ranks that see it (the one with the fewest rows
   to read so far), so a node's shards are read on that node, spread over its ranks;
3. the readers read their shards at the checkpoint's version (manifest checksum checked) in
   slices and send each row, with every field (weights, optimizer moments, per-row metadata), to
   its new owner over the stores' Gloo group: one ``all_to_all_single`` of split sizes and one
   of ids and rows per slice. Each rank sends at most ``SLICE // M`` rows per exchange, so no
   rank holds more than ``SLICE`` rows in flight (it receives at most ``SLICE // M`` from each);
   the table is never gathered anywhere;
4. each rank writes what it receives into its new shard ``<path>/rank-RRRRR-of-MMMMM/``, flushes
   and pins it, and records in that shard's checkpoint registry that the checkpoint file pins this
   version (a second resume from the same file on M ranks reopens it instead of streaming again).

Rows are copied, not recomputed: the new shards hold exactly the checkpoint's rows. A failure on
any rank (an old shard's version gone, a checksum that differs) fails every rank, and each rank
removes the new shard it made: nothing is left changed.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_embcache.distributed.exchange import Route
from lightning_embcache.distributed.sharding import GlobalCallableInit, GlobalNormalInit, RowSharding, shard_dir
from lightning_embcache.store import EmbeddingStore, InvalidArgumentError, StoreError, VersionNotFoundError
from lightning_embcache.store.pins_registry import CheckpointPins, registry_path

SLICE = 1 << 16  # rows a rank holds in flight per exchange (sent, and at most as many received)


def stream_shards(name: str, table: Path, record: Mapping[str, Any], factory: Any, checkpoint: str | None,
                  group: Any) -> tuple[int, str | None]:
    """Make this rank's new shard of store `name` from the old shards of a checkpoint's `record`
    (its ``"shards"`` entry); returns the new shard's (version, manifest checksum). A collective:
    every rank of `group` calls it at the same point.

    `table` is the store's path as this node resolves it; `factory` the `ShardFactory` of the
    current world (it makes the new shard with the store's options); `checkpoint` the file being
    resumed, recorded in the new shard's registry.

    Raises (on every rank, leaving no new shard behind):
        VersionNotFoundError: an old shard is on no node (names the folders).
        InvalidArgumentError: the record does not match the store, or a new shard folder exists
            that this checkpoint did not make; or opening, reading or writing a shard failed on
            some rank (a version gone, another manifest checksum, other fields: names rank and shard).
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    old_world = int(record["world_size"])
    old = RowSharding(int(record["num_rows"]), old_world)
    mine = shard_dir(table, rank, world_size)

    # 1. what this node holds, and what every node holds (nothing is written before this agrees)
    seen = [k for k in range(old_world) if (shard_dir(table, k, old_world) / "META").is_file()]
    problem, streamed = _check_here(name, record, factory, mine, checkpoint)
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, (seen, problem, streamed, str(mine)), group=group)
    _refuse(name, table, old_world, every)
    if all(e[2] is not None for e in every):  # streamed before from this very file (a second resume)
        return int(streamed), None  # type: ignore[arg-type]

    # 2. one reader per old shard, among the ranks that see it
    load = [0] * world_size
    reader = {}
    for k in range(old_world):
        who = min((r for r in range(world_size) if k in every[r][0]), key=lambda r: (load[r], r))
        reader[k] = who
        load[who] += old.shard_rows(k)
    per = max(1, SLICE // world_size)
    chunks = {r: [(k, a, min(a + per, old.shard_rows(k))) for k in range(old_world) if reader[k] == r
                  for a in range(0, old.shard_rows(k), per)] for r in range(world_size)}
    rounds = max(len(c) for c in chunks.values())

    # 3. open this rank's old shards (read-only), then make the new shard, then stream
    sources: dict[int, EmbeddingStore] = {}
    target = None
    error: str | None = None
    try:
        try:
            for k in sorted(k for k, r in reader.items() if r == rank):
                sources[k] = _open_old(table, k, record, old, factory)
        except StoreError as exc:
            error = f"rank {rank}: {exc}"
        _agree(group, error, "opening the checkpoint's shards")
        mine.parent.mkdir(parents=True, exist_ok=True)
        target = factory.create(mine, factory.num_rows, factory.dim).local
        names = tuple(target.field_names)
        for k, source in sources.items():
            if error is None and set(source.field_names) != set(names):
                error = (f"rank {rank}: {shard_dir(table, k, old_world)} holds fields {sorted(source.field_names)}, "
                         f"the store is made with {sorted(names)} (another row optimizer?)")
        new = RowSharding(factory.num_rows, world_size)
        for i in range(rounds):
            ids = torch.empty(0, dtype=torch.int64)
            rows: dict[str, torch.Tensor] = {n: torch.empty((0, target.field_spec(n)[1]), dtype=target.field_spec(n)[0])
                                             for n in names}
            if error is None and i < len(chunks[rank]):
                k, a, b = chunks[rank][i]
                try:
                    local = torch.arange(a, b)
                    rows = sources[k].get_fields(local, names)
                    ids = old.global_ids(k, local)  # ascending and unique
                except StoreError as exc:
                    error = f"rank {rank}: reading {shard_dir(table, k, old_world)}: {exc}"
            route = Route(group, new, ids, error, deliver=True, unique=True)
            got = route.push(rows)
            assert route.served is not None
            try:
                if error is None and len(route.served):
                    target.update_fields(route.served, got)
            except StoreError as exc:
                error = f"rank {rank}: writing {mine}: {exc}"
        version = None
        if error is None:
            try:
                version = target.flush()
                target.pin(version)
                checksum = target.manifest_checksum(version)
            except StoreError as exc:
                error = f"rank {rank}: flushing {mine}: {exc}"
        _agree(group, error, "streaming the checkpoint's rows to their new owners")
        pins = CheckpointPins(mine)
        pins.versions[int(version)] = [checkpoint] if checkpoint else []  # type: ignore[arg-type]
        pins.save()
        return int(version), checksum  # type: ignore[arg-type]
    except BaseException:
        if target is not None:
            target.close()
            target = None
            shutil.rmtree(mine, ignore_errors=True)
            registry_path(mine).unlink(missing_ok=True)
        raise
    finally:
        for store in sources.values():
            store.close()
        if target is not None:
            target.close()


def _check_here(name: str, record: Mapping[str, Any], factory: Any, mine: Path,
                checkpoint: str | None) -> tuple[str | None, int | None]:
    """(A problem on this rank, or None; the version of this rank's new shard that an earlier
    stream of `checkpoint` made, or None)."""
    if int(record["num_rows"]) < factory.num_rows or int(record["dim"]) != factory.dim:
        return (f"the checkpoint's store {name!r} has {record['num_rows']} x {record['dim']} rows; "
                f"add_embedding_store asked for num_rows={factory.num_rows}, dim={factory.dim}"), None
    if not (mine.exists() and (not mine.is_dir() or any(mine.iterdir()))):
        return None, None
    if checkpoint is not None:
        try:
            pins = CheckpointPins(mine)
        except StoreError:
            pins = None
        for version, files in (pins.versions.items() if pins else ()):
            if checkpoint in files:
                return None, version
    return f"{mine} already exists", None


def _refuse(name: str, table: Path, old_world: int, every: list[Any]) -> None:
    """Every rank raises the same error when the survey found one anywhere."""
    missing = sorted(set(range(old_world)) - {k for e in every for k in e[0]})
    if missing:
        folders = ", ".join(shard_dir(Path(""), k, old_world).as_posix() for k in missing)
        raise VersionNotFoundError(
            f"embedding store {name!r}: the checkpoint holds its rows in {old_world} shards, and no node has "
            f"{folders} under its path ({table} on this node). Nothing was written. Make those folders "
            f"reachable from a node (each node reads the shards under its own path), or resume with "
            f"{old_world} processes")
    problems = [f"rank {r}: {e[1]}" for r, e in enumerate(every) if e[1] is not None]
    if problems:
        raise InvalidArgumentError(
            f"embedding store {name!r}: cannot stream the checkpoint's {old_world} shards to "
            f"{len(every)} ranks: {'; '.join(problems)}. Nothing was written. A new shard folder that this "
            f"checkpoint did not make holds other rows: remove it, or give add_embedding_store another path")
    made = [e[2] is not None for e in every]
    if any(made) and not all(made):
        raise InvalidArgumentError(
            f"embedding store {name!r}: only ranks {[r for r, m in enumerate(made) if m]} hold the shards an earlier "
            f"resume of this checkpoint made ({', '.join(e[3] for e, m in zip(every, made) if not m)} are missing). "
            f"Nothing was written. Remove the new shard folders of every rank to stream the checkpoint again")


def _open_old(table: Path, k: int, record: Mapping[str, Any], old: RowSharding, factory: Any) -> EmbeddingStore:
    """Old shard `k` at the checkpoint's version, read-only, its manifest checksum checked."""
    init: Any = None
    if record["init"] == "normal":
        init = GlobalNormalInit(old, k, int(record["dim"]), int(record.get("seed", 0)),
                                float(record.get("init_std", 1.0)))
    elif record["init"] == "callable" and isinstance(factory.init, GlobalCallableInit):
        init = GlobalCallableInit(factory.init.fn, old, k)
    where = shard_dir(table, k, old.world_size)
    version = int(record["versions"][k])
    store = EmbeddingStore.open(where, version=version, readonly=True, init=init)
    try:
        found = store.manifest_checksum(version)
        expected = record["manifest_checksums"][k]
        if expected is not None and found != expected:
            raise InvalidArgumentError(
                f"{where}: version {version} has manifest checksum {found}, the checkpoint recorded {expected} "
                "(the shard was recreated or replaced since)")
    except BaseException:
        store.close()
        raise
    return store


def _agree(group: Any, error: str | None, doing: str) -> None:
    """Every rank raises if any rank failed (one small collective)."""
    every: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, error, group=group)
    failed = [e for e in every if e is not None]
    if failed:
        raise InvalidArgumentError(f"{doing} failed, so no rank resumed: {'; '.join(failed)}")
