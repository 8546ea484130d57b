"""An owner's store calls for its device tier's misses: the store's trusted record copies against
its checked calls and a dict of rows, and (GPU) a tier that writes rows back through them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore, make_row_optimizer, trainable_fields

DIM = 8


def _fields():
    return trainable_fields(make_row_optimizer("adam", lr=1e-3), DIM, torch.float32)


def test_trusted_record_copies_read_and_write_what_the_checked_calls_do():
    n = 3000
    store = EmbeddingStore.create(None, n, DIM, fields=_fields(), init="normal", seed=3)
    ref = {i: store.read_records(torch.tensor([i]))[0].clone() for i in range(n)}  # id -> record
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randperm(n, generator=g)[:2500]  # above the store's parallel-copy threshold
        out = torch.full((len(ids), store.row_bytes), 7, dtype=torch.uint8)
        assert store._read_records_trusted(ids, out)
        torch.testing.assert_close(out, torch.stack([ref[i] for i in ids.tolist()]), rtol=0, atol=0)
        assert torch.equal(out, store.read_records(ids))
        new = torch.randint(0, 256, (len(ids), store.row_bytes), dtype=torch.uint8, generator=g)
        store.record_view(new, "weight").normal_(generator=g)
        assert store._write_records_trusted(ids, new)
        for i, r in zip(ids.tolist(), new):
            ref[i] = r.clone()
    everything = torch.arange(n)
    torch.testing.assert_close(store.read_records(everything), torch.stack([ref[i] for i in range(n)]), rtol=0, atol=0)
    store.close()


def test_trusted_writes_are_marked_dirty_and_survive_a_flush_and_reopen(tmp_path):
    store = EmbeddingStore.create(tmp_path / "s", 500, DIM, fields=_fields())
    every = torch.arange(500)
    store.write_records(every, store.read_records(every))  # every row in the hot pool
    if not store._tiers.hot.all_loaded:
        pytest.skip("this store keeps rows on disk after a full write: the trusted copies decline there")
    ids = torch.tensor([4, 499, 17])
    recs = store.read_records(ids)
    store.record_view(recs, "weight").fill_(2.5)
    assert store._write_records_trusted(ids, recs)
    store.flush()
    store.close()
    again = EmbeddingStore.open(tmp_path / "s")
    torch.testing.assert_close(again.get(ids), torch.full((3, DIM), 2.5))
    again.close()


def test_trusted_copies_decline_outside_memory_mode_and_change_nothing(tmp_path):
    store = EmbeddingStore.create(tmp_path / "s", 20_000, DIM, fields=_fields(), hot_bytes=64 * 1024, chunk_rows=256)
    assert not store._tiers.hot.all_loaded
    ids = torch.tensor([1, 5000, 19_999])
    out = torch.full((3, store.row_bytes), 9, dtype=torch.uint8)
    assert not store._read_records_trusted(ids, out)
    assert (out == 9).all()
    recs = store.read_records(ids)
    store.record_view(recs, "weight").fill_(4.0)
    assert not store._write_records_trusted(ids, recs)
    torch.testing.assert_close(store.get(ids), torch.zeros(3, DIM))
    store.close()


# ---- a device tier writing back through them (GPU) -------------------------------------------------
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tier(n, rows_on_gpu, trusted, **store_options):
    from lightning_embcache.device_tier import SLOT_OVERHEAD, DeviceTier

    store = EmbeddingStore.create(None, n, DIM, **store_options)
    tier = DeviceTier(store, "cuda", rows_on_gpu * (store.row_bytes + SLOT_OVERHEAD))
    tier.trusted_store_calls = trusted
    return store, tier


@gpu
@needs_cuda
@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "checked"])
def test_rows_evicted_and_uploaded_through_the_store_match_a_reference(trusted):
    # 3,000 rows per step into a tier of 7,000 with the next batch prefetched: every step evicts
    # dirty rows (written back) and uploads rows that were written back earlier
    n = 30_000
    store, tier = _tier(n, 7000, trusted)
    ref = torch.zeros(n, DIM)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randperm(n, generator=g)[:3000].numpy() for _ in range(14)]
    for k, ids in enumerate(batches):
        torch.testing.assert_close(tier.gather(ids).cpu(), ref[torch.from_numpy(ids)])
        vals = torch.randn(len(ids), DIM, generator=g)
        tier.scatter(ids, vals.cuda())
        ref[torch.from_numpy(ids)] = vals
        if k + 1 < len(batches):
            tier.prefetch(batches[k + 1], tier.positions(ids))
    assert tier.written_down_rows > 3 * 3000
    tier.write_down()
    torch.testing.assert_close(store.get(torch.arange(n)), ref)
    tier.close()
    store.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_row_written_back_raises_the_stores_error_and_the_store_keeps_its_rows(bad):
    from lightning_embcache import StoreError

    store, tier = _tier(1000, 200, True)
    ids = np.arange(100, dtype=np.int64)
    vals = torch.ones(100, DIM)
    vals[37, 3] = bad
    tier.scatter(ids, vals.cuda())
    with pytest.raises(StoreError, match="records \\(weight\\)"):
        tier.write_down()
    torch.testing.assert_close(store.get(torch.from_numpy(ids)), torch.zeros(100, DIM))
    tier.close()
    store.close()


@gpu
@needs_cuda
def test_a_store_without_the_finite_check_takes_non_finite_rows_through_the_trusted_copy():
    store, tier = _tier(1000, 200, True, check_finite=False)
    ids = np.arange(100, dtype=np.int64)
    vals = torch.ones(100, DIM)
    vals[5, 0] = float("nan")
    tier.scatter(ids, vals.cuda())
    tier.write_down()
    got = store.get(torch.from_numpy(ids))
    assert torch.isnan(got[5, 0]) and torch.equal(got[6], vals[6])
    tier.close()
    store.close()
