"""`EmbeddingStore.grow`: more rows, the old ones kept bit for bit, the new ones as a store created
at the new size holds them; durable with the next flush; older versions keep their size.

References: a plain tensor per field for the rows written, and a store created at the new size
directly (in memory) for the rows never written.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from _store_helpers import InlineExecutor, assert_bitwise_equal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from lightning_embcache import EmbeddingStore
from lightning_embcache.store.errors import InvalidArgumentError, InvalidTypeError, ReadOnlyError, StoreError
from lightning_embcache.store.validate import MAX_ROWS
from lightning_embcache.tools import inspect_store, verify_store

N, DIM, CHUNK = 50, 4, 8  # 7 chunks, the last one short (2 rows): growing fills it first
FIELDS = {"m": (torch.float32, 3), "n": (torch.int32, 1, 7)}  # a moment, and a field with a fill
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
HOT = 6 * (48 + 11)  # disk mode: 6 of the table's rows in the hot tier (48-byte records)


def ramp(ids: torch.Tensor) -> torch.Tensor:
    return ids.to(torch.float32)[:, None] * 0.5 + torch.arange(DIM, dtype=torch.float32) * 0.25


INITS = {"zeros": "zeros", "normal": "normal", "callable": ramp}
MODES = {"memory": None, "disk": HOT}


def created_at(num_rows: int, init: str, seed: int = 5) -> dict[str, torch.Tensor]:
    """Every field of a store created at ``num_rows`` rows directly: what never-written rows hold."""
    with EmbeddingStore.create(None, num_rows, DIM, chunk_rows=CHUNK, init=INITS[init], seed=seed,
                               fields=FIELDS) as ref:
        return ref.get_fields(torch.arange(num_rows), ("weight", "m", "n"))


def fields_of(store: EmbeddingStore) -> dict[str, torch.Tensor]:
    return store.get_fields(torch.arange(store.num_rows), ("weight", "m", "n"))


def make(path: Path | None, init: str, hot: int | None, num_rows: int = N) -> EmbeddingStore:
    return EmbeddingStore.create(path, num_rows, DIM, chunk_rows=CHUNK, hot_bytes=hot, init=INITS[init], seed=5,
                                 fields=FIELDS)


def reopen(path: Path, init: str, hot: int | None, **kw) -> EmbeddingStore:
    return EmbeddingStore.open(path, hot_bytes=hot, init=ramp if init == "callable" else None, **kw)


def write(store: EmbeddingStore, model: dict[str, torch.Tensor], ids: list[int], value: float) -> None:
    idx = torch.tensor(ids, dtype=torch.int64)
    vals = {"weight": torch.full((len(ids), DIM), value), "m": torch.full((len(ids), 3), -value),
            "n": torch.full((len(ids), 1), int(value), dtype=torch.int32)}
    store.update_fields(idx, vals)
    for k, v in vals.items():
        model[k][idx] = v


def assert_rows(store: EmbeddingStore, model: dict[str, torch.Tensor], what: str) -> None:
    assert store.num_rows == len(model["weight"]), f"{what}: {store.num_rows} rows, expected {len(model['weight'])}"
    got = fields_of(store)
    for k in model:
        assert_bitwise_equal(got[k], model[k], f"{what}: field {k!r}")


def grown(model: dict[str, torch.Tensor], num_rows: int, init: str) -> dict[str, torch.Tensor]:
    """The model at ``num_rows`` rows: its rows, then those of a store created at that size."""
    fresh = created_at(num_rows, init)
    return {k: torch.cat([v, fresh[k][len(v):]]) for k, v in model.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("init", INITS)
def test_grow_keeps_rows_and_new_rows_match_a_store_created_at_the_new_size(shm_path, mode, init):
    hot = MODES[mode]
    store = make(shm_path / "s", init, hot)
    model = created_at(N, init)
    write(store, model, [0, 9, 17, 48, 49], 2.0)
    store.flush()
    store.compact()  # base chunk files, the short last one among them
    write(store, model, [3, 17, 49], 3.0)  # unflushed, and in the short last chunk
    assert_rows(store, model, "before grow")
    store.grow(61)
    model = grown(model, 61, init)
    assert store.num_rows == 61
    assert_rows(store, model, "after grow")
    write(store, model, [50, 60, 1], 4.0)  # new ids are ordinary rows
    assert_rows(store, model, "written after grow")
    store.grow(200)  # twice, without a flush between
    model = grown(model, 200, init)
    assert_rows(store, model, "grown twice")
    store.flush()
    store.compact()
    assert_rows(store, model, "flushed and compacted")
    store.close()
    with reopen(shm_path / "s", init, hot) as again:
        assert_rows(again, model, "reopened")


@pytest.mark.parametrize("hot", [None, HOT], ids=["memory", "disk"])
def test_grow_of_a_store_without_a_path(hot):
    store = make(None, "normal", hot)
    model = created_at(N, "normal")
    write(store, model, [1, 49], 2.0)
    store.flush()
    write(store, model, [2], 5.0)
    store.grow(N + CHUNK * 3)
    model = grown(model, N + CHUNK * 3, "normal")
    assert_rows(store, model, "grown in memory")
    store.close()


def test_grown_size_is_durable_with_the_next_flush(shm_path):
    path = shm_path / "s"
    store = make(path, "normal", None)
    model = created_at(N, "normal")
    write(store, model, [4, 49], 2.0)
    v1 = store.flush()
    store.grow(70)
    store.close()  # not flushed: the growth is gone with the unflushed rows
    with reopen(path, "normal", None) as store:
        assert store.version == v1
        assert_rows(store, model, "growth not flushed")
        store.grow(70)
        write(store, model := grown(model, 70, "normal"), [69], 6.0)
        v2 = store.flush()
    with reopen(path, "normal", None) as store:
        assert store.version == v2
        assert_rows(store, model, "growth flushed")


def test_a_version_before_the_growth_opens_at_its_size(shm_path):
    path = shm_path / "s"
    store = make(path, "zeros", HOT)
    model = created_at(N, "zeros")
    write(store, model, [0, 48], 1.0)
    v1 = store.flush()
    store.pin(v1)  # a checkpoint's version
    store.compact()
    store.grow(90)
    write(store, model2 := grown(model, 90, "zeros"), [48, 80], 2.0)
    v2 = store.flush()
    store.compact()  # must not repoint v1 to the grown layout
    with reopen(path, "zeros", HOT, version=v1, readonly=True) as old:
        assert_rows(old, model, "pinned version before the growth")
        with pytest.raises(InvalidArgumentError, match=r"ids must be in \[0, 50\)"):
            old.get(torch.tensor([60]))
        out = old.export(shm_path / "old.npy")
        assert np.load(out).shape == (N, DIM)
    with reopen(path, "zeros", HOT, version=v2, readonly=True) as new:
        assert_rows(new, model2, "version after the growth")
    store.close()
    report = verify_store(path)  # every retained version read at its own size
    assert report.ok and {v.version for v in report.versions} == {v1, v2}, report.as_dict()
    assert inspect_store(path)["rows"] == 90
    with reopen(path, "zeros", HOT, version=v1) as writer:  # a writer back at the old version
        assert_rows(writer, model, "writer reopened before the growth")


@pytest.mark.parametrize("hot", [None, HOT], ids=["memory", "disk"])
def test_growth_killed_before_its_flush_reopens_the_old_size(shm_path, hot):
    """A process that grew the table (and wrote new rows, some written back to disk) and was
    SIGKILLed before flushing leaves the store at its last flush, old size."""
    path = shm_path / "s"
    code = f"""
