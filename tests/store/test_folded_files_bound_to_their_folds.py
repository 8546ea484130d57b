"""A chunk file folded in place keeps its name, so its name cannot tell it from a copy of it taken
before the fold. Its header records the newest segment folded into it, and every reader refuses a
file that records less than the chunk map naming it says: an older copy put back in its place is
named, never served (issue 36: every file bound to the exact name, and contents, its manifest
gives it)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from _store_helpers import assert_bitwise_equal

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import chunkrows, compaction, disk, fileio, recycle
from lightning_embcache.store.errors import CorruptStoreError
from lightning_embcache.tools import verify_store

N, DIM, CHUNK = 4096, 16, 256  # 16 dense chunks


@pytest.fixture(autouse=True)
def _fold_in_place(monkeypatch):
    monkeypatch.setattr(compaction, "FOLD_IN_PLACE", True)  # (off by default: these tests are about it)


def _filled(path) -> tuple[EmbeddingStore, torch.Tensor]:
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK)
    table = torch.randn(N, DIM, generator=torch.Generator().manual_seed(0))
    s.update(torch.arange(N), table)
    s.flush()
    s.compact()
    return s, table


def _chunk_file(path, chunk: int):
    (f,) = (path / "chunks").glob(f"c{chunk:08d}-g*")
    return f


def _update_and_fold(s, table, seed: int) -> None:
    """10% of the rows, spread over every chunk, flushed and folded (in place)."""
    before = s.stats().chunks_folded_in_place
    _update_and_fold_anew(s, table, seed)
    assert s.stats().chunks_folded_in_place > before


def _with_an_older_copy(tmp_path) -> tuple:
    """A store whose chunk 3 was folded in place after a copy of its file was taken; the copy is
    put back in its place (same name, older rows). Returns (path, the file, the acknowledged rows)."""
    path = tmp_path / "s"
    s, table = _filled(path)
    f = _chunk_file(path, 3)
    old = f.read_bytes()
    with s:
        _update_and_fold(s, table, 1)
    assert _chunk_file(path, 3) == f and f.read_bytes() != old  # folded in place: same name, new rows
    assert not list((path / "segments").iterdir())  # every segment folded: reads take chunk 3 from its file
    f.write_bytes(old)
    return path, f, table


def test_an_older_copy_of_a_file_folded_in_place_is_refused_by_name(tmp_path):
    path, f, table = _with_an_older_copy(tmp_path)
    other = torch.arange(0, CHUNK)  # rows of chunk 0, untouched
    for readonly in (False, True):
        with EmbeddingStore.open(path, readonly=readonly) as s:
            assert_bitwise_equal(s.get(other), table[other], "rows of the other files")
            with pytest.raises(CorruptStoreError, match=f"{f.name}.*older copy"):
                s.get(torch.arange(3 * CHUNK, 4 * CHUNK))
            with pytest.raises(CorruptStoreError, match=f.name):
                s.get(torch.tensor([3 * CHUNK + 17]))  # one row: the per-row read path
    r = verify_store(path)
    assert not r.ok and f.name in str(r.as_dict())


@pytest.mark.parametrize("reader", ["pread", "mapped", "whole", "blocks"])
def test_every_read_path_refuses_it(tmp_path, monkeypatch, reader):
    """Batched reads through descriptors (io_uring/pread), through maps of the files, and a whole
    chunk read (compaction's and the warm tier's) and a read of some rows' blocks each check what
    the header records."""
    path, f, _ = _with_an_older_copy(tmp_path)
    monkeypatch.setattr(chunkrows, "MAPPED_READS", reader == "mapped")
    with EmbeddingStore.open(path) as s:
        with pytest.raises(CorruptStoreError, match=f"{f.name}.*older copy"):
            if reader == "whole":
                s._versions.disk.read_chunk(3, int(s._versions.cmap[3]))
            elif reader == "blocks":
                s._versions.disk.read_chunk_rows(3, int(s._versions.cmap[3]), np.array([5, 100]))
            else:
                s.get(torch.arange(3 * CHUNK, 4 * CHUNK))


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "new-files"])
def test_compaction_refuses_to_fold_into_it(tmp_path, monkeypatch, in_place):
    """A round that would fold rows into the older copy (in place or into a new file) stops and
    names it, and publishes nothing: the copy never becomes a file a chunk map vouches for."""
    path = tmp_path / "s"
    s, table = _filled(path)
    f = _chunk_file(path, 3)
    old = f.read_bytes()
    with s:
        _update_and_fold(s, table, 1)
        s.update(torch.arange(3 * CHUNK, 3 * CHUNK + 8), torch.zeros(8, DIM))
        v = s.flush()  # (not folded yet)
    f.write_bytes(old)
    monkeypatch.setattr(compaction, "FOLD_IN_PLACE", in_place)
    with EmbeddingStore.open(path) as s:
        with pytest.raises(CorruptStoreError, match=f"{f.name}.*older copy"):
            s.compact()
    assert f.read_bytes() == old and _chunk_file(path, 3) == f
    assert sorted(p.name for p in path.glob("manifest-*")) == [f"manifest-{v:012d}"]


def test_a_copy_from_another_point_of_the_same_file_is_told_apart_by_the_chunk_map(tmp_path):
    """Two folds in place: a copy after the first is as wrong as one before it; the file itself,
    put back byte for byte, reads again."""
    path = tmp_path / "s"
    s, table = _filled(path)
    with s:
        _update_and_fold(s, table, 1)
        mid = _chunk_file(path, 3).read_bytes()
        _update_and_fold(s, table, 2)
    f = _chunk_file(path, 3)
    now = f.read_bytes()
    f.write_bytes(mid)
    with EmbeddingStore.open(path, readonly=True) as r:
        with pytest.raises(CorruptStoreError, match=f"{f.name}.*older copy"):
            r.get(torch.arange(3 * CHUNK, 4 * CHUNK))
    f.write_bytes(now)
    with EmbeddingStore.open(path, readonly=True) as r:
        assert_bitwise_equal(r.get(torch.arange(N)), table, "rows with the file itself back")
    assert verify_store(path).ok


def test_a_fold_that_completed_before_its_chunk_map_was_written_is_read(tmp_path):
    """A crash after the in-place folds were durable (and their intent gone) but before the round
    wrote its chunk map: the files record newer segments than the published chunk map says.
    That is a state a crash can leave, and it reads: the rows those segments changed are read
    from the segments, which the published version still lists."""
    path = tmp_path / "s"
    s, table = _filled(path)
    rng = np.random.default_rng(5)
    ids = torch.from_numpy(np.sort(rng.choice(N, N // 10, replace=False)))
    vals = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
    s.update(ids, vals)
    table[ids] = vals
    s.flush()
    s.close()
    pid = os.fork()
    if pid == 0:
        try:
            class _DieAtChunkmap:
                def before(self, op, name) -> None:
                    if op == "write" and "chunkmap" in str(name):
                        os._exit(9)

                def after(self, op, name) -> None:
                    pass

            with EmbeddingStore.open(path) as w:
                fileio.FAULTS = _DieAtChunkmap()
                w.compact()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9, "the child never reached the chunk map"
    assert not (path / "FOLDING").exists()  # the folds completed
    for readonly in (True, False):
        with EmbeddingStore.open(path, readonly=readonly) as r:
            assert_bitwise_equal(r.get(torch.arange(N)), table, "rows after the crash")
    assert verify_store(path).ok


def test_files_written_before_files_recorded_their_folds_are_read_and_never_folded_in_place(tmp_path):
    """A store of the format before (raw files with layout flag 0, recording nothing) opens and
    reads; compaction writes its files anew rather than folding them in place (a copy of a file
    that records nothing could not be told from the file), and folds those new files in place."""
    path = tmp_path / "s"
    s, table = _filled(path)
    s.close()
    for f in (path / "chunks").iterdir():
        _rewrite_as_unrecorded(f)
    with EmbeddingStore.open(path) as s:
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows of files that record nothing")
        names = {f.name for f in (path / "chunks").iterdir()}
        _update_and_fold_anew(s, table, 1)
        assert s.stats().chunks_folded_in_place == 0
        assert not names & {f.name for f in (path / "chunks").iterdir()}  # every file written anew
        _update_and_fold(s, table, 2)
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after folding in place")
    assert verify_store(path).ok


def _update_and_fold_anew(s, table, seed: int) -> None:
    """10% of the rows, spread over every chunk, flushed and compacted (however it folds)."""
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(np.sort(rng.choice(N, N // 10, replace=False)))
    vals = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
    s.update(ids, vals)
    table[ids] = vals
    s.flush()
    s.compact()


def _rewrite_as_unrecorded(f) -> None:
    """Chunk file ``f`` as the format before wrote it: the directory's third field the raw length,
    layout flag 0, the header's checksums computed again."""
    data = bytearray(f.read_bytes())
    hs = fileio.HEADER_SIZE
    length = int.from_bytes(data[36:44], "little")
    c, rows, held, flag = disk._CHUNK_HEAD.unpack_from(data, hs)
    assert flag == disk.FOLDS_RECORDED and held > 0
    data[hs : hs + disk._CHUNK_HEAD.size] = disk._CHUNK_HEAD.pack(c, rows, rows * DIM * 4, 0)
    head = fileio.pack(b"chunkraw", bytes(data[hs : hs + length]), bytes(data[20:36]), f.name)
    data[:hs] = head[0]
    tmp = f.with_name(".tmp")
    tmp.write_bytes(bytes(data))
    shutil.move(tmp, f)


