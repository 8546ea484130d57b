"""Which checkpoint files refer to which store versions (``<store path>.checkpoints.json``), so
versions stay pinned exactly as long as a checkpoint file refers to them.

A Lightning checkpoint holds only a reference to a store version (under `CHECKPOINT_KEY`). The
version is pinned in the store when the checkpoint is saved and unpinned once no checkpoint file
that refers to it exists. The table lives beside the store, so a resumed process can release
versions pinned by the process before it, and tools (`embcache verify`, reshard) read it without
Lightning.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from . import fileio
from .errors import CorruptStoreError

log = logging.getLogger(__name__)

REGISTRY_SUFFIX = ".checkpoints.json"
CHECKPOINT_KEY = "embedding_stores"


def registry_path(store_path: Path) -> Path:
    return store_path.with_name(store_path.name + REGISTRY_SUFFIX)


class CheckpointPins:
    """version -> checkpoint files for one store, persisted as JSON (atomic replace)."""

    def __init__(self, store_path: Path) -> None:
        self.file = registry_path(store_path)
        self.versions: dict[int, list[str]] = {}
        self._fresh: set[int] = set()  # pinned by a save whose file is not written yet
        # files attached before they existed (an asynchronous checkpoint writer): kept until seen
        self._unseen: set[str] = set()
        if self.file.exists() or self.file.is_symlink():
            self.versions = self._parse(fileio.read_raw(self.file))

    def _parse(self, raw: bytes) -> dict[int, list[str]]:
        """The registry's table, checked: a damaged or crafted file is a named error."""
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise CorruptStoreError(self.file, "checkpoint registry is not valid JSON") from None
        table = data.get("versions") if isinstance(data, dict) else None
        if not isinstance(table, dict):
            raise CorruptStoreError(self.file, "checkpoint registry has no 'versions' table")
        out: dict[int, list[str]] = {}
        for v, files in table.items():
            # (isdigit() holds for digits int() refuses, such as '²': ASCII digits only)
            if not (isinstance(v, str) and v.isascii() and v.isdigit() and len(v) < 19) or not isinstance(files, list) \
                    or not all(isinstance(f, str) for f in files):
                raise CorruptStoreError(self.file, f"checkpoint registry entry {v!r} is not version -> [file, ...]")
            out[int(v)] = list(files)
        return out

    def save(self) -> None:
        payload = {"format": 1, "versions": {str(v): files for v, files in sorted(self.versions.items())}}
        # a fresh temporary (O_EXCL | O_NOFOLLOW) renamed over the registry: a symlink planted at
        # either name is replaced, never written through
        fileio.write_plain(self.file, json.dumps(payload, indent=1).encode())

    def pin(self, store: Any, version: int) -> None:
        """Pin `version` for a checkpoint about to be written."""
        if version not in self.versions:
            store.pin(version)
            self.versions[version] = []
        self._fresh.add(version)
        self.save()

    def attach(self, version: int, file: str) -> None:
        """The checkpoint for `version` is now at `file` (a file written again refers only to its new version)."""
        for files in self.versions.values():
            if file in files:
                files.remove(file)
        self.versions.setdefault(version, []).append(file)
        self._fresh.discard(version)
        if not os.path.exists(file):  # written in the background (AsyncCheckpointIO): not there yet
            self._unseen.add(file)

    def detach(self, file: str) -> None:
        for files in self.versions.values():
            if file in files:
                files.remove(file)
        self._unseen.discard(file)

    def sweep(self, store: Any) -> list[int]:
        """Unpin versions that no existing checkpoint file refers to; returns them. A file attached
        before it existed counts as existing until it was once seen (its writer is still at it)."""
        released = []
        for version, files in list(self.versions.items()):
            there = [f for f in files if os.path.exists(f)]
            self._unseen.difference_update(there)  # written now: from here its absence means removed
            files[:] = [f for f in files if f in self._unseen or f in there]
            if files or version in self._fresh:
                continue
            try:
                store.unpin(version)
            except Exception as exc:  # already reclaimed or never pinned: nothing to release
                log.debug("unpin(%s) of %s: %s", version, self.file, exc)
            del self.versions[version]
            released.append(version)
        self.save()
        return released
