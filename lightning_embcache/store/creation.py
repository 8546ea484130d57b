"""Making a new store's META and folder (`EmbeddingStore.create`), and the init a shard records.

Every check runs before anything is made: a refused create leaves no trace, and a create that
fails later removes what it made (`remove_failed`).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import fileio
from .errors import InvalidArgumentError, InvalidTypeError, StoreError
from .initrows import normal_rows
from .schema import Schema


def strided_normal_spec(spec: Any) -> dict | None:
    """``spec`` if it describes a strided normal init (see `StridedNormal`), else None."""
    if not isinstance(spec, dict) or spec.get("kind") != "strided_normal":
        return None
    stride, offset = spec.get("stride"), spec.get("offset")
    if type(stride) is not int or type(offset) is not int or not 0 <= offset < stride:
        return None
    return {"kind": "strided_normal", "stride": stride, "offset": offset}


class StridedNormal:
    """``init="normal"`` of a whole table evaluated at rows ``local * stride + offset``: the rows a
    row-sharded table's shard holds (its META records it, so tools reopen the shard alone)."""

    def __init__(self, stride: int, offset: int, dim: int, seed: int, std: float) -> None:
        self.stride, self.offset, self.dim, self.seed, self.std = stride, offset, dim, seed, std

    @property
    def init_spec(self) -> dict:
        return {"kind": "strided_normal", "stride": self.stride, "offset": self.offset}

    def __call__(self, local_ids: torch.Tensor) -> torch.Tensor:
        ids = local_ids.to(torch.int64).numpy() * self.stride + self.offset
        return torch.from_numpy(normal_rows(ids, self.dim, self.seed, self.std))


def new_meta(num_rows: int, dim: int, dtype: Any, chunk_rows: int, compression: Any, init: Any, seed: int,
             init_std: float, fields: Any) -> dict:
    """The META of a new store from `create`'s checked sizes; checks the rest of its arguments."""
    if not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(f"dtype must be a torch.dtype; got {dtype!r}")
    if fields is not None and not isinstance(fields, Mapping):
        raise InvalidTypeError(
            f"fields must be a mapping name -> (dtype, cols[, fill]); got {type(fields).__name__}")
    try:
        schema = Schema(dim, dtype, dict(fields or {}))
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, StoreError):
            raise
        raise InvalidArgumentError(f"fields={fields!r} is not name -> (dtype, cols[, fill]): {exc}") from None
    if compression not in (None, "lz4"):
        raise InvalidArgumentError(f"compression must be None or 'lz4'; got {compression!r}")
    if isinstance(init, str):
        if init not in ("zeros", "normal"):
            raise InvalidArgumentError(f"init must be 'zeros', 'normal' or a callable f(ids) -> rows; got {init!r}")
    elif not callable(init):
        raise InvalidTypeError(f"init must be 'zeros', 'normal' or a callable; got {type(init).__name__}")
    meta = {
        "format": "lightning_embcache",
        "uuid": uuid.uuid4().hex,
        "num_rows": num_rows,
        "chunk_rows": chunk_rows,
        "schema": schema.to_json(),
        "compression": compression,
        "init": init if isinstance(init, str) else "callable",
        "seed": int(seed),
        "init_std": float(init_std),
        "init_version": 2,  # init="normal" per row from (seed, id); absent = per chunk (older stores)
        "names_bound": True,  # every file is bound to its name (format 3); absent: files of 0.1 may be read
    }
    spec = strided_normal_spec(getattr(init, "init_spec", None)) if callable(init) else None
    if spec is not None:  # a callable the store can rebuild itself (a shard of init="normal")
        meta["init_spec"] = spec
    return meta


def new_folder(path: Any, hot_bytes: int | None) -> tuple[Path | None, bool]:
    """The folder of a new store and whether this made it: ``path`` (new, or empty), or a
    temporary one for an ephemeral store in disk mode; None for an ephemeral memory-mode store."""
    if path is None and hot_bytes is None:
        return None, False
    root = Path(tempfile.mkdtemp(prefix="embcache-")) if path is None else Path(path)
    if root.exists() and not root.is_dir():
        raise InvalidArgumentError(f"path={str(root)!r} is a file; give a new or empty folder for the store")
    if root.exists() and any(root.iterdir()):
        if (root / "META").exists():
            raise InvalidArgumentError(f"path={str(root)!r} already holds a store; use EmbeddingStore.open()")
        raise InvalidArgumentError(f"path={str(root)!r} exists and is not empty; give a new or empty folder")
    made = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise fileio.io_error(exc, "creating", root) from exc
    return root, made


def remove_failed(root: Path | None, made: bool, ephemeral: bool) -> None:
    """A failed create leaves nothing behind: the folder it made, or what it put in the caller's."""
    if root is None:
        return
    if ephemeral or made:
        shutil.rmtree(root, ignore_errors=True)
    else:  # the folder was the caller's (empty): remove only what we put in it
        for p in list(root.iterdir()):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
