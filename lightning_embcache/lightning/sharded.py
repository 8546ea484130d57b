"""What the Lightning layer calls when torch.distributed runs several processes.

`EmbeddingStoreMixin` calls four functions, each a no-op in a single process:

* :func:`shard_handles` at setup: each handle's path becomes this rank's shard directory
  (``<path>/rank-RRRRR-of-WWWWW``) and its stores are made by a `ShardFactory`, so everything the
  handle does with a path (create or open, the writer lock, ``if_exists``, the checkpoint pins
  registry) applies to this rank's shard, and no two ranks ever touch one directory.
* :func:`gather_shard_refs` when a checkpoint is saved (every rank flushed its shard): one
  ``all_gather_object`` records every shard's version and manifest checksum in the checkpoint.
* :func:`local_ref` when a checkpoint is loaded: this rank's version of that record. When `fit`
  resumes a checkpoint of N ranks on M ranks (both > 1), the ranks first stream the old shards
  each node holds to their new owners (:mod:`lightning_embcache.distributed.stream`); a checkpoint
  of a single process, or one loaded outside `fit`, fails here with the command that reshards.
* :func:`follow_checkpoint_files` at setup of fit: Lightning writes and removes checkpoint files
  only on rank 0, so the other ranks learn which file pins which of their versions from the
  strategy's ``save_checkpoint``/``remove_checkpoint`` calls, which every rank makes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_embcache.distributed.exchange import sharding_active, store_group, world
from lightning_embcache.distributed.sharding import shard_dir
from lightning_embcache.distributed.store import RESHARD_HINT, ShardFactory, _check_layout
from lightning_embcache.distributed.stream import stream_shards
from lightning_embcache.store import InvalidArgumentError
from lightning_embcache.store.pins_registry import CHECKPOINT_KEY

RULE = "id % world_size"


def shard_handles(module: Any, fitting: bool = False) -> None:
    """Point every handle of `module` at this rank's shard (once per world size). In one process,
    refuse a path that holds shards: its rows are spread over several stores.

    A path holding only shards of another world size is refused here, except in `fit`: there the
    refusal waits in ``handle._layout_error`` until the checkpoint is restored, since a checkpoint
    of those shards is streamed to this world size (`local_ref`); the mixin raises it otherwise."""
    if not sharding_active():
        for handle in module._embcache_stores().values():
            if handle.path is not None and not (handle.path / "META").exists():
                _check_layout(handle.path, 1)
        return
    rank, world_size = world()
    pins = module.__dict__.get("_embedding_store_pins", {})
    for handle in module._embcache_stores().values():
        factory = getattr(handle, "_shard_factory", None)
        if factory is not None and factory.world_size == world_size:
            if not fitting and getattr(handle, "_layout_error", None) is not None:
                raise handle._layout_error  # a fit refused these shards: so is a validate after it
            continue
        handle._close()  # a plain store opened before torch.distributed started
        handle._trainable = None
        # The handle's own device tier would hold a whole table: each shard's store gets the budget
        # instead and keeps its hot rows on this rank's GPU (`ShardedStore.trainable_rows`).
        if not hasattr(handle, "_shard_device_bytes"):
            handle._shard_device_bytes = getattr(handle, "device_bytes", None)
        handle.device_bytes = 0
        factory = ShardFactory(handle.num_rows, handle.dim, handle._create_options)
        factory.device_bytes = handle._shard_device_bytes
        table = getattr(handle, "_table_path", None) or handle.path
        handle._layout_error = None
        if table is not None:
            handle._table_path = table
            try:
                handle.path = factory.shard_path(table)
            except InvalidArgumentError as exc:
                if not fitting:
                    raise
                handle.path = shard_dir(Path(table), rank, world_size)
                handle._layout_error = exc
        handle._shard_factory = factory
        if not handle._target_from_checkpoint:
            handle._target_version = handle._target_checksum = None
        pins.pop(handle.name, None)


def table_path(handle: Any) -> Path | None:
    """The path the user gave (the handle's `path` is its rank's shard while sharded)."""
    return getattr(handle, "_table_path", None) or handle.path


def gather_shard_refs(module: Any, refs: dict[str, dict[str, Any]]) -> None:
    """Every shard's version and checksum into each store's checkpoint record (all ranks call it)."""
    if not sharding_active() or not refs:
        return
    rank, world_size = world()
    mine = {name: (ref.get("version"), ref.get("manifest_checksum")) for name, ref in refs.items()}
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine, group=store_group())
    stores = module._embcache_stores()
    for name, ref in refs.items():
        if ref.get("version") is None:
            continue
        handle = stores[name]
        init = handle._create_options.get("init", "zeros")
        ref["path"] = str(table_path(handle))
        ref["shards"] = {
            "world_size": world_size,
            "rule": RULE,
            "num_rows": _table_rows(handle),
            "dim": handle.dim,
            "init": init if isinstance(init, str) else "callable",
            "seed": int(handle._create_options.get("seed", 0)),
            "init_std": float(handle._create_options.get("init_std", 1.0)),
            "dirs": [shard_dir(Path(""), r, world_size).as_posix() for r in range(world_size)],
            "versions": [int(e[name][0]) for e in every],
            "manifest_checksums": [e[name][1] for e in every],
        }


def _table_rows(handle: Any) -> int:
    """The open table's rows (grown since declared: `ShardedStore.grow`)."""
    store = handle._store
    return int(store.num_rows) if store is not None and not store.closed else int(handle.num_rows)


