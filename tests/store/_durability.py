"""A power-cut oracle: which bytes and names of a store folder would survive a power cut now.

A process kill keeps the page cache, so kill -9 tests cannot see a missing fsync. This oracle
listens to every file operation the store makes (`fileio.FAULTS` hooks, plus `sync_written`,
which is a `syncfs` on Linux) and keeps, as a file system without a cache would:

* data: a file's bytes are durable once fsynced (or synced by a `syncfs`) after its last write;
* names: a rename, link or unlink is durable once its folder is fsynced (or by a `syncfs`);
* overwrites of an existing file in place (``"overwrite"``, compaction folding rows into a chunk
  file: inplace.py): until the file is synced, a power cut leaves each 512-byte sector the
  overwrites changed old or new, at random (lost, kept, or torn anywhere).

At every commit point - the rename of a manifest into place - it checks that every file the new
manifest names (its segments, its chunk map, the chunk files that map names, META) has durable
bytes *and* a durable name: otherwise a power cut right after the manifest's own name became
durable would leave a version whose files are gone or empty.

It also keeps the durable state itself: at each folder fsync its names and, for files whose bytes
were synced since their last write, those bytes (a name renamed over keeps the old file's bytes
until the folder is synced again). `reconstruct(dst)` writes the folder a power cut would leave
now: the durable names, each with its durable bytes, empty where they never reached the disk,
files overwritten in place since their last sync a random mix of their old and new sectors.

Threads: a store makes file operations from several threads at once (the training thread's
flushes, a background compaction round). The hooks keep their state under one lock, and a power
cut is taken under it (`quiescent()`), so it sees one instant of that state: taken without it, a
cut could write one folder before another thread's intent became durable and a file after that
thread overwrote it (a state no power cut leaves). An operation already under way in another
thread meanwhile counts as not done yet (its hook has not run), which a power cut allows.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from lightning_embcache.store import fileio

HEADER = fileio.HEADER_SIZE


class PowerCutOracle:
    """Install with `fileio.FAULTS = oracle` and `oracle.patch(monkeypatch)`; read `violations`."""

    def __init__(self, root: Path) -> None:
        """``root``: the folder under which store folders are watched (one store, or several)."""
        self.root = Path(root).resolve()
        self.written: set[Path] = set()        # bytes written since their last sync
        self.unsynced_names: set[Path] = set()  # renamed/linked/unlinked since their folder's sync
        self.overwritten: set[Path] = set()  # overwritten in place since their last sync
        self.torn = 0  # files a reconstruction mixed old and new sectors of
        self._rng = np.random.default_rng(11)
        # folder -> name -> bytes (None: the name is durable, its bytes are not), as of its last fsync
        self.durable: dict[Path, dict[str, bytes | None]] = {}
        self.commits = 0
        self.calls = 0  # file operations seen (the fault workload reports it)
        self.violations: list[str] = []
        self._mu = threading.RLock()  # the hooks' state: one thread at a time

    # ---- hooks ---------------------------------------------------------------------------------
    def patch(self, monkeypatch) -> None:
        real = fileio.sync_written

        def sync_written(dir_fd, names, path):
            real(dir_fd, names, path)
            with self._mu:
                self.syncfs()

        monkeypatch.setattr(fileio, "sync_written", sync_written)

    def syncfs(self) -> None:
        self.written.clear()
        self.unsynced_names.clear()
        self.overwritten.clear()
        for folder in self._folders():
            self._keep_folder(folder)

    # ---- the durable state -----------------------------------------------------------------------
    def _folders(self) -> list[Path]:
        return [f for f in (self.root, self.root / "segments", self.root / "chunks") if f.is_dir()]

    def _keep_folder(self, folder: Path) -> None:
        """``folder`` was fsynced: its names now are durable, each with its bytes now if those
        were synced since their last write, else torn (None)."""
        names: dict[str, bytes | None] = {}
        before = self.durable.get(folder, {})
        for name in os.listdir(folder):
            f = folder / name
            if ".tmp" in name or f.is_dir():
                continue
            if f in self.overwritten:  # the bytes as of its last sync; the overwrites are pending
                names[name] = before.get(name)
            else:
                names[name] = None if f in self.written else f.read_bytes()
        self.durable[folder] = names

    def _file_synced(self, f: Path) -> None:
        names = self.durable.get(f.parent)
        if names is not None and f.name in names and (names[f.name] is None or f in self.overwritten) and f.exists():
            names[f.name] = f.read_bytes()  # the durable name's bytes reached the disk too
        self.overwritten.discard(f)

    def reconstruct(self, dst: Path) -> None:
        """The folder a power cut would leave now, written at ``dst`` (a torn file: empty)."""
        for folder, names in self.durable.items():
            out = dst / folder.relative_to(self.root)
            out.mkdir(parents=True, exist_ok=True)
            for name, data in names.items():
                f = folder / name
                if data is not None and f in self.overwritten and f.exists():
                    data = self._mix(data, f.read_bytes())
                (out / name).write_bytes(data or b"")
        for sub in ("segments", "chunks"):
            (dst / sub).mkdir(parents=True, exist_ok=True)

    def _mix(self, old: bytes, new: bytes) -> bytes:
        """What a power cut leaves of a file overwritten in place: each 512-byte sector that the
        overwrites changed, old or new."""
        if len(old) != len(new):  # (overwrites never change a file's length)
            return new
        a = np.frombuffer(old, np.uint8)
        b = np.frombuffer(new, np.uint8)
        sectors = -(-len(a) // 512)
        pick = np.repeat(self._rng.random(sectors) < 0.5, 512)[: len(a)]
        if (a != b).any():
            self.torn += 1
        return np.where(pick, b, a).tobytes()

    def _path(self, name: object) -> Path | None:
        p = Path(str(name))
        if not p.is_absolute():
            return None  # a bare name (pool files, LATEST's link): not a file a manifest names
        p = p.resolve() if p.parent.exists() else p
        return p if self.root in (p, *p.parents) else None

    @contextmanager
    def quiescent(self) -> Iterator[None]:
        """Inside this block no other thread's hook changes the durable state (take a cut here)."""
        with self._mu:
            yield

    def before(self, op: str, name: object) -> None:
        with self._mu:
            self.calls += 1
            p = self._path(name)
            if p is None:
                return
            if op == "rename" and p.name.startswith("manifest-"):
                self._check_commit(p)

    def after(self, op: str, name: object) -> None:
        with self._mu:
            self._after(op, name)

    def _after(self, op: str, name: object) -> None:
        p = self._path(name)
        if p is None:
            return
        if op == "write":
            self.written.add(p)
        elif op == "overwrite":
            self.overwritten.add(p)
        elif op == "fsync":
            if p.is_dir():
                self.unsynced_names = {n for n in self.unsynced_names if n.parent != p}
                if p in (self.root, self.root / "segments", self.root / "chunks"):
                    self._keep_folder(p)
            else:
                self.written.discard(p)
                self._file_synced(p)
        elif op in ("rename", "link", "unlink"):
            self.unsynced_names.add(p)

    # ---- the check -----------------------------------------------------------------------------
    def _check_commit(self, manifest: Path) -> None:
        self.commits += 1
        root = manifest.parent  # this store's folder (the oracle may watch several: a reshard)
        tmp = sorted(root.glob(f".{manifest.name}.tmp*"), key=lambda q: q.stat().st_mtime)
        if not tmp:
            self.violations.append(f"commit {self.commits}: no temporary file for {manifest.name}")
            return
        m = json.loads(tmp[-1].read_bytes()[HEADER:])
        needed = [root / "META"] + [root / "segments" / f"s{s:012d}" for s in m["segments"]]
        if m["chunkmap"]:
            meta = json.loads((root / "META").read_bytes()[HEADER:])
            chunks = -(-int(meta["num_rows"]) // int(meta["chunk_rows"]))
            cmap_path = root / f"chunkmap-{m['chunkmap']:08d}"
            needed.append(cmap_path)
            gens = np.frombuffer(cmap_path.read_bytes()[HEADER:], np.int32, chunks)
            needed += [root / "chunks" / f"c{c:08d}-g{g:08d}" for c, g in enumerate(gens.tolist()) if g]
        for f in needed:
            if f in self.written or f in self.overwritten:
                self.violations.append(f"{manifest.name} (commit {self.commits}) names {f.name}, whose bytes "
                                       "were not fsynced before the commit")
            if f in self.unsynced_names:
                self.violations.append(f"{manifest.name} (commit {self.commits}) names {f.name}, whose name "
                                       "(rename) was not made durable by a folder fsync before the commit")
            if not f.exists():
                self.violations.append(f"{manifest.name} (commit {self.commits}) names {f.name}, which is missing")

