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


@pytest.mark.parametrize("call", ["get", "update", "flush", "prefetch", "evict"])
def test_writable_store_refuses_use_in_forked_child(store_path, call):
    with EmbeddingStore.open(store_path, hot_bytes=8 * (DIM * 4 + 11)) as s:
        s.get([1, 2])
        calls = {
            "get": lambda: s.get([1]),
            "update": lambda: s.update([1], torch.zeros(1, DIM)),
            "flush": s.flush,
            "prefetch": lambda: s.prefetch([1]),
            "evict": lambda: s.evict(100),
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