import os, signal, torch
from lightning_embcache import EmbeddingStore
s = EmbeddingStore.create({str(path)!r}, {N}, {DIM}, chunk_rows={CHUNK}, hot_bytes={hot}, init="normal", seed=5)
s.update(torch.arange(0, {N}, 3), torch.ones(17, {DIM}))
s.flush()
s.compact()
s.grow(500)
s.update(torch.arange(0, 500, 2), torch.full((250, {DIM}), 7.0))
print("grown", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL and "grown" in proc.stdout, proc.stderr
    want = created_at(N, "normal")["weight"]
    want[torch.arange(0, N, 3)] = 1.0
    with EmbeddingStore.open(path, hot_bytes=hot) as store:
        assert store.num_rows == N
        assert_bitwise_equal(store.get(torch.arange(N)), want, "after the kill")
        store.grow(60)  # and it grows again from there
        store.flush()


def files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
            and p.name != "LOCK"}


@pytest.mark.parametrize(
    ("num_rows", "error", "match"),
    [
        (N - 1, InvalidArgumentError, rf"num_rows must be in \[{N}, {MAX_ROWS}\]; got {N - 1}.*never shrinks"),
        (0, InvalidArgumentError, rf"num_rows must be in \[{N}, {MAX_ROWS}\]; got 0"),
        (-5, InvalidArgumentError, r"num_rows must be in \[50, "),
        (MAX_ROWS + 1, InvalidArgumentError, rf"num_rows must be in \[{N}, {MAX_ROWS}\] \(the id limit\)"),
        (60.0, InvalidTypeError, r"num_rows must be an int; got float 60.0"),
        (True, InvalidTypeError, r"num_rows must be an int; got bool"),
        ("60", InvalidTypeError, r"num_rows must be an int; got str"),
        (None, InvalidTypeError, r"num_rows must be an int; got NoneType"),
    ],
)
def test_grow_refuses_bad_num_rows_and_changes_nothing(shm_path, num_rows, error, match):
    path = shm_path / "s"
    store = make(path, "normal", HOT)
    model = created_at(N, "normal")
    write(store, model, [1, 2, 49], 2.0)
    v = store.flush()
    write(store, model, [3], 4.0)
    files, dirty = files_of(path), store.stats().dirty_rows
    with pytest.raises(error, match=match) as info:
        store.grow(num_rows)
    assert isinstance(info.value, StoreError)
    assert store.num_rows == N and store.version == v and store.stats().dirty_rows == dirty
    assert files_of(path) == files, "a refused grow changed files"
    assert_rows(store, model, "after a refused grow")
    store.close()


