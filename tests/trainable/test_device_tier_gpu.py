"""The device tier: rows and optimizer state on the GPU, against nn.Embedding + SparseAdam on the
same GPU (the reference), with the table inside and 4x over the device budget."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import (
    EmbeddingStore,
    EmbeddingStoreMixin,
    StoreError,
    TrainableRows,
    make_row_optimizer,
    trainable_fields,
)
from lightning_embcache.device_tier import SLOT_OVERHEAD, DeviceTier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, DIM, STEPS = 3000, 16, 200


def _store(tmp_path, name: str, hot_bytes=None):
    opt = make_row_optimizer(name, lr=0.05 if name != "sgd" else 0.5)
    store = EmbeddingStore.create(tmp_path / "s", N, DIM, init="normal", seed=1, chunk_rows=128, hot_bytes=hot_bytes,
                                  fields=trainable_fields(opt, DIM, torch.float32))
    return opt, store


def _budget(store, fraction):
    return int(N * fraction) * (store.row_bytes + SLOT_OVERHEAD)


def _reference(name, w0):
    emb = torch.nn.Embedding(N, DIM, sparse=True, device="cuda")
    with torch.no_grad():
        emb.weight.copy_(w0)
    if name == "adam":
        return emb, torch.optim.SparseAdam(emb.parameters(), lr=0.05)
    if name == "adagrad":
        return emb, torch.optim.Adagrad(emb.parameters(), lr=0.05)
    return emb, torch.optim.SGD(emb.parameters(), lr=0.5)


@pytest.mark.parametrize("name", ["adam", "adagrad", "sgd"])
@pytest.mark.parametrize("fraction, hot_bytes", [(1.0, None), (0.25, 400 * 200), (0.25, None)],
                         ids=["inside-budget", "4x-over-budget-staged", "4x-over-budget-mapped"])
def test_device_tier_trains_like_nn_embedding_on_the_gpu(tmp_path, name, fraction, hot_bytes):
    """Staged: a disk-mode table (rows through pinned buffers). Mapped: a memory-mode table the
    device reads and writes in place (`mapped_host`)."""
    opt, store = _store(tmp_path, name, hot_bytes=hot_bytes)
    tier = DeviceTier(store, "cuda", _budget(store, fraction))
    assert tier.resident == (fraction == 1.0)
    assert tier.stats()["device_mapped_host"] == (fraction < 1.0 and hot_bytes is None)
    rows = TrainableRows(store, opt, device_tier=tier)
    emb, ref = _reference(name, store.get(torch.arange(N)).cuda())
    g = torch.Generator().manual_seed(0)
    for step in range(1, STEPS + 1):
        ref.zero_grad()
        for _ in range(2):  # two micro-batches, duplicates within and across them
            ids = torch.randint(0, N, (96,), generator=g)
            tgt = torch.randn(96, DIM, generator=g).cuda()
            ((emb(ids.cuda()) - tgt) ** 2).sum().backward()
            z = rows.lookup(ids)
            assert z.is_cuda
            ((z - tgt) ** 2).sum().backward()
            rows.collect()
        ref.step()
        rows.apply(step=step)
        if step % 50 == 0:
            rows.write_down()
            store.flush()
    got = tier.gather(np.arange(N))
    torch.testing.assert_close(got, emb.weight.detach(), rtol=1e-5, atol=1e-5)
    if fraction < 1.0:  # rows went both ways, and the tier counted their bytes: a row re-taken
        st = tier.stats()  # from its write-down still in flight crosses no bus, so at most
        assert 0 < st["host_to_device_bytes"] <= st["device_loaded_rows"] * store.row_bytes
        assert st["host_to_device_bytes"] % store.row_bytes == 0
        assert st["device_to_host_bytes"] > 0
    # the store holds the same after a write-down and a flush, and so does a reopened store
    rows.write_down()
    version = store.flush()
    torch.testing.assert_close(store.get(torch.arange(N)).cuda(), emb.weight.detach(), rtol=1e-5, atol=1e-5)
    store.close()
    again = EmbeddingStore.open(tmp_path / "s", version=version, readonly=True)
    torch.testing.assert_close(again.get(torch.arange(N)).cuda(), got, rtol=0, atol=0)
    again.close()


def _train_beside_reference(store, rows, name, batch, seed):
    """STEPS steps of ``batch`` random ids through ``rows`` and through the reference, a flush
    (pinned) every 50; returns the reference and its weights at each flushed version."""
    emb, ref = _reference(name, store.get(torch.arange(N)).cuda())
    g = torch.Generator().manual_seed(seed)
    versions = {}
    for step in range(1, STEPS + 1):
        ref.zero_grad()
        ids = torch.randint(0, N, (batch,), generator=g)
        tgt = torch.randn(batch, DIM, generator=g).cuda()
        ((emb(ids.cuda()) - tgt) ** 2).sum().backward()
        ((rows.lookup(ids) - tgt) ** 2).sum().backward()
        rows.collect()
        ref.step()
        rows.apply(step=step)
        if step % 50 == 0:
            rows.write_down()
            v = store.flush()
            store.pin(v)
            versions[v] = emb.weight.detach().clone()
    return emb, ref, versions


@pytest.mark.parametrize("name", ["adam", "adagrad", "sgd"])
def test_rows_trained_in_place_in_host_ram_train_like_nn_embedding(tmp_path, name):
    """`HostMappedTier` (``device_bytes=0`` over a memory-mode table): no row on the GPU, every
    gather and update over the bus, flushes in between; the same rows as the reference."""
    from lightning_embcache.host_mapped_tier import HostMappedTier

    opt, store = _store(tmp_path, name)
    tier = HostMappedTier.create(store, "cuda")
    assert tier is not None and tier.nbytes == 0 and tier.stats()["device_mapped_host"]
    emb, ref, versions = _train_beside_reference(store, TrainableRows(store, opt, device_tier=tier), name, 96, 0)
    torch.testing.assert_close(tier.gather(np.arange(N)), emb.weight.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(store.get(torch.arange(N)).cuda(), emb.weight.detach(), rtol=1e-5, atol=1e-5)
    tier.close()
    store.close()
    for v, want in versions.items():  # every flushed version holds the rows of its moment
        again = EmbeddingStore.open(tmp_path / "s", version=v, readonly=True)
        torch.testing.assert_close(again.get(torch.arange(N)).cuda(), want, rtol=1e-5, atol=1e-5)
        again.close()


@pytest.mark.parametrize("hot_bytes", [400 * 200, None], ids=["staged", "mapped"])
def test_16x_over_the_budget_rows_and_moments_equal_sparse_adam_across_flushes(tmp_path, hot_bytes):
    """A tier of 1/16 of the table, 200 Adam steps of 64 random ids with a flush every 50: weights
    and both moments equal nn.Embedding + SparseAdam's, on the tier and in every flushed version."""
    opt, store = _store(tmp_path, "adam", hot_bytes=hot_bytes)
    tier = DeviceTier(store, "cuda", _budget(store, 1 / 16))
    assert tier.capacity == N // 16 and tier.stats()["device_mapped_host"] == (hot_bytes is None)
    emb, ref, _ = _train_beside_reference(store, TrainableRows(store, opt, device_tier=tier), "adam", 64, 3)
    state = ref.state[emb.weight]
    for name, want in (("weight", emb.weight.detach()), ("exp_avg", state["exp_avg"]),
                       ("exp_avg_sq", state["exp_avg_sq"])):
        torch.testing.assert_close(tier.gather(np.arange(N), name), want, rtol=1e-5, atol=1e-6, msg=name)
    tier.close()
    store.close()


