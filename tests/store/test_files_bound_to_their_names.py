"""Every store file is bound to the name its manifest gives it: a valid file of the same store put
in another file's place (another chunk, an older generation of the same chunk, another segment, an
older chunk map) is refused by name on the first read, by `verify` and by `compact`, never served.
Stores written before names were bound (format 2 files, META without ``names_bound``) still open."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from lightning_embcache import CorruptStoreError, EmbeddingStore
from lightning_embcache.store import disk as disk_mod
from lightning_embcache.store import fileio
from lightning_embcache.tools import compact_store, verify_store

N, DIM, CHUNK = 64, 4, 16
HOT = 4 * (DIM * 4 + 16)  # a few rows: reads go to the files


def _rows(value: float, n: int = N) -> torch.Tensor:
    return torch.full((n, DIM), value) + torch.arange(n, dtype=torch.float32)[:, None]


def _chunk_files(path: Path, chunk: int) -> list[Path]:
    return sorted((path / "chunks").glob(f"c{chunk:08d}-g*"))


def _two_generations(path: Path, aside: Path) -> dict[str, Path]:
    """Chunk 0 and 1 written at generation g1 (copies kept aside), then chunk 0 rewritten at g2."""
    aside.mkdir()
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=HOT) as s:
        s.update(torch.arange(N), _rows(1.0))
        s.flush()
        s.compact()
        s.flush()
        old0, old1 = _chunk_files(path, 0)[-1], _chunk_files(path, 1)[-1]
        old_map = sorted(path.glob("chunkmap-*"))[-1]
        for f in (old0, old1, old_map):
            shutil.copy(f, aside / f.name)
        # a read-only handle holds the version before: its chunk files are rewritten, not folded
        # in place (a file folded in place keeps its name: see docs/store-format.md)
        with EmbeddingStore.open(path, readonly=True):
            s.update(torch.arange(CHUNK), _rows(5.0, CHUNK))
            s.flush()
            s.compact()
        s.flush()
        new0 = _chunk_files(path, 0)[-1]
        assert new0.name != old0.name
    return {"old0": aside / old0.name, "old1": aside / old1.name, "new0": new0, "old_map": aside / old_map.name,
            "new_map": sorted(path.glob("chunkmap-*"))[-1]}


def _read_all(path: Path) -> torch.Tensor:
    with EmbeddingStore.open(path, readonly=True, hot_bytes=HOT) as s:
        return s.get(torch.arange(N))


def _assert_refused_everywhere(path: Path, victim: Path) -> None:
    with pytest.raises(CorruptStoreError) as info:
        _read_all(path)
    assert Path(info.value.path).name == victim.name and "bound to the name" in info.value.reason
    report = verify_store(path)
    assert not report.ok
    named = [r for v in report.versions for r in v.reasons] + report.problems
    assert any(victim.name in r for r in named), named
    # a compaction that must fold the victim's rows refuses it rather than rewriting them as valid
    # (a writable open may refuse it already: it reads every segment's directory)
    with pytest.raises(CorruptStoreError):
        with EmbeddingStore.open(path, hot_bytes=HOT) as s:
            row = int(victim.name[1:9]) * CHUNK if victim.parent.name == "chunks" else 0
            s.update(torch.tensor([row]), torch.zeros(1, DIM))
            s.flush()
        compact_store(path)
    with pytest.raises(CorruptStoreError):  # still refused: the wrong rows were not made permanent
        _read_all(path)


def test_an_older_generation_of_the_same_chunk_is_refused(tmp_path):
    files = _two_generations(tmp_path / "s", tmp_path / "aside")
    shutil.copy(files["old0"], files["new0"])
    _assert_refused_everywhere(tmp_path / "s", files["new0"])


def test_another_chunk_of_the_same_store_is_refused(tmp_path):
    files = _two_generations(tmp_path / "s", tmp_path / "aside")
    victim = _chunk_files(tmp_path / "s", 1)[-1]
    shutil.copy(_chunk_files(tmp_path / "s", 2)[-1], victim)
    _assert_refused_everywhere(tmp_path / "s", victim)
    assert files


def test_an_older_chunk_map_is_refused(tmp_path):
    files = _two_generations(tmp_path / "s", tmp_path / "aside")
    shutil.copy(files["old_map"], files["new_map"])
    with pytest.raises(CorruptStoreError) as info:
        _read_all(tmp_path / "s")
    assert Path(info.value.path).name == files["new_map"].name


def test_another_segment_of_the_same_store_is_refused(tmp_path):
    path = tmp_path / "s"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=HOT) as s:
        s.update(torch.arange(0, 8), _rows(2.0, 8))
        v1 = s.flush()
        s.pin(v1)
        s.update(torch.arange(40, 48), _rows(3.0, 8))
        s.pin(s.flush())
    segs = sorted((path / "segments").glob("s*"))
    assert len(segs) >= 2
    shutil.copy(segs[0], segs[-1])  # v2's segment now holds v1's rows
    _assert_refused_everywhere(path, segs[-1])


def _unbound_pack(kind, payload, uid, name):
    """A header as format 2 wrote it: bound to no name."""
    head = fileio._HEADER.pack(fileio.MAGIC, kind.ljust(8, b"\0"), fileio.UNBOUND_FORMAT, uid, len(payload),
                               fileio.crc32(payload), 0)
    return [head[:-4] + struct.pack("<I", fileio.crc32(head[:-4])), payload]


def test_a_store_written_before_names_were_bound_still_opens_and_trains(tmp_path, monkeypatch):
    path = tmp_path / "old"
    with monkeypatch.context() as m:
        m.setattr(fileio, "pack", _unbound_pack)
        m.setattr(disk_mod, "pack", _unbound_pack)
        real_init = disk_mod.Disk.__init__

        def as_before(self, *args, unbound=True, **kw):
            real_init(self, *args, unbound=True, **kw)

        m.setattr(disk_mod.Disk, "__init__", as_before)
        with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=HOT) as s:
            s.update(torch.arange(N), _rows(1.0))
            s.flush()
            s.compact()
            s.update(torch.arange(4), _rows(7.0, 4))
            s.flush()
        meta = json.loads(fileio.read_file(path / "META", b"meta"))
        del meta["names_bound"]
        (path / "META").unlink()
        fileio.write_file(path / "META", b"meta", json.dumps(meta).encode(), fileio.uuid_bytes(meta["uuid"]))
    assert all(p.read_bytes()[16:20] == struct.pack("<I", 2) for p in path.rglob("*")
               if p.is_file() and p.read_bytes()[:8] == fileio.MAGIC)
    want = torch.cat([_rows(7.0, 4), _rows(1.0)[4:]])
    assert torch.equal(_read_all(path), want)
    with EmbeddingStore.open(path, hot_bytes=HOT) as s:  # new files are bound; old ones still read
        s.update(torch.arange(60, 64), _rows(9.0, 4))
        s.flush()
        s.compact()
        s.flush()
    want[60:] = _rows(9.0, 4)
    assert torch.equal(_read_all(path), want)
    assert verify_store(path).ok


def test_a_file_bound_to_no_name_is_refused_in_a_store_whose_files_all_are(tmp_path):
    files = _two_generations(tmp_path / "s", tmp_path / "aside")
    victim = files["new0"]
    data = victim.read_bytes()
    length, _ = fileio.parse_header(victim, data[: fileio.HEADER_SIZE], data[8:16].rstrip(b"\0"))
    kind = data[8:16].rstrip(b"\0")
    head = _unbound_pack(kind, data[fileio.HEADER_SIZE : fileio.HEADER_SIZE + length], fileio.header_uuid(data),
                         victim.name)[0]
    victim.write_bytes(head + data[fileio.HEADER_SIZE :])
    with pytest.raises(CorruptStoreError, match="bound to no name"):
        _read_all(tmp_path / "s")
