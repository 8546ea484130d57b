"""`embcache reshard`: rewrite a checkpoint's embedding stores for another number of processes.

    embcache reshard --checkpoint runs/ckpt/last.ckpt --world-size 4 [--out NEW.ckpt] [--path NAME=DIR]

Reads every shard of each store at the version the checkpoint names, writes the rows (weights,
optimizer moments, per-row metadata) into the layout of ``--world-size`` processes, flushes and
pins the new versions, and writes a copy of the checkpoint naming them (``--out``, by default
``<checkpoint>.world<N>.ckpt``); resume from that file with the new number of processes. The old
shards and the old checkpoint are left as they were.

Shards of N processes go to ``<store path>/rank-RRRRR-of-NNNNN/`` beside the old ones. A
single-process store is one directory, so going to or from one process needs ``--path NAME=DIR``,
a new folder for that store (then pass ``path=DIR`` to ``add_embedding_store``).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_embcache.distributed.sharding import GlobalNormalInit, RowSharding, shard_dir
from lightning_embcache.store import EmbeddingStore, InvalidArgumentError, StoreError

SLICE = 1 << 16  # rows copied per read


def reshard_checkpoint(checkpoint: str | os.PathLike, world_size: int, *, out: str | os.PathLike | None = None,
                       paths: dict[str, str] | None = None) -> Path:
    """Rewrite every store a Lightning checkpoint names for `world_size` processes; returns the new file."""
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"world_size must be an integer >= 1; got {world_size!r}")
    src = Path(checkpoint).absolute()
    dst = Path(out).absolute() if out is not None else src.with_name(f"{src.stem}.world{world_size}{src.suffix}")
    ckpt = load_checkpoint(src)
    refs = ckpt.get("embedding_stores") if isinstance(ckpt, dict) else None
    if not refs:
        raise InvalidArgumentError(f"checkpoint={str(src)!r} names no embedding stores (nothing to reshard)")
    paths = dict(paths or {})
    unknown = set(paths) - set(refs)
    if unknown:
        raise InvalidArgumentError(f"--path names store(s) {sorted(unknown)}; the checkpoint has {sorted(refs)}")
    for name, ref in refs.items():
        if ref.get("version") is None:
            continue
        refs[name] = _reshard_store(name, ref, world_size, paths.get(name), dst)
    torch.save(ckpt, dst)
    return dst


def load_checkpoint(path: Path) -> Any:
    """A Lightning checkpoint's contents, loaded the way Lightning's own resume loads it
    (``weights_only=True``): a pickle that would import or call anything beyond tensors and plain
    containers is refused before it runs, so a crafted checkpoint cannot execute code here."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InvalidArgumentError(f"checkpoint={str(path)!r} does not exist") from None
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise InvalidArgumentError(
            f"checkpoint={str(path)!r} holds objects a weights-only load refuses ({first}); checkpoints are "
            "read with weights_only=True so a crafted file cannot run code. If you trust this file, allow "
            "its classes in Python: `with torch.serialization.safe_globals([TheClass]): "
            "reshard_checkpoint(...)`") from None
    except (RuntimeError, EOFError, ValueError) as exc:  # not a torch checkpoint at all, or truncated
        raise InvalidArgumentError(f"checkpoint={str(path)!r} is not a readable torch checkpoint: {exc}") from None