def test_device_tier_steps_make_no_device_sync(tmp_path):
    from lightning_embcache.host_mapped_tier import HostMappedTier

    opt, store = _store(tmp_path, "adam", hot_bytes=None)
    tiers = (lambda: DeviceTier(store, "cuda", _budget(store, 1.0)),  # whole table on the GPU
             lambda: DeviceTier(store, "cuda", _budget(store, 0.25)),  # a cache over the mapped table
             lambda: HostMappedTier.create(store, "cuda"))  # rows trained in host RAM
    g = torch.Generator().manual_seed(0)
    for make in tiers:
        tier = make()
        rows = TrainableRows(store, opt, device_tier=tier)
        for step in range(1, 40):
            ids = torch.randint(0, N, (256,), generator=g)
            if step > 5:
                torch.cuda.set_sync_debug_mode("error")
            try:
                z = rows.lookup(ids)
                (z * z).sum().backward()
                rows.apply(step=step)
                rows.prefetch(torch.randint(0, N, (256,), generator=g))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        rows.write_down()
        tier.close()
    store.close()


def test_direct_writes_through_the_device_tier_match_a_dict(tmp_path):
    store = EmbeddingStore.create(tmp_path / "s", N, DIM, hot_bytes=None)
    tier = DeviceTier(store, "cuda", _budget(store, 0.1))
    ref = {i: torch.zeros(DIM) for i in range(N)}
    g = torch.Generator().manual_seed(2)
    for _ in range(60):
        ids = torch.randint(0, N, (128,), generator=g)
        vals = torch.randn(128, DIM, generator=g)
        tier.scatter(ids.numpy(), vals.cuda())
        for i, v in zip(ids.tolist(), vals):  # last write of a duplicate wins
            ref[i] = v
        probe = torch.randint(0, N, (64,), generator=g)
        torch.testing.assert_close(tier.gather(probe.numpy()).cpu(), torch.stack([ref[i] for i in probe.tolist()]))
    tier.write_down()
    torch.testing.assert_close(store.get(torch.arange(N)), torch.stack([ref[i] for i in range(N)]))
    store.close()


