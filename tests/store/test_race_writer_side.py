"""Writer-side concurrency: flush, background write-back, compaction, garbage collection and an
explicit compact() from another thread never serve a wrong row nor lose a flushed one; close()
racing calls raises StoreClosedError, never a raw error."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from _store_helpers import looping

from lightning_embcache import EmbeddingStore, StoreClosedError

N, DIM, CHUNK = 4096, 16, 64
ROW_BYTES = DIM * 4


def _writer_against_compactors(path, n_compactors: int, seconds_steps: int, hot_rows: int | None):
    hot = None if hot_rows is None else hot_rows * (ROW_BYTES + 11)
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot)
    model = torch.zeros(N, DIM)
    rng = np.random.default_rng(1)
    wrong = 0
    with looping([store.compact] * n_compactors) as errors:
        for step in range(seconds_steps):
            ids = torch.from_numpy(rng.choice(N, 256, replace=False))
            vals = torch.randn(256, DIM)
            store.update(ids, vals)
            model[ids] = vals
            if step % 3 == 0:
                store.flush()
            probe = torch.from_numpy(rng.choice(N, 512, replace=False))
            wrong += int((store.get(probe) != model[probe]).any(dim=1).sum())
        store.flush()
    assert not errors, f"compact() in another thread raised: {errors[0]!r}"
    assert wrong == 0, f"{wrong} rows read back differed from the reference during the run"
    store.close()
    with EmbeddingStore.open(path, hot_bytes=hot) as s:
        got = s.get(torch.arange(N))
        lost = int((got != model).any(dim=1).sum())
    assert lost == 0, f"{lost} rows lost after the final flush() returned and the store was reopened"


@pytest.mark.parametrize("hot_rows", [None, 1024], ids=["memory", "disk"])
def test_explicit_compact_in_another_thread_loses_and_corrupts_nothing(shm_path, hot_rows):
    _writer_against_compactors(shm_path / "store", 1, 30, hot_rows)


def test_two_threads_compacting_while_a_writer_flushes(shm_path):
    _writer_against_compactors(shm_path / "store", 2, 30, 1024)


@pytest.mark.slow
@pytest.mark.parametrize("hot_rows", [None, 1024], ids=["memory", "disk"])
def test_race_load_writer_and_two_compactors_long(shm_path, hot_rows):
    _writer_against_compactors(shm_path / "store", 2, 600, hot_rows)


@pytest.mark.parametrize("hot_rows", [None, 1024], ids=["memory", "disk"])
def test_close_racing_calls_raises_store_closed_error_only(shm_path, hot_rows):
    """close() from another thread while calls run: each call completes or raises
    StoreClosedError; never TypeError/RuntimeError from freed state or a shut-down executor."""
    hot = None if hot_rows is None else hot_rows * (ROW_BYTES + 11)
    for trial in range(6):
        store = EmbeddingStore.create(shm_path / f"s{trial}", N, DIM, chunk_rows=CHUNK, hot_bytes=hot)
        bad: list[BaseException] = []
        started = threading.Event()

        def worker():
            rng = np.random.default_rng(trial)
            try:
                while True:
                    ids = torch.from_numpy(rng.integers(0, N, 512))
                    store.update(ids, torch.randn(512, DIM))
                    store.get(ids)
                    started.set()
                    store.flush()
                    store.prefetch(ids)
                    store.stats()
            except StoreClosedError:
                return
            except BaseException as exc:  # noqa: BLE001
                bad.append(exc)
            finally:
                started.set()

        t = threading.Thread(target=worker)
        t.start()
        started.wait(10)
        store.close()
        t.join(20)
        assert not t.is_alive()
        assert not bad, f"a call racing close() raised {bad[0]!r}, not StoreClosedError"
        with EmbeddingStore.open(shm_path / f"s{trial}"):  # the writer lock was released
            pass


@pytest.mark.parametrize("steps", [30, pytest.param(1500, marks=pytest.mark.slow)], ids=["short", "long"])
def test_stats_and_flush_threads_with_a_training_thread_in_disk_mode(shm_path, steps):
    """A training thread (get/update), a flushing thread and a stats thread over a store 4x its hot
    tier (write-back and background compaction run too): every row read equals the reference."""
    hot = 512 * (ROW_BYTES + 11)
    store = EmbeddingStore.create(shm_path / "store", N, DIM, chunk_rows=CHUNK, hot_bytes=hot)
    model = torch.zeros(N, DIM)
    rng = np.random.default_rng(3)
    wrong = 0
    with looping([store.flush, store.stats]) as errors:
        for _ in range(steps):
            ids = torch.from_numpy(rng.choice(N, 300, replace=False))
            vals = torch.randn(300, DIM)
            wrong += int((store.get(ids) != model[ids]).any(dim=1).sum())
            store.update(ids, vals)
            model[ids] = vals
    assert not errors, repr(errors[0])
    assert wrong == 0
    v = store.flush()
    store.close()
    with EmbeddingStore.open(shm_path / "store", hot_bytes=hot) as s:
        assert s.version == v
        assert torch.equal(s.get(torch.arange(N)), model)
