"""prefetch(ids) brings rows into the hot tier in the background and never changes a value."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore

N, DIM, CHUNK = 4096, 16, 256
ROW_BYTES = DIM * 4
HOT = 600 * (ROW_BYTES + 11)


def _table(seed: int) -> torch.Tensor:
    return torch.randn(N, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def store(shm_path):
    path = shm_path / "store"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK) as s:
        s.update(torch.arange(N), _table(0))
        s.flush()
    with EmbeddingStore.open(path, hot_bytes=HOT, warm_bytes=4 * CHUNK * ROW_BYTES) as s:
        yield s


def _wait_prefetched(store, before: int, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while store.stats().prefetched_rows < before + n:
        assert time.monotonic() < deadline, f"prefetch of {n} rows did not finish: {store.stats()}"
        time.sleep(0.01)


def test_prefetched_rows_are_hot_hits(store):
    ids = torch.from_numpy(np.random.default_rng(0).choice(N, 200, replace=False))
    before = store.stats()
    t0 = time.perf_counter()
    store.prefetch(ids)
    assert time.perf_counter() - t0 < 0.5, "prefetch() blocked its caller"
    _wait_prefetched(store, before.prefetched_rows, len(ids))
    mid = store.stats()
    got = store.get(ids)
    after = store.stats()
    assert torch.equal(got, _table(0)[ids])
    assert after.hot_hits - mid.hot_hits == len(ids), f"{after.hot_hits - mid.hot_hits} of {len(ids)} were hot hits"
    assert after.hot_misses == mid.hot_misses and after.cold_reads == mid.cold_reads


def test_get_without_prefetch_misses(store):
    """The counterpart: the same read cold counts misses (so the hit test above can fail)."""
    ids = torch.from_numpy(np.random.default_rng(0).choice(N, 200, replace=False))
    before = store.stats()
    assert torch.equal(store.get(ids), _table(0)[ids])
    assert store.stats().hot_misses - before.hot_misses == len(ids)


def test_prefetch_never_changes_values(store):
    rng = np.random.default_rng(1)
    model = _table(0).clone()
    dirty = torch.from_numpy(rng.choice(N, 300, replace=False))
    model[dirty] = _table(1)[dirty]
    store.update(dirty, _table(1)[dirty])  # dirty rows, some evicted (written back) by prefetches
    for _ in range(20):
        store.prefetch(torch.from_numpy(rng.integers(0, N, 400)))
        ids = torch.from_numpy(rng.integers(0, N, 100))
        assert torch.equal(store.get(ids), model[ids])
        vals = torch.randn(len(ids), DIM)
        store.update(ids, vals)
        for i, row in enumerate(ids.tolist()):
            model[row] = vals[i]
    time.sleep(0.1)
    assert torch.equal(store.get(torch.arange(N)), model)
    v = store.flush()
    with EmbeddingStore.open(store.path, version=v, readonly=True) as r:
        assert torch.equal(r.get(torch.arange(N)), model)


def test_prefetch_in_memory_mode_is_harmless(shm_path):
    with EmbeddingStore.create(None, 100, DIM) as s:
        s.update([3], torch.ones(1, DIM))
        s.prefetch(torch.arange(100))
        assert torch.equal(s.get([3, 4]), torch.tensor([[1.0] * DIM, [0.0] * DIM]))


class _BlockPrefetchReads:
    """Make disk reads on the prefetch thread wait until released (the training thread's own
    reads are not held): a prefetch stuck in slow I/O, on demand."""

    def __init__(self, monkeypatch):
        import threading

        from lightning_embcache.store.chunkrows import ChunkRows
        from lightning_embcache.store.disk import Disk, Segment

        self.entered = threading.Event()
        self.release = threading.Event()
        for cls, name in ((Disk, "read_chunk"), (Disk, "read_chunk_rows"), (ChunkRows, "read"), (Segment, "_read")):
            original = getattr(cls, name)

            def held(obj, *args, _original=original):
                if threading.current_thread().name.startswith("embcache-prefetch"):
                    self.entered.set()
                    assert self.release.wait(30), "test never released the prefetch"
                return _original(obj, *args)

            monkeypatch.setattr(cls, name, held)


def test_get_never_waits_for_a_prefetch_read(store, monkeypatch):
    """The prefetch thread reads without the store lock: while its disk read hangs, the training
    thread's get (here of rows that need reads of their own) and update return."""
    import threading

    block = _BlockPrefetchReads(monkeypatch)
    table = _table(0)
    store.prefetch(torch.arange(0, 64))
    assert block.entered.wait(10), "the prefetch never started its read"
    done = threading.Event()
    result = {}

    def train_step():
        ids = torch.arange(2048, 2112)
        result["rows"] = store.get(ids)
        store.update(ids, result["rows"] + 1)
        done.set()

    threading.Thread(target=train_step, daemon=True).start()
    finished = done.wait(5)
    block.release.set()
    assert finished, "get/update waited for the prefetch's disk read"
    assert torch.equal(result["rows"], table[2048:2112])
    before = store.stats().prefetched_rows
    _wait_prefetched(store, before - 64, 64)
    assert torch.equal(store.get(torch.arange(0, 64)), table[:64])


