"""Durable against power loss, not only against kill -9: at every commit point of a workload of
flushes with write-back, background compaction rounds, garbage collection, pins and reopens,
every file the new manifest names has its bytes and its name on disk (`_durability.PowerCutOracle`).
The oracle itself is shown to catch the two mutations that kill -9 tests cannot see: a write-back
segment not fsynced before the manifest lists it, and a rename whose folder is never fsynced."""

from __future__ import annotations

import pytest
from _durability import PowerCutOracle
from _fault_workload import run_workload, set_mode

from lightning_embcache.store import disk as disk_mod
from lightning_embcache.store import fileio


@pytest.fixture(autouse=True)
def _in_process_compaction(monkeypatch):
    monkeypatch.setenv("EMBCACHE_COMPACTION_PROCESS", "never")  # its file operations pass the hooks
    set_mode("disk")
    yield
    fileio.FAULTS = None


def _run(tmp_path, monkeypatch) -> PowerCutOracle:
    path = tmp_path / "s"
    oracle = PowerCutOracle(path)
    oracle.patch(monkeypatch)
    try:
        out = run_workload(path, oracle)
    finally:
        fileio.FAULTS = None
    assert out["wrong"] == 0
    return oracle


def test_every_commit_names_only_durable_files(tmp_path, monkeypatch):
    oracle = _run(tmp_path, monkeypatch)
    assert oracle.commits >= 10  # flushes and compaction rounds were checked
    assert oracle.violations == [], "\n".join(oracle.violations[:10])


def test_a_write_back_segment_not_fsynced_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_mod.Disk, "sync_segment", lambda self, seg: None)
    oracle = _run(tmp_path, monkeypatch)
    assert any("were not fsynced" in v for v in oracle.violations), oracle.violations[:5]


def test_a_rename_whose_folder_is_never_fsynced_is_caught(tmp_path, monkeypatch):
    real = fileio.fsync

    def no_folder_fsync(fd, name):
        if not fileio.os.path.isdir(str(name)):
            real(fd, name)

    monkeypatch.setattr(fileio, "fsync", no_folder_fsync)
    oracle = _run(tmp_path, monkeypatch)
    assert any("folder fsync" in v for v in oracle.violations), oracle.violations[:5]


class _Cuts(PowerCutOracle):
    """Also writes the folder a power cut would leave, every ``every``-th file operation."""

    def __init__(self, root, out, every):
        super().__init__(root)
        self.out, self.every, self.cuts = out, every, []
        self.acked: int | None = None  # None until create() returned

    def after(self, op, name):
        super().after(op, name)
        if self.calls % self.every == 0 and self.durable:
            with self.quiescent():  # one instant: no other thread's file operation meanwhile
                dst = self.out / f"cut{len(self.cuts):03d}"
                self.reconstruct(dst)
                self.cuts.append((dst, self.acked))


@pytest.mark.parametrize("every, steps", [(9, 60), pytest.param(1, 60, marks=pytest.mark.slow),
                                          pytest.param(23, 600, marks=pytest.mark.slow)],
                         ids=["every-9th-op", "every-op", "200-flushes"])
def test_folders_left_by_power_cuts_reopen_to_the_last_durable_version(tmp_path, monkeypatch, every, steps):
    """Power cuts at sampled points of flushes, write-back, compaction rounds, garbage collection
    and pins: the folder rebuilt from the durable state alone reopens (for writing, as a resumed
    run would) to a version at least as new as the last acknowledged flush, with exactly that
    version's rows: 0 lost, 0 wrong. Cutting at every file operation (slow) also catches a
    rename whose folder is not fsynced before the manifest that names it (the default sample
    catches the missing data fsync)."""
    import numpy as np
    import torch

    from lightning_embcache import EmbeddingStore

    n, dim, chunk = 512, 8, 32
    path = tmp_path / "s"
    oracle = _Cuts(path, tmp_path / "cuts", every=every)
    oracle.patch(monkeypatch)
    fileio.FAULTS = oracle
    rng = np.random.default_rng(5)
    model = torch.zeros(n, dim)
    models = {0: model.clone()}
    try:
        store = EmbeddingStore.create(path, n, dim, chunk_rows=chunk, hot_bytes=96 * (dim * 4 + 11))
        oracle.acked = 0
        for step in range(steps):
            ids = torch.from_numpy(rng.choice(n, 40, replace=False))
            vals = torch.from_numpy(rng.standard_normal((40, dim)).astype(np.float32))
            store.update(ids, vals)
            model[ids] = vals
            if step % 3 == 2:
                v = store.flush()
                models[v] = model.clone()
                oracle.acked = v
            if step % 15 == 14:
                store.compact()
            if step == 20:
                store.pin(oracle.acked)
        store.close()
    finally:
        fileio.FAULTS = None
    assert len(oracle.cuts) >= 30 and oracle.commits >= steps // 3
    assert oracle.violations == [], "\n".join(oracle.violations[:10])
    from lightning_embcache import CorruptStoreError

    for dst, acked in oracle.cuts:
        if acked is None:  # cut inside create(), which never returned: refused by name, or empty
            try:
                EmbeddingStore.open(dst).close()
            except CorruptStoreError:
                pass
            continue
        with EmbeddingStore.open(dst) as again:
            v = again.version
            assert v >= acked, f"{dst.name}: reopened version {v}, but {acked} was acknowledged"
            assert torch.equal(again.get(torch.arange(n)), models[v]), f"{dst.name}: version {v} has wrong rows"


