"""Compaction never writes a row nobody wrote: a chunk whose rows are mostly never written is
folded into a *sparse* chunk file holding just the rows written (the others keep their initial
values, computed per row), and every reader of chunk files serves both kinds.

The reference is a plain tensor: the table's initial values (from a store that was never
written to) with every update applied. Chunk files are parsed here from the documented format
(docs/store-format.md), independently of the store's reader.
"""

from __future__ import annotations

import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from _store_helpers import InlineExecutor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import CorruptStoreError, EmbeddingStore
from lightning_embcache.store import fileio
from lightning_embcache.tools import inspect_store, verify_store

HEADER = 52  # every store file's header (docs/store-format.md)
SPARSE_HEAD = struct.Struct("<QQQQ")  # chunk, rows, rows held, bytes of their records


@pytest.fixture
def inline_background(monkeypatch):
    """Background compaction and write-back run inline, so a hypothesis example replays exactly."""
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_embcache.store") and hasattr(module, "ThreadPoolExecutor"):
            monkeypatch.setattr(module, "ThreadPoolExecutor", InlineExecutor)


def ramp(ids: torch.Tensor) -> torch.Tensor:
    """A callable init: a deterministic function of the ids."""
    return ids.to(torch.float32)[:, None] * 0.5 + torch.arange(4, dtype=torch.float32) * 0.25


def initial_rows(n: int, dim: int, init, seed: int) -> torch.Tensor:
    """The table as created: read from a store without a path, which never writes a chunk file."""
    with EmbeddingStore.create(None, n, dim, init=init, seed=seed) as s:
        return s.get(torch.arange(n)).clone()


def chunk_files(path: Path) -> dict[int, Path]:
    """The base chunk file of each chunk in the newest chunk map (``chunkmap-<gen>``: int32 per chunk)."""
    maps = sorted(path.glob("chunkmap-*"))
    if not maps:
        return {}
    data = maps[-1].read_bytes()[HEADER:]
    files = sorted(path.glob("chunks/c*-g*"))
    nc = len(data) // 12 if len(data) % 12 == 0 and len(data) // 12 else len(data) // 4
    gens = np.frombuffer(data, np.int32, nc)
    out = {}
    for c, g in enumerate(gens.tolist()):
        if g:
            out[c] = path / "chunks" / f"c{c:08d}-g{g:08d}"
            assert out[c] in files, f"chunk map names {out[c].name}, not on disk"
    return out


