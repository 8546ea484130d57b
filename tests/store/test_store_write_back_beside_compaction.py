"""A background compaction is a pass of rounds on the store's one background thread; the
write-back of cold dirty rows shares that thread. Queued behind the pass, the write-back would
leave evictions to write dirty rows on the training thread for the whole pass: it runs between
two rounds instead."""

from __future__ import annotations

import time

import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import disk as disk_mod

N, DIM, CHUNK = 16384, 16, 64  # 256 chunks: a pass is 16 rounds of 16 chunks
ROW_BYTES = DIM * 4


def test_a_write_back_asked_for_during_a_compaction_pass_runs_before_the_pass_ends(shm_path, monkeypatch):
    real = disk_mod.Disk.write_chunk

    def slow_write_chunk(self, *args, **kwargs):  # a pass of 256 chunks takes over 1 s
        time.sleep(0.005)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(disk_mod.Disk, "write_chunk", slow_write_chunk)
    hot_rows = 2048
    with EmbeddingStore.create(shm_path / "s", N, DIM, chunk_rows=CHUNK,
                               hot_bytes=hot_rows * (ROW_BYTES + 16)) as store:
        model = store.get(torch.arange(N)).clone()
        ids = torch.randperm(N)[: N // 2]  # half the table, spread over every chunk
        model[ids] = 1.0
        for part in ids.split(512):
            store.update(part, model[part])
        store.flush()  # segments over 25% of the table: a background pass starts
        deadline = time.monotonic() + 10
        while store.stats().compactions < 1:
            assert time.monotonic() < deadline, "no compaction round started"
            time.sleep(0.002)
        cleaned = store.stats().cleaned_rows
        limit = store._tiers.hot.limit
        fresh = torch.tensor(sorted(set(range(N)) - set(ids.tolist()))[: limit])
        model[fresh] = 2.0
        for part in fresh.split(limit // 4):  # more than half the hot slots dirty: a clean is due
            store.update(part, model[part])
        while store.stats().cleaned_rows == cleaned:
            assert time.monotonic() < deadline, "the write-back did not run"
            time.sleep(0.002)
        assert not store._versions.bg.futures["_compact"].done(), "the write-back waited for the whole pass"
        assert torch.equal(store.get(torch.arange(N)), model)
