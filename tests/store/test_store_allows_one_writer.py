"""One writer per path (in this process or another); readonly handles open beside the writer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_embcache import EmbeddingStore, ReadOnlyError, StoreLockedError

REPO = Path(__file__).resolve().parents[2]
N, DIM = 64, 4


@pytest.fixture
def store_path(shm_path):
    path = shm_path / "store"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=16) as s:
        s.update(torch.arange(N), torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM))
        s.flush()
    return path


def test_second_writer_in_same_process_is_locked_out(store_path):
    with EmbeddingStore.open(store_path) as writer:
        with pytest.raises(StoreLockedError) as info:
            EmbeddingStore.open(store_path)
        assert str(store_path) in str(info.value) and "readonly=True" in str(info.value)
        with pytest.raises(StoreLockedError):
            EmbeddingStore.open(store_path, hot_bytes=1000)
        # the refused open did not disturb the writer
        writer.update([1], torch.zeros(1, DIM))
        writer.flush()
    EmbeddingStore.open(store_path).close()  # released on close


def test_second_writer_in_another_process_is_locked_out(store_path):
    code = (
        "import sys\n"
        "from lightning_embcache import EmbeddingStore, StoreLockedError\n"
        "try:\n"
        f"    EmbeddingStore.open({str(store_path)!r})\n"
        "except StoreLockedError as e:\n"
        "    print('LOCKED', e); sys.exit(0)\n"
        "print('OPENED'); sys.exit(1)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with EmbeddingStore.open(store_path):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0 and "LOCKED" in r.stdout, r.stdout + r.stderr


def test_lock_is_released_when_the_writer_process_dies(store_path):
    code = (
        "import os, sys\n"
        "from lightning_embcache import EmbeddingStore\n"
        f"s = EmbeddingStore.open({str(store_path)!r})\n"
        "print('HELD', flush=True)\n"
        "os._exit(0)\n"  # no close(): the kernel drops the lock with the process
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "HELD" in r.stdout, r.stderr
    EmbeddingStore.open(store_path).close()


def test_readonly_handles_open_beside_the_writer_and_refuse_writes(store_path):
    with EmbeddingStore.open(store_path) as writer:
        want = writer.get(torch.arange(N))
        with EmbeddingStore.open(store_path, readonly=True) as r1, \
                EmbeddingStore.open(store_path, readonly=True, hot_bytes=4 * (DIM * 4 + 11)) as r2:
            assert r1.readonly and r2.readonly
            assert torch.equal(r1.get(torch.arange(N)), want)
            assert torch.equal(r2.get(torch.arange(N)), want)
            with pytest.raises(ReadOnlyError):
                r1.update([0], torch.zeros(1, DIM))
        # the writer still writes after the readers came and went
        writer.update([0], torch.full((1, DIM), 9.0))
        v = writer.flush()
        with EmbeddingStore.open(store_path, readonly=True) as r3:
            assert r3.version == v and torch.equal(r3.get([0]), torch.full((1, DIM), 9.0))


def test_readonly_reader_keeps_reading_its_version_while_the_writer_moves_on(store_path):
    """A reader (e.g. a DataLoader worker) opened at version v keeps seeing v while the writer
    flushes and compacts past the versions it would otherwise retain: no error, no later rows."""
    with EmbeddingStore.open(store_path, hot_bytes=8 * (DIM * 4 + 11)) as writer:
        writer.update([3, 20], torch.ones(2, DIM))
        v = writer.flush()
        with EmbeddingStore.open(store_path, readonly=True, hot_bytes=4 * (DIM * 4 + 11)) as reader:
            want = torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM)
            want[[3, 20]] = 1.0
            for i in range(4):
                writer.update([3, 40], torch.full((2, DIM), 5.0 + i))
                writer.flush()
                writer.compact()
            assert reader.version == v
            got = reader.get(torch.arange(N))
            assert torch.equal(got, want), "a readonly reader saw rows of a version it did not open"
