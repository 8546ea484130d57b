"""The store behaves like a plain tensor (one per field) over any sequence of operations.

A hypothesis state machine drives get/update/flush/evict/set_budget/close+reopen/open-an-earlier-
version/compact/pin against a model that is nothing but torch tensors and a dict of snapshots,
one per flushed version. Each configuration below runs the same machine: memory mode with and
without a path, disk mode with a hot tier of a few rows (with and without a warm tier and LZ4),
the three kinds of init, and extra per-row fields.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
import torch
from _store_helpers import InlineExecutor, assert_bitwise_equal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lightning_embcache import EmbeddingStore

N, DIM, CHUNK = 50, 4, 8  # 7 chunks, the last one short (2 rows)
SLOT_OVERHEAD = 11  # bytes of bookkeeping per hot slot, documented in the hot budget
FIELDS = {"m": (torch.float32, 4), "n": (torch.int32, 1)}
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


@pytest.fixture(autouse=True)
def _inline_background(monkeypatch):
    """Background compaction, GC, write-back and prefetch run inline, so every example replays exactly."""
    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_embcache.store") and hasattr(module, "ThreadPoolExecutor"):
            monkeypatch.setattr(module, "ThreadPoolExecutor", InlineExecutor)
            patched += 1
    assert patched, "the store no longer uses ThreadPoolExecutor: update this fixture"


def ramp_init(ids: torch.Tensor) -> torch.Tensor:
    return ids.to(torch.float32)[:, None] * 0.5 + torch.arange(DIM, dtype=torch.float32) * 0.25


def row_bytes(dtype: torch.dtype, fields: dict | None) -> int:
    n = DIM * dtype.itemsize
    for fdtype, cols in (fields or {}).values():
        n = (n + fdtype.itemsize - 1) // fdtype.itemsize * fdtype.itemsize + cols * fdtype.itemsize
    return (n + 7) // 8 * 8 if fields else n


def initial_model(dtype, fields, init, seed) -> dict[str, torch.Tensor]:
    if init == "zeros":
        w = torch.zeros(N, DIM, dtype=dtype)
    elif init == "callable":
        w = ramp_init(torch.arange(N)).to(dtype)
    else:
        # "normal" rows depend only on (seed, id): read them from an independent in-memory store
        # in one whole-table read and require the store under test to agree, row by row, whatever
        # order and batching it sees, before and after reopen.
        with EmbeddingStore.create(None, N, DIM, dtype=dtype, chunk_rows=CHUNK, init="normal", seed=seed) as ref:
            w = ref.get(torch.arange(N))
        f = w.float()
        assert 0.5 < float(f.std()) < 1.5 and abs(float(f.mean())) < 0.5, "init='normal' is not N(0, 1)"
    model = {"weight": w}
    for name, (fdtype, cols) in (fields or {}).items():
        model[name] = torch.zeros(N, cols, dtype=fdtype)
    return model


def make_values(seed: int, n: int, dtype: torch.dtype, cols: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if dtype.is_floating_point:
        # multiples of 1/4 are exact in every float dtype and repeat, so LZ4 chunks compress
        return torch.from_numpy(rng.integers(-8, 8, (n, cols)) / 4.0).to(dtype)
    info = torch.iinfo(dtype)
    return torch.from_numpy(rng.integers(info.min, info.max, (n, cols), endpoint=True)).to(dtype)


ids_st = st.lists(st.integers(0, N - 1), min_size=0, max_size=12) | st.lists(
    st.integers(0, N - 1), min_size=13, max_size=40
)


def make_machine(*, path: bool, hot_rows: int | None, warm_chunks: int = 0, compression=None,
                 init="zeros", fields=None, dtype=torch.float32):
    rb = row_bytes(dtype, fields)
    hot_bytes = None if hot_rows is None else hot_rows * (rb + SLOT_OVERHEAD)
    warm_bytes = warm_chunks * CHUNK * rb
    names = ("weight", *(fields or {}))
    seed = 1234

    class StoreMachine(RuleBasedStateMachine):
        @initialize()
        def create(self):
            self.dir = tempfile.mkdtemp(prefix="embcache-sm-", dir=SHM) if path else None
            self.path = f"{self.dir}/store" if path else None
            self.store = EmbeddingStore.create(
                self.path, N, DIM, dtype=dtype, chunk_rows=CHUNK, hot_bytes=hot_bytes, warm_bytes=warm_bytes,
                compression=compression, init=ramp_init if init == "callable" else init, seed=seed, fields=fields,
            )
            self.model = initial_model(dtype, fields, init, seed)
            self.snapshots = {0: {k: v.clone() for k, v in self.model.items()}}
            self.version = 0
            self.dirty = False
            self.pins: set[int] = set()
            self.compact_called = False

        def teardown(self):
            store = getattr(self, "store", None)
            if store is not None:
                store.close()
            if getattr(self, "dir", None):
                shutil.rmtree(self.dir, ignore_errors=True)

        # ---- reads and writes ---------------------------------------------------------------
        @rule(ids=ids_st)
        def get(self, ids):
            got = self.store.get(torch.tensor(ids, dtype=torch.int64))
            assert_bitwise_equal(got, self.model["weight"][ids], f"get({ids})")
            if len(ids):  # a fresh copy: scribbling on it changes nothing stored
                got.fill_(3)
                assert_bitwise_equal(self.store.get([ids[0]]), self.model["weight"][ids[:1]], "get after scribble")

        @precondition(lambda self: len(names) > 1)
        @rule(ids=ids_st, data=st.data())
        def get_fields(self, ids, data):
            which = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
            got = self.store.get_fields(np.array(ids, dtype=np.int64), which)
            assert set(got) == set(which)
            for name in which:
                assert_bitwise_equal(got[name], self.model[name][ids], f"get_fields({ids})[{name!r}]")

        def _apply(self, ids, values):
            for name, v in values.items():
                for i, row in enumerate(ids):  # sequentially: of duplicate ids the last one wins
                    self.model[name][row] = v[i]
            self.dirty = self.dirty or bool(len(ids))

        @rule(ids=ids_st, vseed=st.integers(0, 2**32 - 1))
        def update(self, ids, vseed):
            values = make_values(vseed, len(ids), dtype, DIM)
            self.store.update(torch.tensor(ids, dtype=torch.int64), values)
            self._apply(ids, {"weight": values})

        @precondition(lambda self: len(names) > 1)
        @rule(ids=ids_st, vseed=st.integers(0, 2**32 - 1), data=st.data())
        def update_fields(self, ids, vseed, data):
            which = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
            specs = {"weight": (dtype, DIM), **(fields or {})}
            values = {n: make_values(vseed + i, len(ids), *specs[n]) for i, n in enumerate(which)}
            self.store.update_fields(ids, values)
            self._apply(ids, values)

        # ---- durability and versions --------------------------------------------------------
        def _follow_compaction(self):
            """A compaction may publish its layout as a new version holding the same rows."""
            now = self.store.version
            if now != self.version:
                assert now > max(self.snapshots), f"version moved {self.version} -> {now}, not to a new number"
                self.snapshots[now] = self.snapshots[self.version]
                self.version = now

        @rule()
        def flush(self):
            v = self.store.flush()
            if self.dirty:
                assert v > max(self.snapshots), f"flush of new updates returned version {v}, already used"
            elif self.compact_called and v != self.version:
                # compact() since the last flush: its layout is published (same rows, new version)
                assert v > max(self.snapshots), f"flush of a compaction returned version {v}, already used"
            else:
                assert v == self.version, f"flush with nothing new moved version {self.version} -> {v}"
            self.compact_called = False
            self.snapshots[v] = {k: t.clone() for k, t in self.model.items()}
            self.version = v
            self.dirty = False
            self._follow_compaction()

        def _open(self, version=None, readonly=False):
            return EmbeddingStore.open(self.path, version=version, readonly=readonly, hot_bytes=hot_bytes,
                                       warm_bytes=warm_bytes, init=ramp_init if init == "callable" else None)

        @precondition(lambda self: path)
        @rule()
        def close_and_reopen(self):
            self.store.close()
            self.store = None
            self.store = self._open()
            self.compact_called = False
            latest = max(self.snapshots)  # unflushed updates are gone; the newest version is back
            assert self.store.version == latest
            assert self.store.pinned() == sorted(self.pins)
            self.model = {k: t.clone() for k, t in self.snapshots[latest].items()}
            self.version = latest
            self.dirty = False

        def _retained(self):
            have = self.store.versions()
            assert max(self.snapshots) in have, f"latest version {max(self.snapshots)} missing from {have}"
            assert self.pins <= set(have), f"pinned {sorted(self.pins)} not all retained: {have}"
            assert set(have) <= set(self.snapshots), f"versions() lists {have}; flushed: {sorted(self.snapshots)}"
            return sorted(have)

        @precondition(lambda self: path)
        @rule(data=st.data())
        def open_retained_version(self, data):
            v = data.draw(st.sampled_from(self._retained()))
            self.store.close()
            self.store = None
            self.store = self._open(version=v)
            self.compact_called = False
            assert self.store.version == v
            self.model = {k: t.clone() for k, t in self.snapshots[v].items()}
            self.version = v
            self.dirty = False
            # the whole table, not just the rows the machine happens to read next
            for name in names:
                got = self.store.get_fields(torch.arange(N), (name,))[name]
                assert_bitwise_equal(got, self.model[name], f"version {v} field {name!r}")

        @precondition(lambda self: path)
        @rule(data=st.data())
        def readonly_handle_beside_writer(self, data):
            v = data.draw(st.sampled_from(self._retained()))
            with self._open(version=v, readonly=True) as reader:
                got = reader.get_fields(torch.arange(N), names)
            for name in names:
                assert_bitwise_equal(got[name], self.snapshots[v][name], f"readonly version {v} field {name!r}")

        @precondition(lambda self: path)
        @rule()
        def compact(self):
            self.store.compact()
            self.compact_called = True
            self._follow_compaction()

        @precondition(lambda self: path)
        @rule(data=st.data())
        def pin(self, data):
            v = data.draw(st.sampled_from(self._retained()))
            self.store.pin(v)
            self.pins.add(v)

        @precondition(lambda self: path and self.pins)
        @rule(data=st.data())
        def unpin(self, data):
            v = data.draw(st.sampled_from(sorted(self.pins)))
            self.store.unpin(v)
            self.pins.discard(v)

        # ---- memory -------------------------------------------------------------------------
        @rule(nbytes=st.integers(0, 4 * CHUNK * rb))
        def evict(self, nbytes):
            freed = self.store.evict(nbytes)
            assert isinstance(freed, int) and freed >= 0

        @rule(hot=st.integers(1, max(hot_rows or 0, 3 * CHUNK)), warm=st.integers(0, max(warm_chunks, 1) * CHUNK))
        def set_budget(self, hot, warm):
            self.store.set_budget(hot_bytes=hot * (rb + SLOT_OVERHEAD), warm_bytes=warm * rb)

        @invariant()
        def within_budgets(self):
            store = getattr(self, "store", None)
            if store is None:
                return
            s = store.stats()
            assert s.warm_bytes <= s.warm_budget_bytes, f"warm tier {s.warm_bytes} B over its budget {s.warm_budget_bytes}"
            if hot_rows is not None:
                assert s.hot_bytes <= s.hot_budget_bytes, f"hot tier {s.hot_bytes} B over its budget {s.hot_budget_bytes}"

    return StoreMachine


FAST = settings(max_examples=30, stateful_step_count=30, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
SLOW = settings(max_examples=400, stateful_step_count=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

CONFIGS = {
    "MemoryNoPath": dict(path=False, hot_rows=None),
    "MemoryWithPath": dict(path=True, hot_rows=None),
    "MemoryWithPathNormalLz4Fields": dict(path=True, hot_rows=None, compression="lz4", init="normal", fields=FIELDS),
    "DiskTinyHot": dict(path=True, hot_rows=4),
    "DiskTinyHotWarmLz4Normal": dict(path=True, hot_rows=4, warm_chunks=2, compression="lz4", init="normal"),
    "DiskTinyHotWarmCallableFields": dict(path=True, hot_rows=5, warm_chunks=2, init="callable", fields=FIELDS),
    "DiskTinyHotBfloat16Lz4Fields": dict(path=True, hot_rows=3, warm_chunks=1, compression="lz4",
                                         init="callable", fields=FIELDS, dtype=torch.bfloat16),
    "DiskNoPathNormal": dict(path=False, hot_rows=4, warm_chunks=1, init="normal"),
}

for _name, _cfg in CONFIGS.items():
    _fast = make_machine(**_cfg).TestCase
    _fast.settings = FAST
    globals()[f"TestStoreMatchesTensorModel{_name}"] = _fast
    _slow = type(f"TestStoreMatchesTensorModel{_name}Slow", (make_machine(**_cfg).TestCase,), {"settings": SLOW})
    globals()[_slow.__name__] = pytest.mark.slow(_slow)
del _name, _cfg, _fast, _slow