def test_a_prefetch_overtaken_by_a_write_back_installs_nothing_stale(store, monkeypatch):
    """Rows written, written back and evicted while a prefetch was reading their old values must
    keep the new values: the prefetch sees that rows below the hot tier changed and drops."""
    block = _BlockPrefetchReads(monkeypatch)
    ids = torch.arange(0, 64)
    store.prefetch(ids)
    assert block.entered.wait(10)
    new = torch.full((64, DIM), 7.0)
    store.update(ids, new)  # loads the old rows (a read on this thread), writes new ones
    store.flush()  # the new values go below the hot tier...
    store.evict(1 << 30)  # ...and leave it: the next get reads them from below
    block.release.set()
    time.sleep(0.5)  # let the prefetch finish (or drop) its install
    assert torch.equal(store.get(ids), new), "a prefetch installed rows older than the last write"
    assert store.stats().prefetched_rows == 0


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_prefetch_of_a_few_rows_keeps_every_row_of_their_chunks_right(shm_path, compression):
    """A prefetch asks only the delta segments that hold its rows; a chunk it reads whole (an LZ4
    base) goes to the warm tier with every segment applied, so the chunk's other rows are right."""
    path = shm_path / "store"
    # values LZ4 can compress, so that compression="lz4" really writes LZ4 base chunks
    table = torch.randint(0, 4, (N, DIM), generator=torch.Generator().manual_seed(3)).float()
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, compression=compression) as s:
        s.update(torch.arange(N), table)
        s.flush()
        s.compact()
        s.flush()
        for k in range(3):  # deltas over the base: each holds other rows of the same chunks
            ids = torch.arange(k, N, 7)
            table[ids] = float(k + 5)
            s.update(ids, table[ids])
            s.flush()
    with EmbeddingStore.open(path, hot_bytes=HOT, warm_bytes=4 * CHUNK * ROW_BYTES) as s:
        few = torch.tensor([1, 2, CHUNK + 3, 5 * CHUNK + 9])
        s.prefetch(few)
        _wait_prefetched(s, 0, len(few))
        assert torch.equal(s.get(few), table[few])
        assert torch.equal(s.get(torch.arange(N)), table)


def test_a_whole_chunk_read_during_a_write_back_never_serves_stale_rows(shm_path):
    """A background write-back (`_clean`) marks dirty rows clean, writes them to a segment and
    indexes it; a prefetch that read a whole chunk holding them meanwhile must not keep its copy
    in the warm tier. It did when the write began before the prefetch planned: the row, later
    dropped from the hot tier as clean, came back from the warm copy with its old value."""
    path = shm_path / "store"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK) as s:
        s.update(torch.arange(N), _table(0))
        s.flush()
    with EmbeddingStore.open(path, hot_bytes=HOT, warm_bytes=4 * CHUNK * ROW_BYTES) as s:
        chunk = 3
        mine = torch.arange(chunk * CHUNK, chunk * CHUNK + 100)  # dirty, hot: the write-back's rows
        s.update(mine, _table(1)[mine])
        begun, read_done = threading.Event(), threading.Event()
        disk_write = s._versions.disk.write_segment

        def slow_write(*args, **kwargs):  # the write-back's segment, held until the prefetch read
            begun.set()
            assert read_done.wait(10)
            return disk_write(*args, **kwargs)

        s._versions.disk.write_segment = slow_write
        cleaner = threading.Thread(target=s._tiers.writeback.clean)
        cleaner.start()
        assert begun.wait(10)
        s._versions.disk.write_segment = disk_write
        real_read = s._tiers.read_below

        def read_then_let_the_write_back_finish(plan, **kw):
            out = real_read(plan, **kw)  # the whole chunk, with the rows' values before the write-back
            read_done.set()
            cleaner.join(10)  # segment written and indexed before the prefetch installs
            return out

        s._tiers.read_below = read_then_let_the_write_back_finish
        rest = torch.arange(chunk * CHUNK + 100, (chunk + 1) * CHUNK)  # not hot: read whole
        s.prefetch(rest)
        _wait_prefetched_or_dropped(s)
        s._tiers.read_below = real_read
        assert not cleaner.is_alive()
        s.set_budget(hot_bytes=ROW_BYTES + 11)  # the rows leave the hot tier (clean: nothing written)
        assert read_done.is_set()  # the prefetch read the chunk while the write-back ran
        s.set_budget(hot_bytes=HOT)
        assert torch.equal(s.get(mine), _table(1)[mine])


def _wait_prefetched_or_dropped(store, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while store._tiers.prefetch.fetching is not None or store._tiers.prefetch.executor is None:
        assert time.monotonic() < deadline, "the prefetch did not finish"
        time.sleep(0.01)
    store._tiers.prefetch.executor.submit(lambda: None).result(timeout)  # the prefetch job has returned