def local_ref(handle: Any, ref: dict[str, Any], checkpoint: str | None = None, fitting: bool = False
              ) -> dict[str, Any]:
    """This rank's `{path, version, manifest_checksum}` of a checkpoint's record of a store.

    In `fit` (``fitting``), shards of another world size are first streamed into this world's
    layout (a collective; `checkpoint` is the file being resumed)."""
    rank, world_size = world()
    shards = ref.get("shards")
    if ref.get("version") is None:
        return ref
    if shards is None and world_size == 1:
        return ref
    saved = 1 if shards is None else int(shards["world_size"])
    factory = getattr(handle, "_shard_factory", None)
    if shards is not None and factory is not None:
        # the table's size when the checkpoint was taken (grown since declared, or before a growth);
        # fewer rows than declared are refused when the shards open
        factory.resize(max(int(shards["num_rows"]), getattr(handle, "_declared_rows", handle.num_rows)))
    if saved != world_size and saved > 1 and world_size > 1 and fitting and handle.path is not None:
        file = os.path.abspath(checkpoint) if checkpoint else None
        table = table_path(handle)
        assert shards is not None and table is not None  # saved > 1; a path
        version, checksum = stream_shards(handle.name, Path(table), shards, handle._shard_factory,
                                          file, store_group())
        handle._layout_error = None
        return {**ref, "path": str(handle.path), "version": version, "manifest_checksum": checksum}
    if saved != world_size:
        raise InvalidArgumentError(
            f"embedding store {handle.name!r}: the checkpoint holds its rows in {saved} shard(s) "
            f"({'one process' if saved == 1 else f'{saved} processes'}), and {world_size} process(es) run now. "
            f"Resume with {saved} process(es), or reshard the checkpoint first: {RESHARD_HINT}"
        )
    assert shards is not None  # one process on both sides returned above
    return {**ref, "path": str(handle.path), "version": int(shards["versions"][rank]),
            "manifest_checksum": shards["manifest_checksums"][rank]}


def follow_checkpoint_files(module: Any, trainer: Any) -> None:
    """On ranks other than 0, learn checkpoint files from the strategy (Lightning's CheckpointIO
    runs on rank 0 only), so each rank releases its pinned versions when their files go."""
    strategy = trainer.strategy
    if not sharding_active() or strategy.is_global_zero or getattr(strategy, "_embcache_follows", False):
        return
    save, remove = strategy.save_checkpoint, strategy.remove_checkpoint

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, *args: Any, **kwargs: Any) -> None:
        save(checkpoint, filepath, *args, **kwargs)
        _attach(module, checkpoint, os.path.abspath(os.fspath(filepath)))

    def remove_checkpoint(filepath: Any) -> None:
        remove(filepath)
        _detach(module, os.path.abspath(os.fspath(filepath)))

    strategy.save_checkpoint, strategy.remove_checkpoint = save_checkpoint, remove_checkpoint
    strategy._embcache_follows = True


def _attach(module: Any, checkpoint: dict[str, Any], file: str) -> None:
    rank, _ = world()
    for name, ref in (checkpoint.get(CHECKPOINT_KEY) or {}).items():
        handle = module._embcache_stores().get(name)
        if handle is None or "shards" not in ref:
            continue
        pins = module._embcache_pins(handle)
        pins.attach(int(ref["shards"]["versions"][rank]), file)
        _release_unreferenced(pins, handle)


def _detach(module: Any, file: str) -> None:
    for handle in module._embcache_stores().values():
        if handle.path is None:
            continue
        pins = module._embcache_pins(handle)
        pins.detach(file)
        _release_unreferenced(pins, handle)


def _release_unreferenced(pins: Any, handle: Any) -> None:
    # The file may live on rank 0's disk only, so a version is released when its last file was
    # removed through the strategy, never because the file is absent here.
    for version, files in list(pins.versions.items()):
        if files or version in pins._fresh:
            continue
        try:
            handle.store.unpin(version)
        except Exception:  # already reclaimed
            pass
        del pins.versions[version]
    pins.save()