def test_row_sets_larger_than_one_store_call_round_trip_through_the_store(tmp_path):
    # 5,000 distinct rows per step into a tier of 12,000 (the next batch prefetched beside this
    # one): every step evicts and writes back more rows than one store call takes
    # (STORE_CALL_ROWS) and uploads as many
    n = 40_000
    store = EmbeddingStore.create(tmp_path / "s", n, DIM, hot_bytes=None)
    tier = DeviceTier(store, "cuda", 12_000 * (store.row_bytes + SLOT_OVERHEAD))
    ref = torch.zeros(n, DIM)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randperm(n, generator=g)[:5000].numpy() for _ in range(12)]
    for k, ids in enumerate(batches):
        vals = torch.randn(len(ids), DIM, generator=g)
        tier.scatter(ids, vals.cuda())
        ref[torch.from_numpy(ids)] = vals
        if k + 1 < len(batches):
            tier.prefetch(batches[k + 1], tier.positions(ids))
        probe = np.sort(batches[max(0, k - 1)])  # last step's rows: partly evicted, partly on the way down
        torch.testing.assert_close(tier.gather(probe).cpu(), ref[torch.from_numpy(probe)])
    assert tier.evicted_rows > 2 * 4096 and tier.written_down_rows > 2 * 4096
    tier.write_down()
    torch.testing.assert_close(store.get(torch.arange(n)), ref)
    tier.close()
    store.close()


def test_a_nan_trained_on_the_device_is_refused_at_the_write_down_and_never_flushed(tmp_path):
    """Over a mapped memory-mode table evicted rows reach the host by a kernel, unchecked on the
    way (a check would wait for the GPU); the write-down before a flush refuses them by name."""
    opt, store = _store(tmp_path, "sgd", hot_bytes=None)
    version = store.flush()
    tier = DeviceTier(store, "cuda", _budget(store, 0.25))
    assert tier.stats()["device_mapped_host"]
    rows = TrainableRows(store, opt, device_tier=tier)
    z = rows.lookup(torch.arange(10))
    (z * float("nan")).sum().backward()
    rows.apply(step=1)
    for k, a in enumerate(range(10, N - 500, 500)):  # push the NaN rows out of the tier
        (rows.lookup(torch.arange(a, a + 500)) * 0).sum().backward()
        rows.apply(step=2 + k)
    with pytest.raises(StoreError, match="NaN or Inf"):
        rows.write_down()
    assert store.versions()[-1] == version
    tier.close()
    store.close()


def test_index_arrays_reach_the_device_unchanged():
    from lightning_embcache.pinned import PinnedRing

    ring, dev = PinnedRing(2), torch.device("cuda", torch.cuda.current_device())
    arrays = [np.arange(20, dtype=np.int64)[::3], np.array(7, np.int64), np.zeros(0, np.int32),
              np.array([True, False, True]), np.arange(12, dtype=np.float32).reshape(3, 4).T,
              np.arange(40, dtype=np.int32)[5:30:4]]
    outs = [ring.to_device(a, dev) for a in arrays]  # more arrays than buffers: each is reused
    for a, out in zip(arrays, outs):
        assert out.device == dev and out.shape == a.shape
        np.testing.assert_array_equal(out.cpu().numpy(), a)


