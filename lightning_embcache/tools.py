"""Look into, check and tidy a store on disk: what `embcache inspect`, `verify` and `compact` run.

Only the store's public calls and its documented file layout (docs/store-format.md) are used, so
these work on any store the installed version can open. No Lightning imports.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_embcache.store import CorruptStoreError, EmbeddingStore, StoreError
from lightning_embcache.store.disk import sparse_rows_held
from lightning_embcache.store.fileio import held_bytes

Progress = Callable[[str, int, int], None]  # (what, done, total)

#: rows read per call while verifying: bounded memory whatever the table's size
VERIFY_BATCH_ROWS = 1 << 16


def _no_progress(what: str, done: int, total: int) -> None:
    pass


def _dir_bytes(path: Path) -> tuple[int, int]:
    """(bytes, files) of the plain files under `path` (not following links)."""
    total = files = 0
    if not path.is_dir():
        return 0, 0
    for entry in os.scandir(path):
        try:
            if entry.is_file(follow_symlinks=False):
                total += held_bytes(entry.stat(follow_symlinks=False))
                files += 1
        except FileNotFoundError:  # a temp file a writer's background compaction renamed meanwhile
            pass
    return total, files


def _manifests(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("manifest-*") if p.name[len("manifest-"):].isdigit())


def _last_flush(path: Path) -> str | None:
    manifests = _manifests(path)
    if not manifests:
        return None
    stamp = manifests[-1].stat().st_mtime
    return _dt.datetime.fromtimestamp(stamp, _dt.timezone.utc).isoformat(timespec="seconds")


def _row_bytes(store: EmbeddingStore) -> int:
    return int(store.row_bytes) if hasattr(store, "row_bytes") else store.dim * store.dtype.itemsize


def _chunk_raw_bytes(path: Path, store: EmbeddingStore) -> tuple[int, int]:
    """(uncompressed size of the records held by the base chunk files, sparse files among them):
    from their names, a sparse file's from its header (it holds only the rows ever written)."""
    raw = sparse = 0
    for p in (path / "chunks").glob("c*-g*"):
        try:
            chunk = int(p.name[1:].split("-g")[0])
        except ValueError:
            continue
        rows = max(0, min(store.chunk_rows, store.num_rows - chunk * store.chunk_rows))
        held = sparse_rows_held(p)
        raw += (rows if held is None else min(rows, held)) * _row_bytes(store)
        sparse += held is not None
    return raw, sparse


def shard_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """The per-rank shards of a row-sharded store (``rank-RRRRR-of-WWWWW/``), or [] for a plain store."""
    root = Path(path)
    if (root / "META").is_file() or not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and re.fullmatch(r"rank-\d{5}-of-\d{5}", p.name) and (p / "META").is_file())


