"""A flush streams its dirty rows into the segment in blocks: each block gathered into one of two
buffers used in turn, checksummed, and written by the stream's one helper thread while the next
is gathered. Whatever the block size (blocks of one row, blocks cut at every chunk, one block
larger than the rest), rows updated while the flush is writing, evictions and reopens, every
flushed version holds exactly the rows of a tensor model, and a power cut at any file operation
of a flush leaves the last acknowledged version or the new one, with exactly its rows.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from _durability import PowerCutOracle
from _store_helpers import InlineExecutor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import disk as disk_mod
from lightning_embcache.store import fileio


def _inline_background(mp: pytest.MonkeyPatch) -> None:
    """Background compaction and write-back run inline (a failing example replays exactly); the
    flush's own block writer keeps its real helper thread: that is what is under test."""
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_embcache.store") and name != fileio.__name__ and hasattr(
                module, "ThreadPoolExecutor"):
            mp.setattr(module, "ThreadPoolExecutor", InlineExecutor)


class _FlushHooks(PowerCutOracle):
    """The power-cut oracle, plus: during the flush under test, an update of some of its rows
    before its ``mid``-th block write (from the writer thread), and a cut after its ``cut``-th
    file operation."""

    def __init__(self, root: Path, out: Path) -> None:
        super().__init__(root)
        self.out = out
        self.cuts: list[list] = []  # [folder, last acknowledged, the version after the flush]
        self.acked = 0
        self.flushing = False  # a flush under test is under way
        self.ops = 0
        self.cut: int | None = None
        self.mid: int | None = None
        self.mid_update = None  # called once, with no lock of the oracle held
        self.block_writes = 0
        self.writers: dict[str, set[int]] = {}  # segment -> threads that wrote it

    def before(self, op, name):
        if self.flushing and op == "write" and "segments" in str(name):
            self.block_writes += 1
            self.writers.setdefault(str(name), set()).add(threading.get_native_id())
            if self.block_writes == self.mid and self.mid_update is not None:
                fn, self.mid_update = self.mid_update, None
                fn()
        super().before(op, name)

    def after(self, op, name):
        super().after(op, name)
        if not self.flushing:
            return
        self.ops += 1
        if self.ops == self.cut and self.durable:
            with self.quiescent():
                dst = self.out / f"cut{len(self.cuts):03d}"
                self.reconstruct(dst)
                self.cuts.append([dst, self.acked, None])


def _rows_of(models: dict[int, torch.Tensor], v: int) -> torch.Tensor:
    """Version ``v``'s rows: those of the last flush at or before it (compaction's versions
    change no row)."""
    return models[max(k for k in models if k <= v)]


