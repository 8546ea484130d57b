"""Compaction rounds sleep between chunks (handing the GIL to a training thread) only when they
run on a thread other than the one reading and writing rows."""

from __future__ import annotations

import threading

import numpy as np
import torch

import lightning_embcache.store.compaction as compaction
import lightning_embcache.store.versions as versions
from lightning_embcache import EmbeddingStore


def _store_with_segments(tmp_path, monkeypatch):
    monkeypatch.setattr(compaction, "COMPACT_RATIO", 9.0)  # no background pass: the tests run the rounds
    monkeypatch.setattr(versions, "HARD_RATIO", 9.0)
    s = EmbeddingStore.create(tmp_path / "s", 20_000, 8, hot_bytes=1 << 20, chunk_rows=256)
    rng = np.random.default_rng(0)
    for i in range(4):
        ids = torch.from_numpy(np.sort(rng.choice(20_000, 2_000, replace=False)))
        s.update(ids, torch.full((2_000, 8), float(i)))
        s.flush()
    return s


def _count_sleeps(monkeypatch) -> list[int]:
    calls = [0]
    real = compaction.time.sleep

    def sleep(x):
        if x == 0:
            calls[0] += 1
        real(x)

    monkeypatch.setattr(compaction.time, "sleep", sleep)
    return calls


def test_a_round_on_the_training_thread_does_not_sleep(tmp_path, monkeypatch):
    s = _store_with_segments(tmp_path, monkeypatch)
    s.get(torch.arange(10))  # this thread reads rows: it is the training thread
    sleeps = _count_sleeps(monkeypatch)
    assert s._versions.compaction.compact_round(everything=True)
    assert sleeps[0] == 0
    s.close()


def test_a_round_beside_the_training_thread_hands_over_per_chunk(tmp_path, monkeypatch):
    s = _store_with_segments(tmp_path, monkeypatch)
    s.get(torch.arange(10))
    sleeps = _count_sleeps(monkeypatch)
    done = []
    t = threading.Thread(target=lambda: done.append(s._versions.compaction.compact_round(everything=True)))
    t.start()
    t.join()
    assert done == [True]
    assert sleeps[0] >= 10  # one per chunk rewritten
    ref = s.get(torch.arange(20_000))
    s.compact()
    assert torch.equal(s.get(torch.arange(20_000)), ref)
    s.close()