def held_rows(file: Path) -> np.ndarray | None:
    """Chunk-relative rows a sparse chunk file holds (from its bitmap); None for a dense file."""
    data = file.read_bytes()
    if data[8:16].rstrip(b"\0") != b"sparse":
        return None
    directory = struct.unpack_from("<Q", data, 36)[0]  # the header's payload length
    _, rows, count, length = SPARSE_HEAD.unpack_from(data, HEADER)
    bitmap = np.frombuffer(data, np.uint8, -(-rows // 64) * 8, HEADER + SPARSE_HEAD.size)
    held = np.flatnonzero(np.unpackbits(bitmap, bitorder="little"))
    assert len(held) == count and len(data) == HEADER + directory + length, f"{file.name} is not a sparse chunk"
    return held


def assert_only_written_rows_stored(path: Path, written: set[int], chunk_rows: int) -> None:
    """Every sparse file holds rows that were written, and only those."""
    for c, f in chunk_files(path).items():
        held = held_rows(f)
        if held is not None:
            extra = set((held + c * chunk_rows).tolist()) - written
            assert not extra, f"{f.name} stores rows nobody wrote: {sorted(extra)[:8]}"


# ------------------------------------------------------------------ sequences against a model
N, DIM, CHUNK = 600, 4, 64  # 10 chunks, the last one short (24 rows)
MODES = {"disk": dict(hot_bytes=40 * (DIM * 4 + 11)),
         "warm": dict(hot_bytes=40 * (DIM * 4 + 11), warm_bytes=2 * CHUNK * DIM * 4),
         "memory": dict(hot_bytes=None)}

ids_list = st.lists(st.integers(0, N - 1), min_size=1, max_size=40)
OPS = st.one_of(
    st.tuples(st.just("update"), ids_list),
    st.tuples(st.just("update_range"), st.integers(0, N - 1), st.integers(1, 3 * CHUNK // 2)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("compact")),
    st.tuples(st.just("reopen")),
    st.tuples(st.just("get"), ids_list),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(init=st.sampled_from(["zeros", "normal", "callable"]), mode=st.sampled_from(sorted(MODES)),
       compression=st.sampled_from([None, "lz4"]), ops=st.lists(OPS, min_size=1, max_size=14),
       seed=st.integers(0, 3))
def test_random_sequences_on_a_fresh_store_read_like_a_tensor(inline_background, init, mode, compression, ops, seed):
    init = ramp if init == "callable" else init
    again = {"init": ramp} if init is ramp else {}  # a callable init is passed again on open
    root = Path(tempfile.mkdtemp(prefix="embcache-sparse-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        path = root / "store"
        model = initial_rows(N, DIM, init, seed)
        durable = model.clone()
        written: set[int] = set()
        gen = torch.Generator().manual_seed(seed)
        s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, init=init, seed=seed, compression=compression,
                                  **MODES[mode])
        try:
            for op in ops:
                if op[0] in ("update", "update_range"):
                    ids = torch.tensor(op[1]) if op[0] == "update" else torch.arange(op[1], min(N, op[1] + op[2]))
                    vals = torch.randn(len(ids), DIM, generator=gen)
                    s.update(ids, vals)
                    model[ids] = vals  # of duplicate ids the last wins, in both
                    written.update(ids.tolist())
                elif op[0] == "flush":
                    s.flush()
                    durable = model.clone()
                elif op[0] == "compact":
                    s.compact()
                    s.flush()  # publishes the compacted layout (also with no new rows)
                    durable = model.clone()
                    assert_only_written_rows_stored(path, written, CHUNK)
                elif op[0] == "reopen":
                    s.close()
                    s = EmbeddingStore.open(path, **MODES[mode], **again)
                    model = durable.clone()
                else:
                    ids = torch.tensor(op[1])
                    assert torch.equal(s.get(ids), model[ids])
            assert torch.equal(s.get(torch.arange(N)), model)
            s.flush()
            s.compact()
            s.flush()
            assert_only_written_rows_stored(path, written, CHUNK)
            assert torch.equal(s.get(torch.arange(N)), model)
        finally:
            s.close()
        for how in MODES.values():  # a fresh handle reads every kind of chunk file from disk
            with EmbeddingStore.open(path, readonly=True, **how, **again) as r:
                got = torch.cat([r.get(torch.arange(a, min(N, a + 37))) for a in range(0, N, 37)])
                assert torch.equal(got, model)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ which kind of file
def test_compaction_writes_sparse_files_for_few_rows_and_dense_for_most(shm_path):
    n, cr, dim = 1024, 128, 8
    path = shm_path / "store"
    model = initial_rows(n, dim, "normal", 5)
    rng = np.random.default_rng(0)
    per_chunk = {0: 10, 1: 100, 2: 64, 3: 63, 5: 1}  # 64 of 128 is half: dense from there
    with EmbeddingStore.create(path, n, dim, chunk_rows=cr, init="normal", seed=5, hot_bytes=64 * (dim * 4 + 11)) as s:
        for c, k in per_chunk.items():
            ids = torch.from_numpy(np.sort(rng.choice(cr, k, replace=False)) + c * cr)
            vals = torch.randn(k, dim)
            s.update(ids, vals)
            model[ids] = vals
        s.flush()
        before = s.stats().bytes_written
        s.compact()
        s.flush()
        files = chunk_files(path)
        assert sorted(files) == sorted(per_chunk), "compaction wrote chunks no segment touched"
        kinds = {c: held_rows(f) is not None for c, f in files.items()}
        assert kinds == {0: True, 1: False, 2: False, 3: True, 5: True}
        held = {c: len(held_rows(f)) for c, f in files.items() if kinds[c]}
        assert held == {0: 10, 3: 63, 5: 1}
        # the sparse files cost about their rows: 74 rows of 32 B, not three chunks of 4 KiB
        sparse_bytes = sum(files[c].stat().st_size for c in held)
        assert sparse_bytes < 74 * 32 + 3 * (HEADER + 32 + 16 + 8) + 64
        assert s.stats().bytes_written - before < 2 * cr * dim * 4 + sparse_bytes + 4096
        assert torch.equal(s.get(torch.arange(n)), model)

        # one row more makes chunk 3 half written: dense; chunk 5 stays sparse with one more
        held3 = held_rows(files[3]).tolist()
        new3 = next(r for r in range(cr) if r not in held3) + 3 * cr
        ids = torch.tensor([new3, 5 * cr + 17 if held_rows(files[5])[0] != 17 else 5 * cr + 18])
        vals = torch.randn(2, dim)
        s.update(ids, vals)
        model[ids] = vals
        s.flush()
        s.compact()
        s.flush()
        files = chunk_files(path)
        assert held_rows(files[3]) is None
        assert len(held_rows(files[5])) == 2
        assert torch.equal(s.get(torch.arange(n)), model)
    for hot in (None, 64 * (dim * 4 + 11)):
        with EmbeddingStore.open(path, hot_bytes=hot, warm_bytes=2 * cr * dim * 4) as s:
            assert torch.equal(s.get(torch.arange(n)), model)


def test_first_epoch_compaction_writes_about_the_rows_written(shm_path):
    """Every row written once, spread over every chunk, a quarter of each: compaction writes
    sparse files of about those rows, not the table (the initial values stay computed)."""
    n, cr, dim = 16384, 256, 16
    rb = dim * 4
    path = shm_path / "store"
    ids = torch.from_numpy(np.random.default_rng(1).permutation(n)[: n // 4])
    with EmbeddingStore.create(path, n, dim, chunk_rows=cr, init="normal", hot_bytes=512 * (rb + 11)) as s:
        s.update(ids, torch.zeros(len(ids), dim))
        s.flush()
        before = s.stats().bytes_written
        s.compact()
        s.flush()
        folded = s.stats().bytes_written - before
        assert folded < 1.2 * len(ids) * rb, f"compaction wrote {folded} B for {len(ids) * rb} B of rows"
        model = initial_rows(n, dim, "normal", 0)
        model[ids] = 0.0
        assert torch.equal(s.get(torch.arange(n)), model)
    assert all(held_rows(f) is not None for f in chunk_files(path).values())


# ------------------------------------------------------------------ damage
def _sparse_store(path: Path) -> tuple[torch.Tensor, Path]:
    n, cr, dim = 400, 100, 8  # chunk 0 sparse, holding 30 rows: 960 B of records, one 4 KiB block
    model = initial_rows(n, dim, "normal", 1)
    with EmbeddingStore.create(path, n, dim, chunk_rows=cr, init="normal", seed=1) as s:
        ids = torch.arange(0, 90, 3)
        vals = torch.randn(len(ids), dim)
        s.update(ids, vals)
        model[ids] = vals
        s.flush()
        s.compact()
        s.flush()
    f = chunk_files(path)[0]
    assert held_rows(f) is not None
    return model, f


def _directory(f: Path) -> tuple[int, int]:
    length, _ = fileio.parse_header(f, f.read_bytes()[:HEADER], b"sparse")
    return HEADER, HEADER + length


def _flip(f: Path, at: int) -> None:
    data = bytearray(f.read_bytes())
    data[at] ^= 0x21
    f.write_bytes(bytes(data))


def _recraft(f: Path, edit) -> None:
    """Rewrite the directory with ``edit`` applied and its checksums made valid again."""
    data = f.read_bytes()
    lo, hi = _directory(f)
    directory = bytearray(data[lo:hi])
    edit(directory)
    uid = fileio.header_uuid(data)
    head, _ = fileio.pack(b"sparse", bytes(directory), uid, f.name)
    f.write_bytes(bytes(head) + bytes(directory) + data[hi:])


def _damage(f: Path, how: str, other: Path) -> None:
    lo, hi = _directory(f)
    size = f.stat().st_size
    if how == "flip-header":
        _flip(f, 20)
    elif how == "flip-bitmap":
        _flip(f, lo + SPARSE_HEAD.size + 1)
    elif how == "flip-records":
        _flip(f, size - 5)
    elif how == "truncate-directory":
        with open(f, "r+b") as fh:
            fh.truncate(lo + 10)
    elif how == "truncate-records":
        with open(f, "r+b") as fh:
            fh.truncate(size - 3)
    elif how == "crafted-count":
        _recraft(f, lambda d: struct.pack_into("<Q", d, 16, struct.unpack_from("<Q", d, 16)[0] - 1))
    elif how == "crafted-bitmap":  # one row more in the bitmap than the records hold
        def set_bit(d):
            bm = SPARSE_HEAD.size
            d[bm + 12] |= 0x01  # row 96: never written (rows 0, 3, ..., 87 are)
        _recraft(f, set_bit)
    elif how == "crafted-past-end":  # a bit beyond the chunk's 100 rows
        def past(d):
            d[SPARSE_HEAD.size + 13] |= 0x80  # row 111
        _recraft(f, past)
    elif how == "foreign":
        f.write_bytes(other.read_bytes())  # a valid sparse file of another store, same name


DAMAGE = ["flip-header", "flip-bitmap", "flip-records", "truncate-directory", "truncate-records",
          "crafted-count", "crafted-bitmap", "crafted-past-end", "foreign"]


@pytest.mark.parametrize("mode", ["disk", "memory"])
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_sparse_chunk_is_a_named_corruption(shm_path, how, mode):
    model, f = _sparse_store(shm_path / "store")
    _, other = _sparse_store(shm_path / "other")
    _damage(f, how, other)
    with pytest.raises(CorruptStoreError) as info:
        with EmbeddingStore.open(shm_path / "store", hot_bytes=None if mode == "memory" else 50 * 43) as s:
            s.get(torch.arange(len(model)))
    assert Path(info.value.path) == f, f"error names {info.value.path}, the damaged file is {f}"
    assert str(f) in str(info.value)


def test_an_undamaged_sparse_store_reads_back_and_verifies(shm_path):
    """The damage tests would pass vacuously if the store could not be read at all."""
    model, f = _sparse_store(shm_path / "store")
    for hot in (None, 50 * 43):
        with EmbeddingStore.open(shm_path / "store", hot_bytes=hot) as s:
            assert torch.equal(s.get(torch.arange(len(model))), model)
    report = verify_store(shm_path / "store")
    assert report.ok, report.problems
    summary = inspect_store(shm_path / "store")
    assert summary["disk"]["chunks"]["files"] == 1 and summary["disk"]["chunks"]["sparse_files"] == 1
    # a sparse file holds 30 rows of 32 B: its records are nearly all its bytes
    assert 0.5 < summary["compression_ratio"] <= 1.0


def test_verify_names_a_damaged_sparse_chunk(shm_path):
    _, f = _sparse_store(shm_path / "store")
    _flip(f, f.stat().st_size - 5)  # a record's byte: only its block checksum can tell
    report = verify_store(shm_path / "store")
    assert not report.ok
    assert any(f.name in d for v in report.versions for d in v.damaged), report.as_dict()


# ------------------------------------------------------------------ one reader, several generations
def test_a_chunk_reader_reads_each_generation_asked_of_sparse_files(shm_path):
    """Two sparse generations of a chunk holding different rows (a read-only handle keeps the old
    one): a reader shared by two threads reads rows of the one each asks for, also when another
    thread opened the other one in between, and when the open-file bound closes its files."""
    from lightning_embcache.store.chunkrows import ChunkRows

    n, cr, dim = 1024, 64, 8
    path = shm_path / "store"
    model = initial_rows(n, dim, "normal", 2)
    with EmbeddingStore.create(path, n, dim, chunk_rows=cr, init="normal", seed=2) as s:
        first = torch.arange(0, n, 7)  # every chunk: 9-10 of 64 rows
        s.update(first, torch.ones(len(first), dim))
        model[first] = 1.0
        s.flush()
        s.compact()
        s.flush()
        old = {c: int(s._versions.cmap[c]) for c in range(n // cr)}
        old_model = model.clone()
        second = torch.arange(3, n, 11)
        s.update(second, torch.full((len(second), dim), 2.0))
        model[second] = 2.0
        s.flush()
        with EmbeddingStore.open(path, readonly=True):  # keeps the old generation's files
            s.compact()
            s.flush()
            new = {c: int(s._versions.cmap[c]) for c in range(n // cr)}
            assert all(new[c] > old[c] for c in new)
            assert all(held_rows(f) is not None for f in chunk_files(path).values())
            reader = ChunkRows(s._versions.disk)
            reader.max_files = 2  # closes and reopens files between reads (their bitmaps are kept)
            ids = np.arange(n)
            chunks, local = ids // cr, ids % cr
            for gens, want in ((new, model), (old, old_model), (new, model)):
                g = np.array([gens[c] for c in chunks.tolist()], np.int64)
                for part in np.array_split(np.arange(n), 5):
                    got = reader.read(chunks[part], local[part], g[part])
                    assert np.array_equal(got, want[torch.from_numpy(part)].numpy().view(np.uint8).reshape(len(part), -1))
            # another thread opens the old generation between this one's open and its read
            ensure = reader._ensure_open

            def interleaved(ch, gs):
                ensure(ch, gs)
                reader._open(0, old[0])
            reader._ensure_open = interleaved
            got = reader.read(np.zeros(cr, np.int64), np.arange(cr), np.full(cr, new[0], np.int64))
            assert np.array_equal(got, model[:cr].numpy().view(np.uint8).reshape(cr, -1))
            reader.close()


def test_a_sparse_chunk_holding_more_than_65535_rows(shm_path):
    """A row's rank in its sparse file no longer fits 16 bits: the reader keeps 32."""
    n, cr, dim = 200_000, 150_000, 1  # chunks of 150,000 and 50,000 rows
    path = shm_path / "store"
    model = initial_rows(n, dim, "normal", 3)
    ids = torch.arange(0, 140_000, 2)  # 70,000 rows of chunk 0: under half, sparse
    ids = torch.cat([ids, torch.tensor([150_000, 199_999])])
    vals = torch.randn(len(ids), dim)
    with EmbeddingStore.create(path, n, dim, chunk_rows=cr, init="normal", seed=3) as s:
        s.update(ids, vals)
        model[ids] = vals
        s.flush()
        s.compact()
        s.flush()
    assert [len(held_rows(f)) for f in chunk_files(path).values()] == [70_000, 2]
    with EmbeddingStore.open(path, hot_bytes=4096 * (dim * 4 + 11)) as s:
        for lo in (0, 131_000, 139_990, 149_990, 150_000, 199_990):
            probe = torch.arange(lo, min(n, lo + 2_000))
            assert torch.equal(s.get(probe), model[probe]), lo