def _check_cuts(oracle: _FlushHooks, models: dict[int, torch.Tensor], n: int) -> None:
    for dst, acked, after in oracle.cuts:
        with EmbeddingStore.open(dst) as again:
            v = again.version
            assert acked <= v <= after, f"{dst.name}: reopened version {v}; acknowledged {acked}, then {after}"
            assert torch.equal(again.get(torch.arange(n)), _rows_of(models, v)), f"{dst.name}: version {v} has wrong rows"


ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 400), st.booleans(), st.integers(0, 2**31)),
        st.tuples(st.just("flush"), st.integers(0, 6), st.integers(0, 40), st.integers(0, 2**31)),
        st.tuples(st.just("reopen")),
    ),
    min_size=2,
    max_size=9,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    chunk=st.sampled_from([4, 16, 64]),
    dim=st.sampled_from([2, 8, 24]),
    n=st.integers(64, 1200),
    hot=st.sampled_from([None, 48, 400]),
    block_rows=st.integers(1, 150),
    threaded=st.booleans(),
    ops=ops_st,
)
def test_flushed_versions_hold_the_model_rows_whatever_the_blocks(chunk, dim, n, hot, block_rows, threaded, ops):
    rb = dim * 4
    tmp = Path(tempfile.mkdtemp(prefix="embcache-flushio-"))
    path = tmp / "s"
    oracle = _FlushHooks(path, tmp / "cuts")
    model = torch.zeros(n, dim)
    models = {0: model.clone()}
    try:
        with pytest.MonkeyPatch.context() as mp:
            _inline_background(mp)
            mp.setattr(disk_mod, "SEGMENT_BLOCK_BYTES", block_rows * rb)
            # 1 byte: every block goes through the helper thread; else every one is written here
            mp.setattr(fileio, "STREAM_THREAD_BYTES", 1 if threaded else 1 << 40)
            oracle.patch(mp)
            mp.setattr(fileio, "FAULTS", oracle)
            hot_bytes = None if hot is None else hot * (rb + 11)
            store = EmbeddingStore.create(path, n, dim, chunk_rows=chunk, hot_bytes=hot_bytes, init="zeros")
            try:
                for op in ops:
                    if op[0] == "update":
                        _, k, run, seed = op
                        rng = np.random.default_rng(seed)
                        k = min(k, n)
                        ids = (np.arange(k) + int(rng.integers(0, n - k + 1))) if run else rng.integers(0, n, k)
                        vals = torch.from_numpy(rng.standard_normal((k, dim)).astype(np.float32))
                        store.update(torch.from_numpy(ids), vals)
                        for i, row in enumerate(ids.tolist()):  # duplicates: the last wins
                            model[row] = vals[i]
                    elif op[0] == "flush":
                        _, mid, cut, seed = op
                        late = _late_update(store, np.random.default_rng(seed), n, dim)
                        oracle.mid, oracle.cut, oracle.ops, oracle.block_writes = mid or None, cut or None, 0, 0
                        oracle.mid_update = late.apply
                        oracle.flushing = True
                        try:
                            v = store.flush()
                        finally:
                            oracle.flushing = False
                        models[v] = model.clone()  # the rows as they were when the flush began
                        oracle.acked = v
                        for cut in oracle.cuts:
                            cut[2] = store.version if cut[2] is None else cut[2]
                        if late.applied:  # updated while the flush wrote: in the next version only
                            model[torch.from_numpy(late.ids)] = late.vals
                        for seg, threads in oracle.writers.items():  # one helper, and the header's writer
                            assert len(threads) <= 2, f"{seg}: written by {len(threads)} threads"
                        oracle.writers.clear()
                    else:
                        store.close()
                        store = EmbeddingStore.open(path)
                        model = models[oracle.acked].clone()  # unflushed updates are discarded
                        assert torch.equal(store.get(torch.arange(n)), model)
                    assert torch.equal(store.get(torch.arange(n)), model)
            finally:
                store.close()
        assert oracle.violations == [], "\n".join(oracle.violations[:5])
        with EmbeddingStore.open(path) as again:
            assert again.version >= oracle.acked
            assert torch.equal(again.get(torch.arange(n)), _rows_of(models, again.version))
        _check_cuts(oracle, models, n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _late_update:  # noqa: N801 - a small record with one action
    """Rows updated from the writer thread in the middle of a flush (a copy-on-write case)."""

    def __init__(self, store: EmbeddingStore, rng: np.random.Generator, n: int, dim: int) -> None:
        self.store = store
        self.ids = np.unique(rng.integers(0, n, int(rng.integers(1, 20))))
        self.vals = torch.from_numpy(rng.standard_normal((len(self.ids), dim)).astype(np.float32))
        self.applied = False

    def apply(self) -> None:
        self.store.update(torch.from_numpy(self.ids), self.vals)
        self.applied = True


def test_a_large_flush_writes_every_block_on_one_helper_thread(tmp_path, monkeypatch):
    """Not a thread per block: the blocks of one segment share one writer thread."""
    threads: list[int] = []

    class _Seen:
        def before(self, op, name):
            if op == "write" and "segments" in str(name):
                threads.append(threading.get_native_id())

        def after(self, op, name):
            pass

    n, dim = 40_000, 64  # 10 MiB: several blocks of SEGMENT_BLOCK_BYTES
    with EmbeddingStore.create(tmp_path / "s", n, dim, chunk_rows=1024) as s:
        vals = torch.randn(n, dim)
        s.update(torch.arange(n), vals)
        monkeypatch.setattr(fileio, "FAULTS", _Seen())
        s.flush()
        monkeypatch.setattr(fileio, "FAULTS", None)
    body = threads[:-1]  # the header is written last, by the flushing thread
    assert len(body) >= 3
    assert threading.get_native_id() not in body
    assert len(set(body)) == 1, f"the segment's {len(body)} blocks were written by {len(set(body))} threads"
    with EmbeddingStore.open(tmp_path / "s") as s:
        assert torch.equal(s.get(torch.arange(n)), vals)
