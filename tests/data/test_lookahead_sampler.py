"""LookaheadSampler yields exactly the wrapped sampler's sequence and hints the next batches."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler

from lightning_embcache import EmbeddingStore, InvalidArgumentError, InvalidTypeError, LookaheadSampler

N = 1000


class _Recorder:
    """A stand-in store that records each hint and the item count yielded when it came."""

    hot_bytes = None
    row_bytes = 64

    def __init__(self):
        self.hints: list[list[int]] = []

    def upcoming(self, ids):
        self.hints.append(torch.as_tensor(ids).tolist())


class _Indices(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


def _samplers():
    """(name, factory): each factory makes a fresh, identically seeded sampler."""
    return [
        ("random", lambda: RandomSampler(range(N), generator=torch.Generator().manual_seed(1))),
        ("batch", lambda: BatchSampler(RandomSampler(range(N), generator=torch.Generator().manual_seed(2)), 64, False)),
        ("batch-last", lambda: BatchSampler(range(N), 300, False)),
        ("dist-rank0", lambda: DistributedSampler(range(N), num_replicas=2, rank=0, shuffle=True, seed=3)),
        ("dist-rank1", lambda: DistributedSampler(range(N), num_replicas=2, rank=1, shuffle=True, seed=3)),
        ("dist-batch", lambda: BatchSampler(DistributedSampler(range(N), num_replicas=2, rank=1, seed=4), 32, True)),
    ]


@pytest.mark.parametrize("lookahead", [1, 3, None])
@pytest.mark.parametrize("name,make", _samplers())
def test_the_wrapped_order_never_changes(name, make, lookahead):
    for epoch in (0, 1):
        inner, ref = make(), make()
        for s in (inner, ref):
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
            elif hasattr(getattr(s, "sampler", None), "set_epoch"):
                s.sampler.set_epoch(epoch)
        store = _Recorder()
        wrapped = LookaheadSampler(inner, store, lookahead=lookahead)
        got = list(wrapped)
        assert got == list(ref)
        assert len(wrapped) == len(ref)
        flat = [i for b in got for i in (b if isinstance(b, list) else [b])]
        assert sorted(i for h in store.hints for i in h) == sorted(flat), "every index is hinted once"


def test_set_epoch_reaches_a_wrapped_distributed_sampler():
    inner = DistributedSampler(range(N), num_replicas=2, rank=0, seed=5)
    wrapped = LookaheadSampler(inner, _Recorder(), lookahead=2)
    wrapped.set_epoch(0)
    e0 = list(wrapped)
    wrapped.set_epoch(1)
    e1 = list(wrapped)
    ref = DistributedSampler(range(N), num_replicas=2, rank=0, seed=5)
    ref.set_epoch(1)
    assert e1 == list(ref) and e0 != e1


@pytest.mark.parametrize("k", [1, 4])
def test_each_batch_is_hinted_k_batches_before_it_is_yielded(k):
    store = _Recorder()
    batches = list(BatchSampler(range(N), 50, False))
    wrapped = LookaheadSampler(BatchSampler(range(N), 50, False), store, lookahead=k)
    for i, b in enumerate(wrapped):
        assert len(store.hints) == min(i + 1 + k, len(batches)), f"at batch {i}: {len(store.hints)} hints"
        assert store.hints[i] == b


def test_a_plain_sampler_is_hinted_in_groups_of_indices():
    store = _Recorder()
    order = list(range(N))
    assert list(LookaheadSampler(order, store, lookahead=1)) == order
    assert [len(h) for h in store.hints] == [256, 256, 256, N - 768]


def test_mid_epoch_resume_yields_the_rest_of_the_epoch():
    def make():
        s = DistributedSampler(range(N), num_replicas=2, rank=1, seed=6)
        return BatchSampler(s, 16, False)

    full = list(LookaheadSampler(make(), _Recorder(), lookahead=3))
    first = LookaheadSampler(make(), _Recorder(), lookahead=3)
    it = iter(first)
    seen = [next(it) for _ in range(7)]
    state = first.state_dict()
    assert state["yielded"] == 7
    resumed = LookaheadSampler(make(), _Recorder(), lookahead=3)
    resumed.load_state_dict(state)
    assert seen + list(resumed) == full
    assert list(resumed) == full, "only the iteration after load_state_dict skips"


def test_id_fn_maps_indices_to_store_ids():
    store = _Recorder()
    list(LookaheadSampler(BatchSampler(range(10), 5, False), store, lookahead=1, id_fn=lambda ix: ix * 100 + 7))
    assert store.hints == [[7, 107, 207, 307, 407], [507, 607, 707, 807, 907]]


def test_bad_arguments_are_named():
    with pytest.raises(InvalidArgumentError, match="lookahead=0"):
        LookaheadSampler(range(3), _Recorder(), lookahead=0)
    with pytest.raises(InvalidTypeError, match="store"):
        LookaheadSampler(range(3), object())
    with pytest.raises(InvalidTypeError, match="id_fn"):
        LookaheadSampler(range(3), _Recorder(), id_fn=3)
    with pytest.raises(InvalidArgumentError, match="yielded"):
        LookaheadSampler(range(3), _Recorder()).load_state_dict({"yielded": -1})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_real_dataloader_sees_the_same_batches_and_the_store_gets_the_rows(shm_path, num_workers):
    """In a DataLoader (workers or not, persistent over two epochs) the batches are the wrapped
    batch sampler's, and the disk-mode store's hints load rows that the step then finds hot."""
    dim = 8
    with EmbeddingStore.create(shm_path / "s", N, dim, chunk_rows=64) as s:
        s.update(torch.arange(N), torch.arange(N, dtype=torch.float32)[:, None].expand(N, dim).contiguous())
        s.flush()
    store = EmbeddingStore.open(shm_path / "s", hot_bytes=400 * (dim * 4 + 11))
    try:
        inner = BatchSampler(DistributedSampler(range(N), num_replicas=2, rank=0, seed=7), 25, False)
        ref = BatchSampler(DistributedSampler(range(N), num_replicas=2, rank=0, seed=7), 25, False)
        wrapped = LookaheadSampler(inner, store, lookahead=2)
        loader = DataLoader(_Indices(), batch_sampler=wrapped, num_workers=num_workers,
                            persistent_workers=num_workers > 0)
        for epoch in (0, 1):
            wrapped.set_epoch(epoch)
            ref.sampler.set_epoch(epoch)
            got = []
            for batch in loader:
                rows = store.get(batch)
                assert torch.equal(rows[:, 0], batch.float())
                got.append(batch.tolist())
            assert got == list(ref)
        st = store.stats()
        assert st.prefetched_rows > 0 and st.prefetch_hits + st.prefetch_misses == 2 * N // 2
    finally:
        store.close()
