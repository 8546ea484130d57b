"""Export a field of every row, in id order, to a ``.npy`` file with bounded memory.

The ``.npy`` header is written first, then the rows block by block (`EXPORT_BLOCK_BYTES` at a
time), so a table larger than RAM exports through a buffer of a few MiB plus the store's own
budgets. The file is written under a temporary name beside ``out`` and renamed into place when
whole: a failed or interrupted export leaves no file and no temporary behind.

bfloat16 rows are written as float32 (numpy has no bfloat16; every bfloat16 value is exactly a
float32 value). A row-sharded table (``<path>/rank-RRRRR-of-WWWWW/`` folders) is exported in
global id order: id ``i`` is local row ``i // W`` of shard ``i % W``.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError, InvalidTypeError

#: bytes of rows gathered per block written
EXPORT_BLOCK_BYTES = 8 << 20

_SHARD_DIR = re.compile(r"^rank-(\d{5})-of-(\d{5})$")


def check_out(out: Any, overwrite: bool) -> Path:
    """``out`` as a Path, refused (naming the argument) when it exists without ``overwrite=True``
    or its folder does not exist."""
    if not isinstance(out, (str, os.PathLike)):
        raise InvalidTypeError(f"out must be a str or os.PathLike naming a .npy file; got {type(out).__name__}")
    if not isinstance(overwrite, bool):
        raise InvalidTypeError(f"overwrite must be True or False; got {overwrite!r}")
    path = Path(out)
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"out={str(path)!r}: its folder {str(path.parent)!r} does not exist; "
                                   "create it first or give a path in an existing folder")
    if path.is_dir():
        raise InvalidArgumentError(
            f"out={str(path)!r} is a folder; give a file path such as {str(path / 'rows.npy')!r}"
        )
    if path.exists() and not overwrite:
        raise InvalidArgumentError(
            f"out={str(path)!r} already exists; pass overwrite=True to replace it (or choose another path)"
        )
    return path


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a field of `dtype` is exported as (bfloat16 as float32)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return torch.empty(0, dtype=dtype).numpy().dtype


def block_rows(row_bytes: int) -> int:
    return max(1, EXPORT_BLOCK_BYTES // max(row_bytes, 1))


def write_npy(out: Path, shape: tuple[int, int], dtype: np.dtype, blocks: Iterator[np.ndarray]) -> Path:
    """Write the header, then each block (rows in order, C order), to ``out`` atomically."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_2_0(f, header) if shape[0] * shape[
                1
            ] >= 1 << 62 else np.lib.format.write_array_header_1_0(f, header)
            written = 0
            for block in blocks:
                block = np.ascontiguousarray(block, dtype=dtype)
                f.write(block.data.cast("B"))
                written += len(block)
            if written != shape[0]:
                raise RuntimeError(f"export wrote {written} rows of {shape[0]}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def store_blocks(store: Any, field: str) -> Iterator[np.ndarray]:
    """The field of every row of `store`, in id order, a block at a time (through its tiers)."""
    dtype, cols = store.field_spec(field)
    step = block_rows(cols * torch.empty(0, dtype=dtype).element_size())
    for a in range(0, store.num_rows, step):
        ids = torch.arange(a, min(a + step, store.num_rows))
        yield _as_numpy(store.get_fields(ids, (field,))[field])


def shard_folders(path: Path) -> list[Path]:
    """The shard folders of a row-sharded table at `path`, by rank (empty when it is not one)."""
    found: dict[int, dict[int, Path]] = {}
    if path.is_dir():
        for entry in path.iterdir():
            m = _SHARD_DIR.match(entry.name)
            if m and entry.is_dir():
                found.setdefault(int(m.group(2)), {})[int(m.group(1))] = entry
    if not found:
        return []
    if len(found) > 1:
        raise InvalidArgumentError(
            f"path={str(path)!r} holds shards of several process counts "
            f"{sorted(found)}; export the one in use (reshard the checkpoint first)"
        )
    ((world, shards),) = found.items()
    if sorted(shards) != list(range(world)):
        raise InvalidArgumentError(
            f"path={str(path)!r} lacks the shards of ranks {sorted(set(range(world)) - set(shards))} of {world}"
        )
    return [shards[r] for r in range(world)]


def sharded_blocks(shards: list[Any], field: str, num_rows: int) -> Iterator[np.ndarray]:
    """Rows of a cyclically sharded table in global id order, from each shard's own store."""
    world = len(shards)
    dtype, cols = shards[0].field_spec(field)
    step = block_rows(cols * torch.empty(0, dtype=dtype).element_size())
    step = max(world, step - step % world)
    for a in range(0, num_rows, step):
        b = min(a + step, num_rows)
        out = np.empty((b - a, cols), numpy_dtype(dtype))
        for r, shard in enumerate(shards):
            first = a + (r - a) % world  # the first id in [a, b) that rank r owns
            if first >= b:
                continue
            lo, hi = first // world, (b - 1 - r) // world + 1
            out[first - a :: world] = _as_numpy(shard.get_fields(torch.arange(lo, hi), (field,))[field])
        yield out


def export_version(core: Any, version: int, path: Path, field: str, overwrite: bool) -> Path:
    """`EmbeddingStore.export` of retained ``version`` of ``core``'s store (a `StoreCore`), through a
    read-only handle of it; an in-memory store keeps no versions."""
    from .store import EmbeddingStore

    if core.root is None or core.ephemeral:
        raise InvalidArgumentError(
            f"version={version}: an in-memory store keeps no versions; "
            "pass version=None to export its rows as they are"
        )
    with EmbeddingStore.open(core.root, version=version, readonly=True, hot_bytes=EXPORT_BLOCK_BYTES,
                             init=core.init_fn) as old:
        return old.export(path, field, overwrite=overwrite)


def export_path(
    path: Any,
    out: Any,
    field: str = "weight",
    version: int | None = None,
    *,
    overwrite: bool = False,
    init: Callable[[torch.Tensor], torch.Tensor] | str | None = None,
) -> Path:
    """Export a store folder, or a row-sharded table's folder, without opening it for writing.

    ``init``: for a store (or shards) created with a callable init, the same function (given
    global ids for a sharded table), or ``"normal"`` for a sharded table created with
    ``init="normal"`` (its shards record that as a callable). Rows never written need it.
    """
    from .initrows import normal_rows
    from .store import EmbeddingStore

    if not isinstance(path, (str, os.PathLike)):
        raise InvalidTypeError(f"path must be a str or os.PathLike; got {type(path).__name__}")
    root = Path(path)
    out = check_out(out, overwrite)
    shards = shard_folders(root)
    if not shards:
        fn = init if callable(init) else None
        with EmbeddingStore.open(root, version=version, readonly=True, hot_bytes=EXPORT_BLOCK_BYTES, init=fn) as store:
            return store.export(out, field=field, overwrite=overwrite)
    world = len(shards)
    if init is None and _init_kind(shards[0]) == "callable":
        raise InvalidArgumentError(
            f"the shards at {str(root)!r} were created with init='normal' or a callable init (shards record "
            "both as a callable); pass init='normal' (embcache export --init normal) or the same function, "
            "which receives global ids"
        )
    if init is not None and init != "normal" and not callable(init):
        raise InvalidArgumentError(f"init must be None, 'normal' or a callable f(global ids) -> rows; got {init!r}")
    opened: list[Any] = []
    try:
        for r, folder in enumerate(shards):
            fn = None
            if init == "normal" or callable(init):

                def fn(local: torch.Tensor, r: int = r, folder: Path = folder) -> torch.Tensor:
                    ids = local.to(torch.int64) * world + r
                    if callable(init):
                        return init(ids)
                    meta = _read_meta(folder)
                    return torch.from_numpy(normal_rows(ids.numpy(), meta["dim"], meta["seed"], meta["init_std"]))

            opened.append(
                EmbeddingStore.open(
                    folder, version=version, readonly=True, hot_bytes=EXPORT_BLOCK_BYTES // world, init=fn
                )
            )
        s0 = opened[0]
        if field not in s0.field_names:
            raise InvalidArgumentError(f"field={field!r} does not exist; this store has {list(s0.field_names)}")
        num_rows = sum(s.num_rows for s in opened)
        dtype, cols = s0.field_spec(field)
        return write_npy(out, (num_rows, cols), numpy_dtype(dtype), sharded_blocks(opened, field, num_rows))
    finally:
        for s in opened:
            s.close()


def _read_meta(folder: Path) -> dict[str, Any]:
    from .disk import Disk
    from .schema import Schema

    meta = Disk.read_meta(folder)
    return {"dim": Schema.from_json(meta["schema"]).dim, "seed": int(meta["seed"]), "init_std": float(meta["init_std"])}


def _init_kind(folder: Path) -> str:
    """The shard's init kind; "normal" for a shard of init="normal" that records it (`StridedNormal`)."""
    from .disk import Disk
    from .store import strided_normal_spec

    meta = Disk.read_meta(folder)
    return "normal" if strided_normal_spec(meta.get("init_spec")) is not None else str(meta.get("init"))
