"""A writable store refuses use in a forked child; a readonly handle works there (DataLoader workers)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_embcache import EmbeddingStore, ForkedWriterError

N, DIM = 96, 4


def _table() -> torch.Tensor:
    return torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM) / 8


@pytest.fixture
def store_path(shm_path):
    path = shm_path / "store"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=16) as s:
        s.update(torch.arange(N), _table())
        s.flush()
    return path


def _in_child(fn) -> int:
    """Run fn in a forked child; its exit code: 0 = fn returned True, 1 = False, 2 = it raised."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            code = 0 if fn() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("call", ["get", "update", "flush", "prefetch", "evict", "stats"])
def test_writable_store_refuses_use_in_forked_child(store_path, call):
    with EmbeddingStore.open(store_path, hot_bytes=8 * (DIM * 4 + 11)) as s:
        s.get([1, 2])
        calls = {
            "get": lambda: s.get([1]),
            "update": lambda: s.update([1], torch.zeros(1, DIM)),
            "flush": s.flush,
            "prefetch": lambda: s.prefetch([1]),
            "evict": lambda: s.evict(100),
            "stats": s.stats,  # its rows and counters are not mapped in the child: refused, not a crash
        }

        def child() -> bool:
            try:
                calls[call]()
            except ForkedWriterError as e:
                return "readonly=True" in str(e)
            return False

        assert _in_child(child) == 0, f"{call}() in a forked child did not raise ForkedWriterError naming the fix"
        # the parent's store is unaffected by the child's attempt
        assert torch.equal(s.get(torch.arange(N)), _table())
        s.update([1], torch.ones(1, DIM))
        s.flush()


def test_readonly_handle_works_in_forked_child(store_path):
    with EmbeddingStore.open(store_path, readonly=True, hot_bytes=8 * (DIM * 4 + 11)) as r:
        r.get([0, 1])  # warm before the fork: state the child inherits

        def child() -> bool:
            return torch.equal(r.get(torch.arange(N)), _table())

        assert _in_child(child) == 0


class _StoreRows(Dataset):
    def __init__(self, path) -> None:
        self.store = EmbeddingStore.open(path, readonly=True, hot_bytes=10 * (DIM * 4 + 11))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return i, os.getpid(), self.store.get([i])[0]


def test_dataloader_fork_workers_read_from_readonly_store_beside_writer(store_path):
    with EmbeddingStore.open(store_path) as writer:  # the training process keeps its writer open
        ds = _StoreRows(store_path)
        loader = DataLoader(ds, batch_size=8, num_workers=2,
                            multiprocessing_context=multiprocessing.get_context("fork"))
        seen, pids = {}, set()
        for idx, pid, rows in loader:
            pids.update(pid.tolist())
            for i, row in zip(idx.tolist(), rows):
                seen[i] = row
        ds.store.close()
        assert sorted(seen) == list(range(N))
        assert torch.equal(torch.stack([seen[i] for i in range(N)]), _table())
        assert os.getpid() not in pids and len(pids) >= 1, f"rows were not read in worker processes: {pids}"
        writer.update([0], torch.zeros(1, DIM))
        writer.flush()


def _private_dirty_mib(pid: int, lo: int, hi: int) -> float:
    """MiB of process ``pid``'s private dirty pages in mappings overlapping [lo, hi)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and line.startswith("Private_Dirty:"):
                total += int(line.split()[1])
    return total / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
@pytest.mark.parametrize("hot", ["memory mode", "hot tier"])
def test_a_forked_child_does_not_keep_copies_of_a_writable_stores_rows(shm_path, hot):
    """A DataLoader worker forked from the training process: the store's rows are not shared
    with it, so rows the parent rewrites afterwards are neither copied at their first write nor
    kept twice (before: the child held the old copy of every page written, +the whole table)."""
    import signal
    import time

    n, dim = 65536, 256  # 64 MiB of rows
    hot_bytes = None if hot == "memory mode" else 2 * n * (dim * 4 + 11)
    with EmbeddingStore.create(shm_path / "big", n, dim, chunk_rows=4096, hot_bytes=hot_bytes) as s:
        ids = torch.arange(n)

        def write_all(value: float) -> None:  # in batches, as training does: rows go through the hot tier
            for part in ids.split(4096):
                s.update(part, torch.full((len(part), dim), value))

        write_all(1.0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.write(w, b"x")
            time.sleep(60)
            os._exit(0)
        os.close(w)
        pool = s._tiers.hot.pool_np  # where the rows live in memory
        lo = pool.__array_interface__["data"][0]
        hi = lo + pool.nbytes
        try:
            os.read(r, 1)
            write_all(2.0)  # an epoch of updates
            held = _private_dirty_mib(pid, lo, hi)
            assert held < 1, f"the forked child holds {held:.0f} MiB of old row pages"
            assert torch.equal(s.get(ids[:5]), torch.full((5, dim), 2.0))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