def test_a_background_read_stays_usable_across_a_fold_of_another_file(tmp_path):
    """`FilePool.unchanged_since`: a read-ahead begun before folds in place is still good if
    none of them changed its file (and none is changing one now), and a fold of its own file
    (before, during or after the read began, until it is asked) makes it useless."""
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        pool = recycle.FilePool(fd)
        seq = pool.inplace_seq
        with pool.folding():
            pool.note_folded(1, 5)
            during = pool.inplace_seq
            assert pool.unchanged_since(seq, 2, 5) == seq  # a file changes now: nothing vouched for
        now = pool.inplace_seq
        assert pool.moved_since(seq)
        assert pool.unchanged_since(seq, 2, 5) == now and not pool.moved_since(now)  # another file
        assert pool.unchanged_since(seq, 1, 4) == now  # another generation of the chunk
        assert pool.unchanged_since(seq, 1, 5) == seq  # its own file
        assert pool.unchanged_since(during, 1, 5) == during  # begun while its file changed
        assert pool.unchanged_since(now, 1, 5) == now  # begun after the fold
        for i in range(recycle.FOLD_LOG + 1):  # folds of other files, more than the log holds
            with pool.folding():
                pool.note_folded(100 + i, 1)
        assert pool.inplace_seq != now and pool.unchanged_since(now, 2, 5) == now  # forgotten: not vouched for
        assert pool.unchanged_since(pool.inplace_seq, 2, 5) == pool.inplace_seq
    finally:
        os.close(fd)


def test_a_copy_from_a_later_state_is_refused_by_a_reader_of_the_earlier_one(tmp_path):
    """A backup of the store, then a file of the live store (folded in place since, same name)
    put into the backup: the backup's version lists no segment that new, so a read-only handle
    and `embcache verify` name the file instead of serving rows newer than the version."""
    live, backup = tmp_path / "s", tmp_path / "b"
    s, table = _filled(live)
    with s:
        _update_and_fold(s, table, 1)
        shutil.copytree(live, backup, ignore=shutil.ignore_patterns("LOCK"))
        held = table.clone()
        _update_and_fold(s, table, 2)
    f = _chunk_file(backup, 3)
    f.write_bytes(_chunk_file(live, 3).read_bytes())  # (same name: folded in place)
    with EmbeddingStore.open(backup, readonly=True) as r:
        assert_bitwise_equal(r.get(torch.arange(CHUNK)), held[:CHUNK], "rows of the other files")
        with pytest.raises(CorruptStoreError, match=f"{f.name}.*later state"):
            r.get(torch.arange(3 * CHUNK, 4 * CHUNK))
    res = verify_store(backup)
    assert not res.ok and f.name in str(res.as_dict())