def test_grow_to_the_same_size_does_nothing(shm_path):
    store = make(shm_path / "s", "zeros", None)
    v = store.flush()
    files = files_of(shm_path / "s")
    store.grow(N)
    assert store.num_rows == N and store.flush() == v and files_of(shm_path / "s") == files
    store.close()


def test_grow_refuses_a_readonly_handle(shm_path):
    make(shm_path / "s", "zeros", None).close()
    with EmbeddingStore.open(shm_path / "s", readonly=True) as reader:
        with pytest.raises(ReadOnlyError):
            reader.grow(N + 1)
        assert reader.num_rows == N


def test_grow_keeps_the_store_counters(shm_path):
    store = make(shm_path / "s", "zeros", HOT)
    store.get(torch.arange(10))
    store.flush()
    before = store.stats()
    store.grow(N * 3)
    after = store.stats()
    assert after.gets == before.gets and after.flushes == before.flushes
    assert after.table_bytes == 3 * before.table_bytes
    store.close()


# ---- any sequence of operations: a hypothesis state machine against a dict of tensors -------------
@pytest.fixture
def _inline_background(monkeypatch):
    """Background compaction, GC, write-back and prefetch run inline, so every example replays exactly."""
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_embcache.store") and hasattr(module, "ThreadPoolExecutor"):
            monkeypatch.setattr(module, "ThreadPoolExecutor", InlineExecutor)


