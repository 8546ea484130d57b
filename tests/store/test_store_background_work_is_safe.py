"""flush() in a background thread, background compaction and garbage collection never lose or
mix rows, and never fail a later call because of a version dropped under them."""

from __future__ import annotations

import threading

import numpy as np
import torch

from lightning_embcache import EmbeddingStore, VersionNotFoundError

N, DIM, CHUNK = 512, 8, 32
ROW_BYTES = DIM * 4


def test_flush_in_a_background_thread_publishes_prefixes_of_the_updates(shm_path):
    """Each version holds exactly the updates of some prefix of the update calls (each call is
    atomic), versions grow with time, and the final state equals the model."""
    path = shm_path / "store"
    rng = np.random.default_rng(11)
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=48 * (ROW_BYTES + 11))
    model = torch.zeros(N, DIM)
    history = [model.clone()]  # history[j]: the table after j update calls
    seen: list[tuple[int, torch.Tensor]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def flusher() -> None:
        try:
            while not stop.is_set():
                v = store.flush()
                try:
                    with EmbeddingStore.open(path, version=v, readonly=True) as r:
                        seen.append((v, r.get(torch.arange(N))))
                except VersionNotFoundError:
                    pass  # already reclaimed: retention may drop it once newer ones exist
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=flusher)
    t.start()
    try:
        for _ in range(300):
            n = int(rng.integers(1, 40))
            ids = torch.from_numpy(rng.integers(0, N, n))
            vals = torch.from_numpy(rng.standard_normal((n, DIM)).astype(np.float32))
            store.update(ids, vals)
            for i, row in enumerate(ids.tolist()):
                model[row] = vals[i]
            history.append(model.clone())
            assert torch.equal(store.get(ids), model[ids])
    finally:
        stop.set()
        t.join(60)
    assert not errors, f"flush() in a background thread failed: {errors[0]!r}"
    v = store.flush()
    assert torch.equal(store.get(torch.arange(N)), model)
    store.close()
    with EmbeddingStore.open(path) as s:
        assert s.version >= v and torch.equal(s.get(torch.arange(N)), model)

    assert len(seen) >= 3, "the background thread published too few versions to test anything"
    last_prefix = 0
    for v, rows in sorted(seen, key=lambda x: x[0]):
        prefix = next((j for j in range(last_prefix, len(history)) if torch.equal(rows, history[j])), None)
        assert prefix is not None, f"version {v} is not the state after any prefix of the updates (from {last_prefix} on)"
        last_prefix = prefix


def test_garbage_collection_tolerates_versions_dropped_while_it_runs(shm_path, monkeypatch):
    """Background GC lists the versions, then reads their manifests; a flush in between may drop
    one of them (retention). Forced interleaving: GC is held right before it reads a manifest
    until two more flushes have dropped it."""
    from lightning_embcache.store import disk as disk_module

    original = disk_module.Disk._manifest_bytes
    held, release = threading.Event(), threading.Event()

    def manifest_bytes(self, version):
        if threading.current_thread() is not threading.main_thread() and not release.is_set():
            held.set()
            release.wait(1)  # GC holds the writer lock now: flushes wait for it, so keep the hold short
        return original(self, version)

    monkeypatch.setattr(disk_module.Disk, "_manifest_bytes", manifest_bytes)
    path = shm_path / "store"
    store = EmbeddingStore.create(path, 4096, DIM, chunk_rows=256)  # small flushes: no compaction
    rng = np.random.default_rng(5)

    def small_flush() -> int:
        ids = torch.from_numpy(rng.integers(0, 4096, 10))
        store.update(ids, torch.randn(10, DIM))
        return store.flush()

    for _ in range(20):
        small_flush()
        if held.wait(0.05):
            break
    assert held.is_set(), "background garbage collection never read a manifest: update this test's hook"
    small_flush()
    small_flush()  # retention drops what the held collector listed
    release.set()
    store.evict(0)
    for _ in range(3):
        small_flush()  # would raise "background compaction failed: ... missing"
    want = store.get(torch.arange(4096))
    store.close()
    with EmbeddingStore.open(path) as s:
        assert torch.equal(s.get(torch.arange(4096)), want)
