"""A compaction round folds a dense raw chunk file that only the writer's version reads in place:
it writes the rows it folds, not the chunks they lie in (inplace.py). A crash in the middle is
redone by the next writable open; reads of this process never see a file mid-change; a file a
read-only handle's version reads is never changed."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from _durability import PowerCutOracle
from _store_helpers import assert_bitwise_equal

from lightning_embcache import EmbeddingStore, StoreError
from lightning_embcache.store import compaction, fileio, inplace
from lightning_embcache.store.errors import CorruptStoreError
from lightning_embcache.store.recycle import FilePool
from lightning_embcache.tools import verify_store


@pytest.fixture(autouse=True)
def _fold_in_place(monkeypatch):
    """Folding in place is off by default (compaction.FOLD_IN_PLACE): these tests are about it."""
    monkeypatch.setattr(compaction, "FOLD_IN_PLACE", True)


N, DIM, CHUNK = 8192, 32, 256  # 32 dense chunks of 32 KiB


def _filled(path, hot_bytes=None) -> tuple[EmbeddingStore, torch.Tensor]:
    """A store whose every row was written and folded: every chunk is a dense raw file."""
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot_bytes)
    table = torch.randn(N, DIM, generator=torch.Generator().manual_seed(0))
    s.update(torch.arange(N), table)
    s.flush()
    s.compact()
    return s, table


def _spread_update(s, table, rng, share=0.1) -> None:
    ids = torch.from_numpy(np.sort(rng.choice(N, int(N * share), replace=False)))
    vals = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
    s.update(ids, vals)
    table[ids] = vals


@pytest.mark.parametrize("in_place, bound", [(True, 2.0), (False, None)], ids=["in-place", "new-files"])
def test_a_pass_of_spread_updates_writes_about_the_rows_it_folds(tmp_path, monkeypatch, in_place, bound):
    """10% of the rows, spread over every chunk, flushed and folded five times: the rounds write
    at most 2x the bytes of the rows they fold (chunk files, chunk maps and manifests counted),
    where writing each touched chunk as a new file writes the whole table every pass (~10x)."""
    monkeypatch.setattr(compaction, "FOLD_IN_PLACE", in_place)
    rng = np.random.default_rng(1)
    s, table = _filled(tmp_path / "s")
    with s:
        st0 = s.stats()
        for _ in range(5):
            _spread_update(s, table, rng)
            s.flush()
            s.compact()
            assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after a pass")
        st = s.stats()
    written = st.compaction_bytes_written - st0.compaction_bytes_written
    folded = st.compaction_folded_bytes - st0.compaction_folded_bytes
    assert folded == 5 * int(N * 0.1) * s._core.row_bytes  # each pass folds the rows its flush wrote
    if bound is not None:
        assert st.chunks_folded_in_place - st0.chunks_folded_in_place == 5 * (N // CHUNK)
        assert written <= bound * folded, (written, folded)
    else:
        assert st.chunks_folded_in_place == 0 and written >= 5 * N * s._core.row_bytes
    with EmbeddingStore.open(tmp_path / "s", readonly=True) as again:
        assert_bitwise_equal(again.get(torch.arange(N)), table, "rows after reopening")
    assert verify_store(tmp_path / "s").ok


class _AtOverwrite:
    """Fault hook: `act` just before the ``k``-th batch of in-place writes (a chunk's records,
    then its header and checksums)."""

    def __init__(self, k: int) -> None:
        self.k, self.n = k, 0

    def before(self, op, name) -> None:
        if op == "overwrite":
            self.n += 1
            if self.n == self.k:
                self.act(name)

    def act(self, name) -> None:
        raise NotImplementedError

    def after(self, op, name) -> None:
        pass


class _DieAt(_AtOverwrite):
    """The process exits there (as if killed)."""

    def act(self, name) -> None:
        os._exit(9)


def _crash_in_a_fold(path, k: int) -> torch.Tensor:
    """In a forked child: fill, update 10% and flush (acknowledged), then die at the ``k``-th in-place
    write of the compaction that folds it. Returns the acknowledged rows."""
    rng = np.random.default_rng(2)
    s, table = _filled(path)
    _spread_update(s, table, rng)
    s.flush()
    s.close()
    pid = os.fork()
    if pid == 0:
        try:
            with EmbeddingStore.open(path) as w:
                fileio.FAULTS = _DieAt(k)
                w.compact()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9, "the child never reached that write"
    return table


@pytest.mark.parametrize("k", [2, 3, 40, 64])
def test_a_crash_in_the_middle_of_an_in_place_fold_is_redone_on_open(tmp_path, k):
    """Killed between two writes of a fold in place: blocks of a chunk file hold new rows under
    old checksums. A read-only open refuses by name until a writable open has redone the fold
    (from the intent left before the first write); then every row is the acknowledged one and
    `embcache verify` finds nothing wrong."""
    path = tmp_path / "s"
    table = _crash_in_a_fold(path, k)
    assert (path / inplace.INTENT).exists()
    with pytest.raises(StoreError, match="open the store for writing once"):
        EmbeddingStore.open(path, readonly=True)
    with EmbeddingStore.open(path) as s:
        assert not (path / inplace.INTENT).exists()
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after the redo")
        s.compact()  # the same segments folded again: the same rows
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after folding again")
    assert verify_store(path).ok


def test_without_the_redo_a_crashed_fold_leaves_blocks_that_fail(tmp_path, monkeypatch):
    """What the redo is for: the same crash, reopened without it, reads blocks whose checksums
    were not rewritten."""
    path = tmp_path / "s"
    table = _crash_in_a_fold(path, 40)
    monkeypatch.setattr(inplace, "redo", lambda disk, only=None: 0)
    with EmbeddingStore.open(path) as s:
        with pytest.raises(CorruptStoreError, match="fails its checksum"):
            s.get(torch.arange(N))
    del table


def test_a_version_a_reader_holds_keeps_its_files_as_they_are(tmp_path):
    """A read-only handle holds version v: the next pass writes new files for the chunks v reads
    (the reader reads its own rows throughout); the pass after it folds those new files, which
    only the writer reads, in place."""
    rng = np.random.default_rng(3)
    s, table = _filled(tmp_path / "s")
    with s:
        _spread_update(s, table, rng)
        v = s.flush()
        held = table.clone()
        with EmbeddingStore.open(tmp_path / "s", version=v, readonly=True) as reader:
            folded = []
            for _ in range(2):
                _spread_update(s, table, rng)
                s.flush()
                s.compact()
                assert_bitwise_equal(reader.get(torch.arange(N)), held, "the reader's rows")
                folded.append(s.stats().chunks_folded_in_place)
        assert folded == [0, N // CHUNK]
        assert_bitwise_equal(s.get(torch.arange(N)), table, "the writer's rows")


def test_a_pinned_version_that_shares_the_files_keeps_its_rows(tmp_path):
    """A pinned version sharing the writer's chunk files lists every segment a round folds into
    them: folds in place leave its rows as they were."""
    rng = np.random.default_rng(4)
    s, table = _filled(tmp_path / "s")
    with s:
        _spread_update(s, table, rng)
        v = s.flush()
        s.pin(v)
        pinned = table.clone()
        for _ in range(3):
            _spread_update(s, table, rng)
            s.flush()
            s.compact()
        assert s.stats().chunks_folded_in_place > 0
    with EmbeddingStore.open(tmp_path / "s", version=v, readonly=True) as old:
        assert_bitwise_equal(old.get(torch.arange(N)), pinned, "the pinned version's rows")
    with EmbeddingStore.open(tmp_path / "s", readonly=True) as new:
        assert_bitwise_equal(new.get(torch.arange(N)), table, "the newest rows")
    assert verify_store(tmp_path / "s").ok


def test_folding_waits_for_reads_and_holds_new_ones_off(tmp_path):
    """`FilePool.folding`: waits for a read running on another thread, lets no new read begin
    while it runs (a nested read of a thread already reading goes on), and marks the time in
    `inplace_seq` for reads done by the kernel."""
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        pool = FilePool(fd)
        seq0 = pool.inplace_seq
        events = []
        reading, release = threading.Event(), threading.Event()

        def reader() -> None:
            e = pool.begin_read()
            inner = pool.begin_read()  # nested: never waits
            reading.set()
            release.wait(5)
            events.append("read ends")
            pool.end_read(inner)
            pool.end_read(e)

        def later_reader() -> None:
            e = pool.begin_read()
            events.append("later read begins")
            pool.end_read(e)

        t = threading.Thread(target=reader)
        t.start()
        reading.wait(5)
        late = None
        with_fold = threading.Event()

        def fold() -> None:
            nonlocal late
            with pool.folding():
                events.append("fold")
                assert pool.moved_since(seq0)
                late = threading.Thread(target=later_reader)
                late.start()
                late.join(0.2)
                events.append("fold ends")
            with_fold.set()

        f = threading.Thread(target=fold)
        f.start()
        f.join(0.2)
        assert events == []  # the fold waits for the read
        release.set()
        t.join(5)
        with_fold.wait(5)
        late.join(5)
        assert events == ["read ends", "fold", "fold ends", "later read begins"]
        assert pool.moved_since(seq0) and not pool.moved_since(pool.inplace_seq)
    finally:
        os.close(fd)


def test_a_read_never_sees_a_file_mid_fold(tmp_path):
    """A get of rows of chunk 0 begun between the writes of its records and of its checksums
    (from the fault hook, on another thread) waits for the fold and then reads the right rows;
    without the wait it would verify new records against old checksums."""
    rng = np.random.default_rng(5)
    s, table = _filled(tmp_path / "s")
    s.close()  # reopened: the chunk files are not this handle's own, their blocks are verified on read
    got: list = []

    def read_chunk_0() -> None:
        try:
            got.append(s.get(torch.arange(CHUNK)))
        except BaseException as exc:  # reported below
            got.append(exc)

    class _ReadMidFold:
        n = 0
        reader: threading.Thread | None = None

        def before(self, op, name) -> None:
            if op == "overwrite":
                self.n += 1
                if self.n == 2:  # chunk 0's records are written, its checksums not yet
                    self.reader = threading.Thread(target=read_chunk_0)
                    self.reader.start()
                    self.reader.join(0.5)
                    self.during = list(got)

        def after(self, op, name) -> None:
            pass

    with EmbeddingStore.open(tmp_path / "s", hot_bytes=64 * (DIM * 4 + 16)) as s:
        _spread_update(s, table, rng)
        s.flush()
        hook = fileio.FAULTS = _ReadMidFold()
        try:
            s.compact()
        finally:
            fileio.FAULTS = None
        hook.reader.join(10)
        assert hook.during == [], "the read ran while the file was changing"
        assert len(got) == 1 and isinstance(got[0], torch.Tensor), got
        assert_bitwise_equal(got[0], table[:CHUNK], "rows read across the fold")


def test_an_intent_naming_segments_no_version_lists_is_refused(tmp_path):
    """A crafted `FOLDING` (valid checksums) naming a segment no version lists would fold rows no
    version has into a base file: the writable open refuses it by name and changes nothing."""
    path = tmp_path / "s"
    s, table = _filled(path)
    files = sorted(p.name for p in (path / "chunks").iterdir())
    before = {f: (path / "chunks" / f).read_bytes() for f in files}
    inplace.write_intent(s._versions.disk, 10**6, [(0, int(s._versions.cmap[0]), 0)], [999_999])
    s.close()
    with pytest.raises(CorruptStoreError, match="FOLDING.*no version on disk lists"):
        EmbeddingStore.open(path)
    assert {f: (path / "chunks" / f).read_bytes() for f in files} == before
    del table


class _FailAt(_AtOverwrite):
    """The ``k``-th batch of in-place writes fails with EIO."""

    def act(self, name) -> None:
        raise OSError(5, "Input/output error", str(name))


def test_a_write_that_fails_half_way_through_a_fold_is_redone_at_once(tmp_path):
    """EIO on the header write of a chunk whose records were written: the round raises a named
    error, the fold is redone on the spot (the handle keeps serving every row, no block fails its
    checksum), and a reopen gives the acknowledged rows."""
    rng = np.random.default_rng(8)
    path = tmp_path / "s"
    s, table = _filled(path)
    s.close()  # reopened: the chunk files are not this handle's own, their blocks are verified on read
    with EmbeddingStore.open(path, hot_bytes=64 * (DIM * 4 + 16)) as s:
        _spread_update(s, table, rng)
        s.flush()
        fileio.FAULTS = _FailAt(2)
        try:
            with pytest.raises(StoreError):
                s.compact()
        finally:
            fileio.FAULTS = None
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after the failed round")
        s.compact()
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after folding again")
    with EmbeddingStore.open(path, readonly=True) as again:
        assert_bitwise_equal(again.get(torch.arange(N)), table, "rows after reopening")
    assert verify_store(path).ok


def test_a_background_round_lets_a_waiting_flush_in_between_two_chunks(tmp_path, monkeypatch):
    """A flush that asks for the writer lock while a background round folds in place goes in at
    the next chunk boundary, not after the round; the round then holds the new version's reader
    lock and folds the rest in place. Every row is right after both, and the flush's manifest
    names only durable files (the power-cut oracle)."""
    monkeypatch.setattr(compaction, "YIELD_AFTER_S", 0.0)  # at the first chunk boundary it sees
    rng = np.random.default_rng(9)
    s, table = _filled(tmp_path / "s")
    s.close()
    with EmbeddingStore.open(tmp_path / "s") as s:
        _spread_update(s, table, rng)
        s.flush()
        flushed: list = []
        state = {"n": 0, "flush_done_at": None}

        def flush_now() -> None:
            _spread_update(s, table, rng, share=0.01)
            flushed.append(s.flush())

        class _FlushMidRound(PowerCutOracle):
            def before(self, op, name) -> None:
                super().before(op, name)
                if op == "overwrite":
                    state["n"] += 1
                    if state["n"] == 3:
                        t = threading.Thread(target=flush_now)
                        t.start()
                        state["thread"] = t
                        deadline = time.monotonic() + 10
                        while not s._versions._flush_waiting and time.monotonic() < deadline:
                            time.sleep(0.001)
                    elif flushed and state["flush_done_at"] is None:
                        state["flush_done_at"] = state["n"]

        oracle = _FlushMidRound(tmp_path / "s")
        oracle.patch(monkeypatch)
        fileio.FAULTS = oracle
        try:
            with s._versions.flush_lock:  # as the background pass calls it: the writer lock held once
                s._versions.compaction.compact_round(everything=True, unlocked=True)
        finally:
            fileio.FAULTS = None
        state["thread"].join(10)
        assert flushed and state["flush_done_at"] is not None and state["flush_done_at"] < 2 * (N // CHUNK)
        assert s.stats().chunks_folded_in_place == N // CHUNK
        assert oracle.commits >= 2 and oracle.violations == [], oracle.violations[:3]
        assert_bitwise_equal(s.get(torch.arange(N)), table, "rows after the round")
    with EmbeddingStore.open(tmp_path / "s", readonly=True) as again:
        assert again.version == flushed[0]
        assert_bitwise_equal(again.get(torch.arange(N)), table, "rows after reopening")
    assert verify_store(tmp_path / "s").ok
