"""A flipped byte or a truncation in any store file raises CorruptStoreError naming that file.

The error comes from open() or from the first read that touches the file, never as wrong rows
or a bare OSError/ValueError. A folder or file that is not a store gets a clear StoreError.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lightning_embcache import CorruptStoreError, EmbeddingStore, InvalidArgumentError, StoreError
from lightning_embcache.store import fileio

N, DIM, CHUNK = 400, 4, 8  # a table large enough that one small flush is not compacted at once
HOT = 6 * (DIM * 4 + 11)


def _build(path: Path) -> dict[str, torch.Tensor]:
    """A store holding every kind of file: META, manifests, a chunk map, base chunks, a segment, PINS."""
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=HOT) as s:
        s.update(torch.arange(N), torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM))
        s.flush()
        s.compact()  # base chunks + chunk map; the flushed segment is folded and reclaimed
        s.update([1, 2, 3], torch.full((3, DIM), -2.0))
        v = s.flush()  # one delta segment over chunk 0
        s.pin(v)
        return {"rows": s.get(torch.arange(N))}


def _latest(path: Path, pattern: str) -> Path:
    found = sorted(path.glob(pattern))
    assert found, f"the store has no {pattern} file: {sorted(p.name for p in path.rglob('*'))}"
    return found[-1]


def _segment_regions(seg: Path) -> tuple[int, int]:
    """(offset of the segment directory, offset of the records) in a segment file."""
    length, _ = fileio.parse_header(seg, seg.read_bytes()[: fileio.HEADER_SIZE], b"segment")
    return fileio.HEADER_SIZE, fileio.HEADER_SIZE + length


def _flip(p: Path, offset: int) -> None:
    data = bytearray(p.read_bytes())
    data[offset] ^= 0x5A
    p.write_bytes(bytes(data))


def _truncate(p: Path, size: int) -> None:
    with open(p, "r+b") as f:
        f.truncate(size)


def _target(path: Path, kind: str) -> Path:
    return {
        "META": lambda: path / "META",
        "manifest": lambda: _latest(path, "manifest-*"),
        "chunkmap": lambda: _latest(path, "chunkmap-*"),
        "chunk": lambda: _latest(path, "chunks/c*"),
        "segment": lambda: _latest(path, "segments/s*"),
        "PINS": lambda: path / "PINS",
    }[kind]()


DAMAGE = [
    ("META", "flip-header"), ("META", "flip-payload"), ("META", "truncate"), ("META", "empty"),
    ("manifest", "flip-header"), ("manifest", "flip-payload"), ("manifest", "truncate"),
    ("chunkmap", "flip-payload"), ("chunkmap", "truncate"),
    ("chunk", "flip-header"), ("chunk", "flip-payload"), ("chunk", "truncate"),
    ("segment", "flip-header"), ("segment", "flip-directory"), ("segment", "flip-records"),
    ("segment", "truncate-records"), ("segment", "truncate-directory"),
    ("PINS", "flip-payload"), ("PINS", "truncate"),
]


@pytest.mark.parametrize("mode", ["disk", "memory"])
@pytest.mark.parametrize("kind, damage", DAMAGE, ids=[f"{k}-{d}" for k, d in DAMAGE])
def test_damaged_file_raises_corrupt_store_error_naming_it(shm_path, kind, damage, mode):
    path = shm_path / "store"
    _build(path)
    target = _target(path, kind)
    size = target.stat().st_size
    if damage == "flip-header":
        _flip(target, 3)
    elif damage == "flip-payload":
        _flip(target, size - 1 if kind != "segment" else fileio.HEADER_SIZE + 1)
    elif damage == "flip-directory":
        _flip(target, _segment_regions(target)[0] + 9)
    elif damage == "flip-records":
        _flip(target, size - 1)
    elif damage == "truncate":
        _truncate(target, size // 2)
    elif damage == "empty":
        _truncate(target, 0)
    elif damage == "truncate-records":
        _truncate(target, size - 3)
    elif damage == "truncate-directory":
        _truncate(target, _segment_regions(target)[0] + 5)

    with pytest.raises(CorruptStoreError) as info:
        with EmbeddingStore.open(path, hot_bytes=HOT if mode == "disk" else None) as s:
            s.get(torch.arange(N))  # every row: touches every live file
    err = info.value
    assert Path(err.path) == target, f"error names {err.path}, the damaged file is {target}"
    assert str(target) in str(err)


def test_undamaged_store_reads_back(shm_path):
    """The damage tests above would pass vacuously if the store could not be read at all."""
    want = _build(shm_path / "store")["rows"]
    with EmbeddingStore.open(shm_path / "store", hot_bytes=HOT) as s:
        assert torch.equal(s.get(torch.arange(N)), want)
        assert s.pinned() == [s.version]


def test_damage_to_a_file_of_the_wrong_kind_is_reported(shm_path):
    path = shm_path / "store"
    _build(path)
    manifest = _latest(path, "manifest-*")
    (path / "META").write_bytes(manifest.read_bytes())  # a valid store file, but not a META
    with pytest.raises(CorruptStoreError, match="META") as info:
        EmbeddingStore.open(path)
    assert "manifest" in str(info.value)


def test_manifest_naming_another_version_is_reported(shm_path):
    path = shm_path / "store"
    _build(path)
    latest = _latest(path, "manifest-*")
    older = latest.with_name(f"manifest-{int(latest.name.split('-')[1]) + 5:012d}")
    older.write_bytes(latest.read_bytes())  # intact checksums, wrong content for its name
    with pytest.raises(CorruptStoreError) as info:
        with EmbeddingStore.open(path, version=int(older.name.split("-")[1])) as s:
            s.get(torch.arange(N))
    assert Path(info.value.path) == older


def test_missing_segment_is_reported(shm_path):
    path = shm_path / "store"
    _build(path)
    seg = _latest(path, "segments/s*")
    seg.unlink()
    with pytest.raises(CorruptStoreError, match="missing") as info:
        EmbeddingStore.open(path)
    assert Path(info.value.path) == seg


def test_foreign_folder_is_not_opened_and_not_touched(shm_path):
    folder = shm_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"\xff\xd8\xff" + os.urandom(100))
    before = sorted(p.name for p in folder.iterdir())
    for readonly in (False, True):
        with pytest.raises(StoreError, match="not a lightning_embcache store") as info:
            EmbeddingStore.open(folder, readonly=readonly)
        assert str(folder) in str(info.value)
    with pytest.raises(InvalidArgumentError, match="not empty") as info:
        EmbeddingStore.create(folder, N, DIM)
    assert str(folder) in str(info.value)
    assert sorted(p.name for p in folder.iterdir()) == before, "a refused open/create left files behind"


def test_foreign_meta_file_is_reported(shm_path):
    folder = shm_path / "other"
    folder.mkdir()
    (folder / "META").write_text(json.dumps({"format": "something else", "padding": "x" * 100}))
    with pytest.raises(CorruptStoreError, match="not a lightning_embcache store file") as info:
        EmbeddingStore.open(folder)
    assert Path(info.value.path) == folder / "META"


def test_missing_path_is_reported(shm_path):
    with pytest.raises(InvalidArgumentError) as info:
        EmbeddingStore.open(shm_path / "nope")
    assert "path=" in str(info.value) and "nope" in str(info.value)


def test_open_on_a_regular_file_is_a_clear_error(shm_path):
    f = shm_path / "table.npy"
    f.write_bytes(b"\x93NUMPY" + bytes(100))
    with pytest.raises(StoreError) as info:
        EmbeddingStore.open(f)
    assert "table.npy" in str(info.value)


def test_create_on_a_regular_file_is_a_clear_error(shm_path):
    f = shm_path / "table.npy"
    f.write_bytes(b"\x93NUMPY" + bytes(100))
    with pytest.raises(StoreError) as info:
        EmbeddingStore.create(f, N, DIM)
    assert "table.npy" in str(info.value)
    assert f.read_bytes().startswith(b"\x93NUMPY")