class _Decoder(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path, device_bytes, optimizer="adam", lr=0.05):
        super().__init__()
        self.latents = self.add_embedding_store("latents", num_rows=N, dim=DIM, path=path, chunk_rows=128,
                                                device_bytes=device_bytes, init="normal", optimizer=optimizer, lr=lr)
        self.net = torch.nn.Linear(DIM, 8)

    def training_step(self, batch, batch_idx):
        ids, target = batch
        return torch.nn.functional.mse_loss(self.net(self.latents.lookup(ids)), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.0)  # the decoder stays fixed


@pytest.mark.parametrize("fraction", [None, 0.25], ids=["auto", "quarter"])
def test_fit_on_the_device_tier_matches_the_host_path_and_reopens(tmp_path, fraction):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, N, (4096,), generator=g)
    target = torch.randn(4096, 8, generator=g)
    results = {}
    for mode in ("host", "device"):
        L.seed_everything(0)
        record = 3 * DIM * 4 + 8  # weight, two Adam moments, last_step + updates
        budget = 0 if mode == "host" else (None if fraction is None else int(N * fraction) * (record + SLOT_OVERHEAD))
        model = _Decoder(tmp_path / mode, budget)
        trainer = L.Trainer(max_epochs=2, accelerator="cuda", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(TensorDataset(ids, target), batch_size=256, shuffle=False))
        if mode == "device":
            assert model.latents._device_tier is None  # released after fit, its rows flushed
        results[mode] = EmbeddingStore.open(tmp_path / mode, readonly=True)
    torch.testing.assert_close(results["device"].get(torch.arange(N)), results["host"].get(torch.arange(N)),
                               rtol=1e-5, atol=1e-5)
    for s in results.values():
        s.close()


def test_a_batch_larger_than_the_tier_is_refused_by_name_and_changes_nothing(tmp_path):
    opt, store = _store(tmp_path, "adam", hot_bytes=None)
    tier = DeviceTier(store, "cuda", _budget(store, 0.05))  # 150 rows
    rows = TrainableRows(store, opt, device_tier=tier)
    z = rows.lookup(torch.arange(100))  # held until apply
    (z * z).sum().backward()
    rows.collect()
    before = tier.gather(np.arange(100)).clone()
    with pytest.raises(StoreError, match="device_bytes"):
        rows.lookup(torch.arange(100, 200))  # 200 rows at once in a tier of 150
    rows.apply(step=1)  # the held rows were not pushed out: the update lands on them
    assert not torch.equal(tier.gather(np.arange(100)), before)
    rows.write_down()
    torch.testing.assert_close(store.get(torch.arange(100)).cuda(), tier.gather(np.arange(100)))
    store.close()


class _PrefetchingDecoder(_Decoder):
    """Looks up a batch, then tells the tier the next batch's ids (as a lookahead sampler would)."""

    def training_step(self, batch, batch_idx):
        ids, nxt, target = batch
        z = self.latents.lookup(ids)
        self.latents.prefetch(nxt)
        return torch.nn.functional.mse_loss(self.net(z), target)


def test_background_flushes_during_prefetching_fit_lose_nothing(tmp_path):
    """DeferredSync flushes from its thread while the prefetch and write-back threads move rows:
    the rows after fit equal the host path's, and every flushed version reopens."""
    from lightning_embcache import DeferredSync

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, N, (256 * 24,), generator=g)
    nxt = torch.cat([ids[256:], ids[:256]])
    target = torch.randn(len(ids), 8, generator=g)
    results = {}
    for mode in ("host", "device"):
        L.seed_everything(0)
        record = 3 * DIM * 4 + 8
        model = _PrefetchingDecoder(tmp_path / mode, 0 if mode == "host" else int(N * 0.2) * (record + SLOT_OVERHEAD))
        sync = DeferredSync(every_n_steps=3, background=True)
        trainer = L.Trainer(max_epochs=2, accelerator="cuda", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[sync])
        trainer.fit(model, DataLoader(TensorDataset(ids, nxt, target), batch_size=256, shuffle=False))
        # 16 triggers; a trigger while a flush is in flight coalesces into it (how many depends on
        # the host's timing: 9 of 16 flushed once on a loaded H100 host), so only ask for several
        assert sync.syncs >= 3
        results[mode] = EmbeddingStore.open(tmp_path / mode, readonly=True)
    torch.testing.assert_close(results["device"].get(torch.arange(N)), results["host"].get(torch.arange(N)),
                               rtol=1e-5, atol=1e-5)
    versions = results["device"].versions()
    for s in results.values():
        s.close()
    for v in versions:  # every version a background flush published is whole
        EmbeddingStore.open(tmp_path / "device", version=v, readonly=True).close()