def _reshard_store(name: str, ref: dict[str, Any], world_size: int, new_path: str | None, dst: Path) -> dict[str, Any]:
    from lightning_embcache.store.pins_registry import CheckpointPins

    shards = ref.get("shards")
    old_world = 1 if shards is None else int(shards["world_size"])
    if old_world == world_size:
        raise InvalidArgumentError(f"store {name!r} is already in {world_size} shard(s); nothing to do")
    table = Path(ref["path"])
    if (old_world == 1 or world_size == 1) and new_path is None:
        raise InvalidArgumentError(
            f"store {name!r}: a single-process store is one folder, so going from {old_world} to {world_size} "
            f"process(es) needs a new folder for it: --path {name}=DIR")
    dest_table = Path(new_path).absolute() if new_path is not None else table
    sources = _open_sources(name, ref, table, old_world)
    try:
        first = sources[0][1]
        meta = first._core.meta
        kind = shards["init"] if shards else meta["init"]
        if kind == "callable":
            raise InvalidArgumentError(
                f"store {name!r} was created with a callable init, which a command cannot rebuild; call "
                "lightning_embcache.distributed.reshard.reshard_checkpoint from Python after the rows are written")
        seed = int((shards or meta).get("seed", 0))
        std = float((shards or meta).get("init_std", 1.0))
        fields = {n: first.field_spec(n) for n in first.field_names if n != "weight"}
        num_rows = int(shards["num_rows"]) if shards else first.num_rows
        new = RowSharding(num_rows, world_size)
        targets = []
        for q in range(world_size):
            where = dest_table if world_size == 1 else shard_dir(dest_table, q, world_size)
            if where.exists() and any(where.iterdir()):
                raise InvalidArgumentError(f"{where} already exists; remove it or give another --path {name}=DIR")
            init: Any = "zeros" if kind == "zeros" else ("normal" if world_size == 1 else
                                                         GlobalNormalInit(new, q, first.dim, seed, std))
            targets.append(EmbeddingStore.create(
                where, max(new.shard_rows(q), 1) if world_size > 1 else num_rows, first.dim, dtype=first.dtype,
                chunk_rows=int(meta["chunk_rows"]), compression=meta.get("compression"), init=init, seed=seed,
                init_std=std, fields=fields or None))
            if world_size > 1:
                targets[-1]._versions.table_rows = num_rows  # its manifests record the table's size (`ShardedStore`)
        names = tuple(first.field_names)
        old = RowSharding(num_rows, old_world)
        for r, store in sources:
            rows = old.shard_rows(r) if old_world > 1 else num_rows
            for a in range(0, rows, SLICE):
                local = torch.arange(a, min(a + SLICE, rows))
                recs = store.get_fields(local, names)
                ids = old.global_ids(r, local) if old_world > 1 else local
                owner = new.owner(ids)
                for q in range(world_size):
                    sel = torch.nonzero(owner == q).flatten()
                    if len(sel):
                        targets[q].update_fields(new.local(ids[sel]), {n: v[sel] for n, v in recs.items()})
        versions, sums = [], []
        for store in targets:
            v = store.flush()
            store.pin(v)
            pins = CheckpointPins(Path(store.path))
            pins.versions[v] = [str(dst)]
            pins.save()
            versions.append(v)
            sums.append(store.manifest_checksum(v))
    finally:
        for _, store in sources:
            store.close()
        for store in locals().get("targets", []):
            store.close()
    new_ref = {k: v for k, v in ref.items() if k != "shards"}
    new_ref.update(path=str(dest_table), version=versions[0], manifest_checksum=sums[0])
    if world_size > 1:
        new_ref["shards"] = {**(shards or {}), "world_size": world_size, "versions": versions,
                             "manifest_checksums": sums, "init": kind, "num_rows": num_rows, "dim": first.dim,
                             "seed": seed, "init_std": std,
                             "dirs": [shard_dir(Path(""), q, world_size).as_posix() for q in range(world_size)]}
    return new_ref


def _open_sources(name: str, ref: dict[str, Any], table: Path, old_world: int) -> list[tuple[int, EmbeddingStore]]:
    """The checkpoint's version of every old shard (or of the single store), read-only."""
    shards = ref.get("shards")
    if shards is None:
        return [(0, EmbeddingStore.open(table, version=int(ref["version"]), readonly=True))]
    missing = [k for k in ("num_rows", "dim", "init") if k not in shards]
    if missing:
        raise InvalidArgumentError(f"store {name!r}: the checkpoint's shard record lacks {missing}")
    old = RowSharding(int(shards["num_rows"]), old_world)
    opened: list[tuple[int, EmbeddingStore]] = []
    try:
        for r in range(old_world):
            init = None
            if shards["init"] == "normal":
                init = GlobalNormalInit(old, r, int(shards["dim"]), int(shards.get("seed", 0)),
                                        float(shards.get("init_std", 1.0)))
            opened.append((r, EmbeddingStore.open(shard_dir(table, r, old_world), version=int(shards["versions"][r]),
                                                  readonly=True, init=init)))
    except BaseException:
        for _, s in opened:
            s.close()
        raise
    return opened


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="embcache reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, metavar="CKPT", help="Lightning checkpoint to reshard")
    parser.add_argument("--world-size", required=True, type=int, metavar="N", help="number of processes to resume with")
    parser.add_argument("--out", default=None, metavar="FILE", help="new checkpoint (default CKPT.world<N>.ckpt)")
    parser.add_argument("--path", action="append", default=[], metavar="NAME=DIR",
                        help="new folder for store NAME (needed to or from one process)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        paths = dict(p.split("=", 1) for p in args.path)
    except ValueError:
        parser.error("--path takes NAME=DIR")
    try:
        out = reshard_checkpoint(args.checkpoint, args.world_size, out=args.out, paths=paths)
    except (StoreError, OSError) as exc:
        print(f"embcache reshard: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"embcache reshard: wrote {out}; resume with {args.world_size} process(es) from it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
