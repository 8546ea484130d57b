"""The warm tier keeps raw chunks in the slots of one slab: a batch whose rows all lie in chunks held
there is one gather (no plan below the hot tier), a plan holding several warm copies at once reads
each as it was, and the slab's pages stay within the warm budget."""

from __future__ import annotations

import lz4.block
import numpy as np
import pytest
import torch
from _store_helpers import assert_bitwise_equal, compacted_store
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler

from lightning_embcache import ChunkShuffleSampler, EmbeddingStore, LookaheadSampler
from lightning_embcache.store import tiers
from lightning_embcache.store.warm import LATELY, WarmTier

DIM = 16
ROW = DIM * 4


def _count_plans(monkeypatch) -> list:
    calls: list = []
    real = tiers.Tiers.plan_below
    monkeypatch.setattr(tiers.Tiers, "plan_below", lambda self, ids: (calls.append(len(ids)), real(self, ids))[1])
    return calls


def test_training_in_chunk_order_reads_warm_rows_in_one_gather(shm_path, monkeypatch):
    """Two epochs of get, update, flush in ChunkShuffleSampler order with lookahead: every get
    matches a tensor model (updated rows hot and dirty, written back and flushed, their warm
    copies patched), and once a window's chunks are warm its batches make no plan below the hot
    tier; the flushed rows read back after reopening."""
    n, chunk, window, bsz = 8192, 256, 4, 64
    model = compacted_store(shm_path / "s", n, DIM, chunk).clone()
    plans = _count_plans(monkeypatch)
    opts = dict(hot_bytes=n * (ROW + 11) // 8, warm_bytes=2 * window * chunk * ROW)
    with EmbeddingStore.open(shm_path / "s", **opts) as s:
        sampler = ChunkShuffleSampler(n, chunk_rows=chunk, window=window, seed=3)
        batches = LookaheadSampler(BatchSampler(sampler, bsz, drop_last=False), s, lookahead=4)
        for epoch in range(2):  # the second over rows written back, flushed and compacted
            sampler.set_epoch(epoch)
            for k, batch in enumerate(batches):
                ids = torch.as_tensor(batch)
                x = s.get(ids)
                assert_bitwise_equal(x, model[ids], f"epoch {epoch} batch {k}")
                s.update(ids, x + 1)
                model[ids] += 1
                if k % 16 == 15:
                    s.flush()
            if epoch == 0:
                s.compact()
        s.flush()
        assert s._tiers.warm.slab is not None and s._tiers.warm.slab.placed_bytes > 0
    assert len(plans) < 2 * (n // bsz) // 4, f"{len(plans)} of {2 * n // bsz} batches planned a read below the hot tier"
    with EmbeddingStore.open(shm_path / "s", **opts) as s:
        assert_bitwise_equal(s.get(torch.arange(n)), model)


def _packable_store(path, n: int, chunk: int) -> torch.Tensor:
    """A compacted store whose rows LZ4 packs (row i is i everywhere); returns the rows."""
    return compacted_store(path, n, DIM, chunk, table=torch.arange(n, dtype=torch.float32)[:, None].expand(n, DIM).contiguous())


def test_a_plan_holding_several_warm_copies_reads_each_as_it_was(shm_path):
    """Rows that compress are held LZ4-packed with raw copies of the latest chunks only; a get
    wanting rows of many of them decompresses each into the slab while the plan still holds the
    copies it took before. A slot freed by one of those is not reused until the read ends (it
    would overwrite rows the plan has yet to read)."""
    n, chunk = 4096, 64  # 64 rows of 64 bytes: one 4 KiB page per chunk
    table = _packable_store(shm_path / "s", n, chunk)
    raw = chunk * ROW
    packed = len(lz4.block.compress(table[:chunk].numpy().tobytes(), store_size=False))
    assert packed * 4 < raw
    with EmbeddingStore.open(shm_path / "s", hot_bytes=256 * (ROW + 11), warm_bytes=3 * raw) as s:
        for c in range(12):  # each read whole, kept packed; raw copies of the last ones only
            ids = torch.arange(c * chunk, (c + 1) * chunk)
            assert_bitwise_equal(s.get(ids), table[ids])
        held = s._tiers.warm.chunks().tolist()
        assert len(held) > 3, held
        ids = torch.cat([torch.arange(c * chunk, c * chunk + 40) for c in held])  # 40 of 64 rows each
        assert_bitwise_equal(s.get(ids), table[ids])
        assert s.stats().cold_reads == 12  # every chunk came from its warm copy


def test_a_read_right_after_a_budget_change_reads_each_warm_copy_as_it_was(shm_path):
    """A new warm budget makes a new slab at the next raw chunk; a plan pinned before that slab
    existed still holds its slots: two packed chunks decompressed by one get into a slab of one
    slot each read as they were."""
    n, chunk = 1024, 64
    table = _packable_store(shm_path / "s", n, chunk)
    raw = chunk * ROW
    with EmbeddingStore.open(shm_path / "s", hot_bytes=8 * (ROW + 11), warm_bytes=4 * raw) as s:
        for c in range(4):
            s.get(torch.arange(c * chunk, (c + 1) * chunk))
        s.set_budget(warm_bytes=raw + raw // 2)  # the slab goes; the packed chunks stay
        assert s._tiers.warm.slab is None and len(s._tiers.warm) >= 2
        held = s._tiers.warm.chunks().tolist()[:2]
        ids = torch.cat([torch.arange(c * chunk, c * chunk + 40) for c in held])
        assert_bitwise_equal(s.get(ids), table[ids])


# ---- the warm tier against a dict of chunks ----------------------------------------------------
CR, RB, NCH = 16, 256, 10  # 4 KiB chunks: one page each, so the slab's pages can be given back


def _records(kind: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == 0:  # incompressible
        return rng.integers(0, 256, (CR, RB), dtype=np.uint8)
    return np.repeat(rng.integers(0, 256, (CR, 1), dtype=np.uint8), RB, axis=1)  # LZ4 packs it


_op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, NCH - 1), st.integers(0, 1), st.integers(0, 10**6)),
    st.tuples(st.just("get"), st.integers(0, NCH - 1)),
    st.tuples(st.just("discard"), st.integers(0, NCH - 1)),
    st.tuples(st.just("patch"), st.integers(0, NCH - 1), st.integers(0, 10**6)),
    st.tuples(st.just("shrink"), st.integers(0, 6 * CR * RB)),
    st.tuples(st.just("budget"), st.integers(0, 8 * CR * RB)),
    st.tuples(st.just("pin"),),
    st.tuples(st.just("unpin"),),
    st.tuples(st.just("rows_of"), st.lists(st.integers(0, NCH * CR - 1), min_size=1, max_size=20)),
    # a chunk read ahead into a reserved slot (chunkload.py), then adopted or given up
    st.tuples(st.just("reserve"), st.integers(0, NCH - 1), st.integers(0, 10**6)),
    st.tuples(st.just("finish"), st.integers(0, 10**6), st.booleans()),
)


@settings(max_examples=200, deadline=None)
@given(st.integers(CR * RB, 6 * CR * RB), st.lists(_op, max_size=60))
# a budget of one raw chunk: a packed chunk's decompressed copy has no room beside it, and its
# slot, given up at once, was given back to the system under the records just returned
@example(budget=CR * RB, ops=[("put", 0, 1, 0), ("get", 0)])
def test_the_warm_tier_returns_what_it_was_given_within_its_budget(budget, ops):
    warm = WarmTier(budget, CR, RB, NCH)
    model: dict[int, np.ndarray] = {}  # what each chunk held would return
    pins: list = []  # (slab, [(view, its bytes when taken)]) of each open pin
    loading: dict[int, np.ndarray] = {}  # chunk -> records written into its reserved slot
    for op in ops:
        kind = op[0]
        if kind == "put":
            recs = _records(op[2], op[3])
            warm.put(op[1], recs.copy())
            model[op[1]] = recs
        elif kind == "get":
            got = warm.get(op[1])
            if got is not None:
                assert np.array_equal(got.reshape(CR, RB), model[op[1]])
                for views in pins:
                    views.append((got, got.copy()))
        elif kind == "discard":
            warm.discard(op[1])
        elif kind == "patch":
            rng = np.random.default_rng(op[2])
            local = np.sort(rng.choice(CR, 3, replace=False))
            recs = rng.integers(0, 256, (3, RB), dtype=np.uint8)
            if not warm.patch(op[1], local, recs):
                warm.discard(op[1])  # as the store does with a chunk held packed
            elif op[1] in model:
                model[op[1]] = model[op[1]].copy()
                model[op[1]][local] = recs
        elif kind == "shrink":
            warm.shrink(op[1])
        elif kind == "reserve":
            served = [c for c in model if warm._stamp.get(c, 0) > warm._clock - LATELY]  # in use: not dropped
            flat = warm.reserve(op[1], CR * RB)
            if flat is not None:
                assert op[1] not in loading
                recs = _records(0, op[2])
                flat[:] = recs.reshape(-1)  # what the kernel writes
                loading[op[1]] = recs
                assert all(c in warm for c in served), "a chunk in use was dropped for a read ahead"
        elif kind == "finish" and loading:
            c = sorted(loading)[op[1] % len(loading)]
            recs = loading.pop(c)
            if op[2]:
                warm.adopt(c)
                model[c] = recs
                assert np.array_equal(warm.get(c).reshape(CR, RB), recs)
            else:
                warm.unreserve(c)
        elif kind == "budget" and not pins:  # (the store changes budgets under its lock only)
            for c in list(loading):  # (and waits for its reads ahead first)
                warm.unreserve(c)
                del loading[c]
            warm.budget = op[1]
            warm.shrink(warm.budget)
        elif kind == "pin":
            warm.pin()
            pins.append([])
        elif kind == "unpin" and pins:
            for view, was in pins.pop():  # nothing handed out while pinned moved
                assert np.array_equal(view, was)
            warm.unpin()
        elif kind == "rows_of":
            ids = np.asarray(op[1])
            rows = warm.rows_of(ids // CR, ids % CR)
            if rows is not None:
                want = np.stack([model[i // CR][i % CR] for i in ids.tolist()])
                assert np.array_equal(warm.slab.rows[rows], want)
        for c in list(model):
            if c not in warm:
                del model[c]
        assert warm.nbytes <= warm.budget
        slab = warm.slab
        if slab is not None and not pins:
            outside = warm.nbytes - slab.placed_bytes - warm._loading_bytes
            assert outside + slab.touched_bytes <= warm.budget, "the slab keeps pages beyond the budget"


@pytest.mark.parametrize("budget, chunks", [(25 << 30, NCH), (1 << 50, 1 << 20), (1 << 62, 1 << 40)])
def test_a_warm_budget_beyond_this_machine_still_holds_chunks(budget, chunks):
    """A budget is an upper bound: the slab reserves no memory for it (slots beyond the table's
    chunks are never made), and where even its address space cannot be had the chunks are kept
    as arrays of their own."""
    warm = WarmTier(budget, CR, RB, chunks)
    for c in range(3):
        warm.put(c, _records(0, c))
    for c in range(3):
        assert np.array_equal(warm.get(c).reshape(CR, RB), _records(0, c))


def test_shrinking_the_warm_tier_gives_the_slab_pages_back():
    warm = WarmTier(8 * CR * RB, CR, RB, NCH)
    for c in range(8):
        warm.put(c, _records(0, c))
    assert warm.slab.touched_bytes == 8 * CR * RB
    warm.shrink(2 * CR * RB)
    assert warm.nbytes <= 2 * CR * RB and warm.slab.touched_bytes <= 2 * CR * RB


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