def make_machine(hot: int | None, init: str):
    class GrowMachine(RuleBasedStateMachine):
        @initialize()
        def create(self):
            self.dir = tempfile.mkdtemp(prefix="embcache-grow-", dir=SHM)
            self.path = Path(self.dir) / "s"
            self.store = make(self.path, init, hot)
            self.model = created_at(N, init)
            self.snapshots = {0: {k: v.clone() for k, v in self.model.items()}}
            self.flushed = 0

        def teardown(self):
            if getattr(self, "store", None) is not None:
                self.store.close()
            if getattr(self, "dir", None):
                shutil.rmtree(self.dir, ignore_errors=True)

        @rule(data=st.data(), value=st.integers(-8, 8))
        def update(self, data, value):
            n = self.store.num_rows
            ids = data.draw(st.lists(st.integers(0, n - 1), max_size=10, unique=True))
            write(self.store, self.model, ids, float(value))

        @rule(data=st.data())
        def get(self, data):
            n = self.store.num_rows
            ids = data.draw(st.lists(st.integers(0, n - 1), max_size=10))
            assert_bitwise_equal(self.store.get(torch.tensor(ids, dtype=torch.int64)), self.model["weight"][ids],
                                 f"get({ids})")

        @rule(more=st.integers(0, 3 * CHUNK))
        def grow(self, more):
            n = self.store.num_rows + more
            self.store.grow(n)
            self.model = grown(self.model, n, init)
            assert self.store.num_rows == n

        @rule()
        def flush(self):
            v = self.store.flush()
            self.snapshots[v] = {k: t.clone() for k, t in self.model.items()}
            self.flushed = max(self.flushed, v)

        @rule()
        def compact(self):
            self.store.compact()
            if self.store.version not in self.snapshots:  # a reader-free compaction keeps the number
                self.snapshots[self.store.version] = self.snapshots[self.flushed]
                self.flushed = self.store.version

        @rule()
        def close_and_reopen(self):
            self.store.close()
            self.store = None
            self.store = reopen(self.path, init, hot)
            self.model = {k: t.clone() for k, t in self.snapshots[self.store.version].items()}
            assert_rows(self.store, self.model, "reopened")

        @precondition(lambda self: self.flushed > 0)
        @rule()
        def pinned_versions_keep_their_size(self):
            for v in self.store.pinned():
                with reopen(self.path, init, hot, version=v, readonly=True) as old:
                    assert_rows(old, self.snapshots[v], f"pinned version {v}")

        @rule()
        def pin_latest(self):
            if self.store.version in self.snapshots:
                self.store.pin(self.store.version)

    return GrowMachine