def inspect_store(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary of the store at `path` (opened read-only at its latest version); a row-sharded
    store is summarised per shard under ``"shards"``, with the totals on disk."""
    shards = shard_dirs(path)
    if shards:
        parts = [inspect_store(p) for p in shards]
        total = sum(p["disk"]["total_bytes"] for p in parts)
        return {"path": str(Path(path).resolve()), "shards": parts, "rows": sum(p["rows"] for p in parts),
                "dim": parts[0]["dim"], "dtype": parts[0]["dtype"], "disk": {"total_bytes": total}}
    root = Path(path)
    with EmbeddingStore.open(root, readonly=True) as store:
        fields = {
            name: {"dtype": str(store.field_spec(name)[0]).replace("torch.", ""), "dim": store.field_spec(name)[1]}
            for name in store.field_names
        }
        summary: dict[str, Any] = {
            "path": str(root.resolve()),
            "rows": store.num_rows,
            "dim": store.dim,
            "dtype": str(store.dtype).replace("torch.", ""),
            "fields": fields,
            "row_bytes": _row_bytes(store),
            "chunk_rows": store.chunk_rows,
            "version": store.version,
            "versions": store.versions(),
            "pinned": store.pinned(),
            "last_flush": _last_flush(root),
        }
        chunk_raw, sparse_files = _chunk_raw_bytes(root, store)
    chunks, chunk_files = _dir_bytes(root / "chunks")
    segments, segment_files = _dir_bytes(root / "segments")
    meta, meta_files = _dir_bytes(root)
    summary["disk"] = {
        "chunks": {"bytes": chunks, "files": chunk_files, "sparse_files": sparse_files},
        "segments": {"bytes": segments, "files": segment_files},
        "metadata": {"bytes": meta, "files": meta_files},  # META, manifests, chunk maps, PINS, LOCK
        "total_bytes": chunks + segments + meta,
    }
    summary["table_bytes"] = summary["rows"] * summary["row_bytes"]
    summary["compression_ratio"] = round(chunk_raw / chunks, 3) if chunks else 1.0
    return summary


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"  # pragma: no cover


def format_inspection(s: dict[str, Any]) -> str:
    if "shards" in s:
        head = (
            f"row-sharded store {s['path']}: {len(s['shards'])} shards, {s['rows']:,} rows x {s['dim']} "
            f"{s['dtype']}, {human_bytes(s['disk']['total_bytes'])} on disk"
        )
        return "\n\n".join([head, *(format_inspection(part) for part in s["shards"])])
    d = s["disk"]
    lines = [
        f"store        {s['path']}",
        f"rows x dim   {s['rows']:,} x {s['dim']} {s['dtype']} ({s['row_bytes']} bytes a record, "
        f"{s['chunk_rows']} rows a chunk; table {human_bytes(s['table_bytes'])})",
        "fields       " + (", ".join(f"{n} {f['dtype']}[{f['dim']}]" for n, f in s["fields"].items()) or "-"),
        f"version      {s['version']} (last flush {s['last_flush'] or 'never'})",
        f"versions     {s['versions']}, pinned {s['pinned'] or 'none'}",
        f"on disk      {human_bytes(d['total_bytes'])}: chunks {human_bytes(d['chunks']['bytes'])} "
        f"({d['chunks']['files']} files, {d['chunks'].get('sparse_files', 0)} sparse), "
        f"segments {human_bytes(d['segments']['bytes'])} "
        f"({d['segments']['files']} files), metadata {human_bytes(d['metadata']['bytes'])}",
        f"compression  {s['compression_ratio']:.2f}x on base chunks",
    ]
    return "\n".join(lines)


@dataclass
class VersionCheck:
    version: int
    ok: bool
    damaged: list[str] = field(default_factory=list)  # the files named by the errors
    reasons: list[str] = field(default_factory=list)
    parent: int | None = None

    def fail(self, where: str | None, reason: str) -> None:
        self.ok = False
        if where is not None and where not in self.damaged:
            self.damaged.append(where)
        self.reasons.append(reason if where is None else f"{where}: {reason}")


@dataclass
class Verification:
    path: str
    versions: list[VersionCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # not tied to one version (META, PINS, the chain)

    @property
    def ok(self) -> bool:
        return not self.problems and all(v.ok for v in self.versions)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "problems": self.problems,
            "versions": [vars(v) for v in self.versions],
        }


def _manifest_parent(path: Path, version: int) -> int | None:
    """The parent version a manifest records (None if the format does not say)."""
    import json

    from lightning_embcache.store import fileio

    data = fileio.read_file(path / f"manifest-{version:012d}", b"manifest")
    parent = json.loads(bytes(data)).get("parent")
    return int(parent) if isinstance(parent, int) else None


def verify_store(
    path: str | os.PathLike[str], *, latest_only: bool = False, progress: Progress = _no_progress
) -> Verification:
    """Read every row of every retained version (each read checks the checksums of the chunk and
    segment records it touches) and the manifest chain; report each damaged file by name. A
    row-sharded store is verified shard by shard (problems name the shard's files)."""
    shards = shard_dirs(path)
    if shards:
        report = Verification(str(Path(path).resolve()))
        for shard in shards:
            part = verify_store(shard, latest_only=latest_only, progress=progress)
            report.problems += [f"{shard.name}: {p}" for p in part.problems]
            for v in part.versions:
                v.reasons = [f"{shard.name}: {r}" for r in v.reasons] if not v.ok else v.reasons
            report.versions += part.versions
        return report
    root = Path(path)
    report = Verification(str(root.resolve()))
    try:
        with EmbeddingStore.open(root, readonly=True) as store:
            versions = store.versions()
            needed = _versions_needed(root, set(store.pinned()))
    except CorruptStoreError as exc:
        report.problems.append(f"{exc.path}: {exc.reason}")
        return report
    for version, why in sorted(needed.items()):
        if version not in versions:
            report.problems.append(
                f"{root / f'manifest-{version:012d}'}: version {version} is {why}, but its manifest is gone: "
                "a resume from it will fail"
            )
    if latest_only:  # the newest, and every version something still needs
        versions = sorted(set(versions[-1:]) | (set(needed) & set(versions)))
    previous = None
    for version in versions:
        check = VersionCheck(version, ok=True)
        try:
            check.parent = _manifest_parent(root, version)
            if check.parent is not None and check.parent >= version:
                check.fail(
                    str(root / f"manifest-{version:012d}"), f"names parent version {check.parent}, not an earlier one"
                )
            _read_every_row(root, version, check, progress)
        except CorruptStoreError as exc:
            check.fail(exc.path, exc.reason)
        except StoreError as exc:
            check.fail(None, str(exc))
        if previous is not None and version <= previous:
            report.problems.append(f"versions out of order: {previous} then {version}")
        previous = version
        report.versions.append(check)
    return report


def _versions_needed(root: Path, pinned: set[int]) -> dict[int, str]:
    """Versions something outside the manifests still names: PINS, and the checkpoint registry
    beside the store (a Lightning checkpoint resumes from them). version -> who names it."""
    from lightning_embcache.store.pins_registry import CheckpointPins, registry_path

    needed = {v: "pinned (PINS)" for v in pinned}
    if registry_path(root).exists():
        for v, files in CheckpointPins(root).versions.items():
            named = f"named by checkpoint {files[0]}" if files else "in the checkpoint registry"
            needed[v] = f"{needed[v]} and {named}" if v in needed else named
    return needed


def _read_every_row(root: Path, version: int, check: VersionCheck, progress: Progress) -> None:
    """Read every stored record of `version` (at its own size: a store may have grown since) in
    batches: each row of a chunk that has a file, and each row a segment holds. Rows of chunks
    never written are computed from ``init`` on read, with nothing on disk to check, so they are
    skipped (a fresh 10M-row table verifies at once instead of generating every row). A batch that
    fails is read again chunk by chunk, so every damaged file is named, not only the first."""
    with EmbeddingStore.open(root, version=version, readonly=True, hot_bytes=64 << 20) as store:
        names, chunk, num_rows = tuple(store.field_names), store.chunk_rows, store.num_rows
        filed = np.asarray(store._versions.cmap) != 0  # chunks with a base file at this version
        held = [s.ids for s in store._versions.committed]
        in_segments = np.unique(np.concatenate(held)) if held else np.zeros(0, np.int64)
        batch = max(chunk, VERIFY_BATCH_ROWS // chunk * chunk)
        for lo in range(0, num_rows, batch):
            hi = min(num_rows, lo + batch)
            ids = _stored_ids(lo, hi, chunk, filed, in_segments)
            if len(ids):
                _read_or_name(store, ids, names, chunk, check)
            progress(f"version {version}", hi, num_rows)


def _stored_ids(lo: int, hi: int, chunk: int, filed: np.ndarray, in_segments: np.ndarray) -> np.ndarray:
    """Rows in [lo, hi) with a record on disk: those of chunks with a file, and segment rows."""
    rows = np.arange(lo, hi, dtype=np.int64)
    seg = in_segments[np.searchsorted(in_segments, lo) : np.searchsorted(in_segments, hi)]
    return np.union1d(rows[filed[rows // chunk]], seg)


def _read_or_name(store: EmbeddingStore, ids: np.ndarray, names: tuple[str, ...], chunk: int,
                  check: VersionCheck) -> None:
    try:
        store.get_fields(torch.from_numpy(ids), names)
    except CorruptStoreError:
        cuts = np.flatnonzero(np.diff(ids // chunk)) + 1
        for part in np.split(ids, cuts):  # chunk by chunk: name every damaged file
            try:
                store.get_fields(torch.from_numpy(part), names)
            except CorruptStoreError as exc:
                check.fail(exc.path, exc.reason)


def format_verification(r: Verification) -> str:
    lines = []
    for v in r.versions:
        if v.ok:
            lines.append(f"version {v.version}: ok" + (f" (parent {v.parent})" if v.parent is not None else ""))
        else:
            lines.append(f"version {v.version}: DAMAGED")
            lines += [f"  {reason}" for reason in v.reasons]
    lines += [f"DAMAGED {p}" for p in r.problems]
    lines.append(f"{r.path}: " + ("every checksum and the manifest chain verified" if r.ok else "damaged"))
    return "\n".join(lines)


def compact_store(path: str | os.PathLike[str], *, progress: Progress = _no_progress) -> dict[str, Any]:
    """Fold the delta segments into base chunks, publish that layout as a new version (same rows)
    and reclaim the versions no one pins or reads. Interrupting it at any point leaves the store
    at its last published version: every step writes new files and commits by an atomic rename.
    A row-sharded store is compacted shard by shard."""
    shards = shard_dirs(path)
    if shards:
        parts = [compact_store(p, progress=progress) for p in shards]
        return {
            "path": str(Path(path).resolve()),
            "shards": parts,
            "version": [p["version"] for p in parts],
            "versions_before": [p["versions_before"] for p in parts],
            "versions": [p["versions"] for p in parts],
            "pinned": [p["pinned"] for p in parts],
            "bytes_before": sum(p["bytes_before"] for p in parts),
            "bytes_after": sum(p["bytes_after"] for p in parts),
            "seconds": round(sum(p["seconds"] for p in parts), 3),
        }
    root = Path(path)
    before, _ = _dir_totals(root)
    started = time.perf_counter()
    progress("open (writer lock)", 0, 3)
    with EmbeddingStore.open(root, hot_bytes=64 << 20) as store:
        old_versions = store.versions()
        progress("fold segments into chunks", 1, 3)
        store.compact()
        progress("publish and reclaim", 2, 3)
        version = store.flush()
        store._wait_bg()  # report what stays: the clean-up that flush started runs in the background
        versions, pinned = store.versions(), store.pinned()
    progress("done", 3, 3)
    after, _ = _dir_totals(root)
    return {
        "path": str(root.resolve()),
        "version": version,
        "versions_before": old_versions,
        "versions": versions,
        "pinned": pinned,
        "bytes_before": before,
        "bytes_after": after,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _dir_totals(root: Path) -> tuple[int, int]:
    total = files = 0
    for sub in (root, root / "chunks", root / "segments"):
        b, f = _dir_bytes(sub)
        total, files = total + b, files + f
    return total, files