@pytest.mark.parametrize("device_bytes", [None, 0], ids=["device-tier", "host"])
def test_16_mixed_unscales_the_rows_gradients(tmp_path, device_bytes):
    """SGD rows move by lr x gradient: left scaled by the GradScaler (65536) they would move 65536x
    too far, or overflow. Under 16-mixed they move as under 32-true, within fp16's rounding."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, N, (2048,), generator=g)
    target = torch.randn(2048, 8, generator=g)
    w0 = EmbeddingStore.create(None, N, DIM, init="normal", chunk_rows=128).get(torch.arange(N))
    moved = {}
    for precision in ("32-true", "16-mixed"):
        L.seed_everything(0)
        model = _Decoder(tmp_path / precision, device_bytes, optimizer="sgd", lr=0.5)
        L.Trainer(max_epochs=1, accelerator="cuda", devices=1, precision=precision, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(model, DataLoader(TensorDataset(ids, target), batch_size=256))
        with EmbeddingStore.open(tmp_path / precision, readonly=True) as s:
            moved[precision] = s.get(torch.arange(N)) - w0
    assert moved["32-true"].abs().max() > 1e-3
    torch.testing.assert_close(moved["16-mixed"], moved["32-true"], rtol=0.05, atol=2e-3)


def test_a_forked_child_gets_a_clear_error_not_a_crash_from_the_device_tier(tmp_path):
    """The tier's host maps are not mapped in a forked child (a DataLoader worker): a call there
    names the problem (ForkedWriterError) instead of reading unmapped memory."""
    import os

    from lightning_embcache import ForkedWriterError

    class M(EmbeddingStoreMixin, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.z = self.add_embedding_store("z", N, DIM, path=str(tmp_path / "z"), optimizer="adam", lr=0.1,
                                              device_bytes=N // 4 * (DIM * 12 + SLOT_OVERHEAD))
            self.lin = torch.nn.Linear(DIM, 1)

    m = M().cuda()
    ids = torch.arange(64, device="cuda")
    m.z.get(ids)  # the tier exists and holds rows
    assert m.z._device_tier is not None
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            m.z.get(ids)
        except ForkedWriterError:
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child exit {os.waitstatus_to_exitcode(status)}"
    torch.testing.assert_close(m.z.get(ids), m.z.get(ids))  # the parent carries on
    m.z.close()


def test_lookups_never_wait_on_the_host_for_the_tiers_write_downs(tmp_path, monkeypatch):
    """A tier smaller than the table writes evicted rows down into the host table with kernels
    (queued, `_device_write`); the next lookup reads the tier on the device after them in stream
    order, so the training thread must not wait for them on the host (an event sync every step)."""
    import threading

    calls = {"device_writes": 0, "waits_in_steps": 0}
    in_step = threading.Event()
    real_write, real_wait = EmbeddingStore._device_write, EmbeddingStore._await_device_writes

    def write(self, *args, **kwargs):
        calls["device_writes"] += 1
        return real_write(self, *args, **kwargs)

    def wait(self):
        if (in_step.is_set() and self._device_pending is not None
                and threading.current_thread() is threading.main_thread()):
            calls["waits_in_steps"] += 1
        return real_wait(self)

    monkeypatch.setattr(EmbeddingStore, "_device_write", write)
    monkeypatch.setattr(EmbeddingStore, "_await_device_writes", wait)

    class _Steps(L.Callback):
        def on_train_batch_start(self, *args):
            in_step.set()

        def on_train_batch_end(self, *args):
            in_step.clear()

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, N, (256 * 24,), generator=g)
    nxt = torch.cat([ids[256:], ids[:256]])
    target = torch.randn(len(ids), 8, generator=g)
    record = 3 * DIM * 4 + 8
    model = _PrefetchingDecoder(None, int(N * 0.25) * (record + SLOT_OVERHEAD))  # memory mode: a mapped table
    trainer = L.Trainer(max_epochs=1, accelerator="cuda", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[_Steps()])
    trainer.fit(model, DataLoader(TensorDataset(ids, nxt, target), batch_size=256, shuffle=False))
    assert calls["device_writes"] > 0, "no write-down went through the mapped table: the test proves nothing"
    assert calls["waits_in_steps"] == 0, calls