def test_checkpoint_pins_and_a_reshard_commit_only_durable_files(tmp_path, monkeypatch):
    """The same check over a Lightning fit that keeps checkpoints (each pins its store version)
    and over `reshard_checkpoint` writing a two-shard copy of the table (several store folders)."""
    import sys
    from pathlib import Path

    from lightning.pytorch.callbacks import ModelCheckpoint

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lightning"))
    from _lightning_helpers import tiny_model, tiny_trainer

    from lightning_embcache.distributed.reshard import reshard_checkpoint

    oracle = PowerCutOracle(tmp_path)
    oracle.patch(monkeypatch)
    fileio.FAULTS = oracle
    try:
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        tiny_trainer(tmp_path, callbacks=[ckpt], max_epochs=2, enable_checkpointing=True).fit(
            tiny_model(tmp_path / "latents", hot_bytes=64 << 10))
        fit_commits = oracle.commits
        last = sorted((tmp_path / "ckpt").glob("*.ckpt"))[-1]
        reshard_checkpoint(last, 2, paths={"latents": str(tmp_path / "sharded")})
    finally:
        fileio.FAULTS = None
    assert fit_commits >= 5 and oracle.commits > fit_commits  # the fit's flushes and the shards'
    assert oracle.violations == [], "\n".join(oracle.violations[:10])


class _CutsWhileArmed(_Cuts):
    """Cuts only while ``armed`` (inside compactions that fold in place)."""

    armed = False

    def after(self, op, name):
        PowerCutOracle.after(self, op, name)
        if self.armed and self.calls % self.every == 0 and self.durable:
            with self.quiescent():
                dst = self.out / f"cut{len(self.cuts):03d}"
                self.reconstruct(dst)
                self.cuts.append((dst, self.acked))


def _fold_in_place_under_cuts(tmp_path, monkeypatch, every: int):
    """Dense chunk files folded in place by four compactions, a power cut every ``every``-th file
    operation inside them; returns (oracle, models by version, rows, the writer's stats)."""
    import numpy as np
    import torch

    from lightning_embcache import EmbeddingStore
    from lightning_embcache.store import compaction

    monkeypatch.setattr(compaction, "FOLD_IN_PLACE", True)  # (off by default)

    n, dim, chunk = 512, 8, 32
    path = tmp_path / "s"
    oracle = _CutsWhileArmed(path, tmp_path / "cuts", every=every)
    oracle.patch(monkeypatch)
    fileio.FAULTS = oracle
    rng = np.random.default_rng(7)
    model = torch.from_numpy(rng.standard_normal((n, dim)).astype(np.float32))
    models = {}
    try:
        store = EmbeddingStore.create(path, n, dim, chunk_rows=chunk)
        store.update(torch.arange(n), model)
        models[store.flush()] = model.clone()
        store.compact()  # every chunk a dense raw file
        for step in range(4):
            ids = torch.from_numpy(np.sort(rng.choice(n, 60, replace=False)))
            vals = torch.from_numpy(rng.standard_normal((60, dim)).astype(np.float32))
            store.update(ids, vals)
            model[ids] = vals
            v = store.flush()
            models[v] = model.clone()
            oracle.acked = v
            if step == 2:
                store.pin(v)  # a pinned version that shares the files: still folded in place
            oracle.armed = True
            store.compact()
            oracle.armed = False
        stats = store.stats()
        store.close()
    finally:
        fileio.FAULTS = None
    return oracle, models, n, stats