FAST = settings(max_examples=15, stateful_step_count=20, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=200, stateful_step_count=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

for _mode, _hot in MODES.items():
    _machine = make_machine(_hot, "normal" if _mode == "memory" else "callable")
    _fast = type(f"TestGrowMatchesTensorModel{_mode.title()}", (_machine.TestCase,), {"settings": FAST})
    globals()[_fast.__name__] = pytest.mark.usefixtures("_inline_background")(_fast)
    _slow = type(f"TestGrowMatchesTensorModel{_mode.title()}Slow", (_machine.TestCase,), {"settings": SLOW})
    globals()[_slow.__name__] = pytest.mark.slow(pytest.mark.usefixtures("_inline_background")(_slow))
del _fast, _slow, _machine


def test_compaction_process_folds_the_grown_table(shm_path, monkeypatch):
    """The compaction process works on the table at its size: the one started before a growth is
    stopped with it, and the next one folds the grown table's chunks (the short one included)."""
    monkeypatch.setenv("EMBCACHE_COMPACTION_PROCESS", "always")
    path = shm_path / "s"
    store = make(path, "normal", HOT)
    model = created_at(N, "normal")
    for step in range(3):
        write(store, model, list(range(step, N, 4)), float(step + 1))
        store.flush()
    store.compact()
    store.grow(N + 2 * CHUNK + 3)
    model = grown(model, N + 2 * CHUNK + 3, "normal")
    for step in range(3):
        write(store, model, list(range(step, store.num_rows, 3)), float(step + 5))
        store.flush()
    store.compact()
    assert store.stats().segments == 0
    assert_rows(store, model, "compacted after the growth")
    store.close()
    with reopen(path, "normal", HOT) as again:
        assert_rows(again, model, "reopened")
    assert verify_store(path).ok


@pytest.mark.parametrize("hot", [None, HOT], ids=["memory", "disk"])
def test_a_grow_that_fails_on_a_full_disk_leaves_the_store_as_it_was(shm_path, monkeypatch, hot):
    """The grown layout's chunk map cannot be written: the store reopens at its size with every
    row, the unflushed ones too, and goes on (a later grow and flush work)."""
    import errno

    from lightning_embcache.store.disk import Disk
    from lightning_embcache.store.errors import DiskFullError

    path = shm_path / "s"
    store = make(path, "normal", hot)
    model = created_at(N, "normal")
    write(store, model, list(range(0, N, 2)), 2.0)
    v = store.flush()
    store.compact()  # a chunk map: the growth writes a new one
    write(store, model, [1, 3, 49], 3.0)  # unflushed

    def full(*a, **k):
        raise DiskFullError(errno.ENOSPC, "disk full while writing a chunk map (test)")

    with monkeypatch.context() as m:
        m.setattr(Disk, "write_chunkmap", full)
        with pytest.raises(DiskFullError):
            store.grow(N + 30)
    assert store.num_rows == N and store.version == v
    assert_rows(store, model, "after the failed grow")
    store.grow(N + 30)
    model = grown(model, N + 30, "normal")
    store.flush()
    store.close()
    with reopen(path, "normal", hot) as again:
        assert_rows(again, model, "grown after a failed grow")


def test_a_grow_that_fails_writing_its_rows_back_reopens_the_old_size(shm_path, monkeypatch):
    """The grown store is open but its unflushed rows cannot be written again: it reopens at the
    old size with them."""
    path = shm_path / "s"
    store = make(path, "zeros", HOT)
    model = created_at(N, "zeros")
    write(store, model, [5, 6, 49], 2.0)
    calls = []
    real = EmbeddingStore.write_records

    def fail_first(self, ids, records):
        calls.append(len(ids))
        if len(calls) == 1:
            raise StoreError("write failed (test)")
        return real(self, ids, records)

    monkeypatch.setattr(EmbeddingStore, "write_records", fail_first)
    with pytest.raises(StoreError, match="write failed"):
        store.grow(N * 2)
    assert calls == [3, 3] and store.num_rows == N
    assert_rows(store, model, "after the failed grow")
    monkeypatch.undo()
    store.grow(N * 2)
    assert_rows(store, grown(model, N * 2, "zeros"), "grown after a failed grow")
    store.close()


def test_a_pinned_version_of_the_old_size_never_shares_the_grown_chunk_files(shm_path):
    """Never compacted before the growth (no chunk map), pinned: compaction after the growth must
    not publish the pinned version again with the grown table's chunk map."""
    path = shm_path / "s"
    store = make(path, "normal", None)
    model = created_at(N, "normal")
    write(store, model, list(range(0, N, 3)), 2.0)
    v1 = store.flush()
    store.pin(v1)
    store.grow(N + CHUNK)
    write(store, grown_model := grown(model, N + CHUNK, "normal"), [1, N + 2], 3.0)
    store.flush()
    store.compact()
    with reopen(path, "normal", None, version=v1, readonly=True) as old:
        assert_rows(old, model, "pinned version after compaction of the grown table")
    assert_rows(store, grown_model, "grown table")
    store.close()
    assert verify_store(path).ok