def test_power_cuts_inside_folds_in_place_reopen_to_the_last_durable_version(tmp_path, monkeypatch):
    """Cuts inside compactions that fold rows into chunk files in place: overwrites not yet
    synced are lost, kept or torn sector by sector (`PowerCutOracle`). Every folder reopens (for
    writing: the interrupted fold is redone from its intent) to the acknowledged version, with
    exactly its rows, and the files the manifests name are durable at every commit."""
    import torch

    from lightning_embcache import EmbeddingStore

    oracle, models, n, stats = _fold_in_place_under_cuts(tmp_path, monkeypatch, every=3)
    assert stats.chunks_folded_in_place >= 4 * 16 - 16 and oracle.torn >= 5 and len(oracle.cuts) >= 30
    assert oracle.violations == [], "\n".join(oracle.violations[:10])
    for dst, acked in oracle.cuts:
        with EmbeddingStore.open(dst) as again:
            v = again.version
            assert v >= acked, f"{dst.name}: reopened version {v}, but {acked} was acknowledged"
            assert torch.equal(again.get(torch.arange(n)), models[v]), f"{dst.name}: version {v} has wrong rows"


def test_the_oracle_catches_a_fold_in_place_that_is_not_redone(tmp_path, monkeypatch):
    """The same cuts, reopened without the redo: some folder reads a block whose checksum the
    interrupted fold had not rewritten."""
    import torch

    from lightning_embcache import CorruptStoreError, EmbeddingStore
    from lightning_embcache.store import inplace

    oracle, models, n, _ = _fold_in_place_under_cuts(tmp_path, monkeypatch, every=3)
    monkeypatch.setattr(inplace, "redo", lambda disk, only=None: 0)
    failed = 0
    for dst, _acked in oracle.cuts:
        try:
            with EmbeddingStore.open(dst) as again:
                if not torch.equal(again.get(torch.arange(n)), models[again.version]):
                    failed += 1
        except CorruptStoreError:
            failed += 1
    assert failed > 0



def _half_table_flushes(tmp_path, monkeypatch, every: int, flushes: int = 6):
    """Flushes of half the table, each overwriting the segment file the previous one's background
    compaction dropped (segpool.py), a power cut every ``every``-th file operation; returns
    (oracle, models by version, rows, segment files reused)."""
    import numpy as np
    import torch

    from lightning_embcache import EmbeddingStore

    n, dim, chunk = 2048, 8, 64
    path = tmp_path / "s"
    oracle = _Cuts(path, tmp_path / "cuts", every=every)
    oracle.patch(monkeypatch)
    fileio.FAULTS = oracle
    rng = np.random.default_rng(9)
    model = torch.zeros(n, dim)
    models = {0: model.clone()}
    try:
        store = EmbeddingStore.create(path, n, dim, chunk_rows=chunk, init="zeros")
        oracle.acked = 0
        for _ in range(flushes):
            ids = torch.from_numpy(np.sort(rng.choice(n, n // 2, replace=False)))
            vals = torch.from_numpy(rng.standard_normal((n // 2, dim)).astype(np.float32))
            store.update(ids, vals)
            model[ids] = vals
            v = store.flush()
            models[v] = model.clone()
            oracle.acked = v
            store._wait_bg()  # the segment is folded and dropped into the pool
        reused = store._versions.disk.segment_pool.reused
        store.close()
    finally:
        fileio.FAULTS = None
    return oracle, models, n, reused


def test_power_cuts_inside_flushes_into_reused_segment_files(tmp_path, monkeypatch):
    """Every folder a cut leaves reopens to a version at least as new as the last acknowledged
    flush, with exactly its rows, and every commit names only durable files: a reused segment
    file is fsynced before its rename, like a new one."""
    import torch

    from lightning_embcache import EmbeddingStore

    oracle, models, n, reused = _half_table_flushes(tmp_path, monkeypatch, every=7)
    assert reused >= 4 and len(oracle.cuts) >= 30
    assert oracle.violations == [], "\n".join(oracle.violations[:10])
    for dst, acked in oracle.cuts:
        if acked is None:
            continue
        with EmbeddingStore.open(dst) as again:
            v = again.version
            assert v >= acked, f"{dst.name}: reopened version {v}, but {acked} was acknowledged"
            assert torch.equal(again.get(torch.arange(n)), models[v]), f"{dst.name}: version {v} has wrong rows"


def test_a_reused_segment_file_not_fsynced_is_caught(tmp_path, monkeypatch):
    """The oracle sees reused files: a reuse that skips the fsync before the rename is flagged."""
    real = fileio.write_parts

    def no_sync_on_reuse(path, parts, **kw):
        if kw.get("reuse") is not None:
            kw["durable"] = False
        return real(path, parts, **kw)

    monkeypatch.setattr(disk_mod, "write_parts", no_sync_on_reuse)
    oracle, _, _, reused = _half_table_flushes(tmp_path, monkeypatch, every=10**9, flushes=3)
    assert reused >= 1
    assert any("were not fsynced" in v for v in oracle.violations), oracle.violations[:5]
