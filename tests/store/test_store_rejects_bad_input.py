"""Bad arguments raise the right StoreError subclass, name the argument, and change nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _store_helpers import assert_snapshot_equal, snapshot

from lightning_embcache import (
    EmbeddingStore,
    InvalidArgumentError,
    InvalidTypeError,
    ReadOnlyError,
    StoreClosedError,
    StoreError,
)

N, DIM = 40, 4
FIELDS = {"m": (torch.float32, 4), "n": (torch.int32, 1)}


@pytest.fixture(params=["memory", "memory-path", "disk"])
def store(request, shm_path):
    kind = request.param
    path = None if kind == "memory" else shm_path / "store"
    hot = 6 * (40 + 11) if kind == "disk" else None
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=8, hot_bytes=hot, fields=FIELDS)
    s.update(torch.arange(N), torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM))
    s.update_fields(torch.arange(0, N, 3), {"n": torch.arange(0, N, 3, dtype=torch.int32)[:, None]})
    s.flush()
    s.update([1, 2], torch.full((2, DIM), -1.0))  # unflushed, dirty: must survive a rejected call too
    yield s
    s.close()


def _rejects(store, exc_type, words, fn, *args, **kwargs):
    before = snapshot(store)
    version = store.version
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"message {msg!r} does not mention {w!r}"
    assert isinstance(info.value, StoreError)
    assert_snapshot_equal(snapshot(store), before, "store after a rejected call")
    assert store.version == version
    return msg


BAD_IDS = [
    pytest.param(torch.tensor([0, -1, 3]), InvalidArgumentError, ["ids", "-1", f"[0, {N})"], id="negative"),
    pytest.param(torch.tensor([0, N, 3]), InvalidArgumentError, ["ids", str(N), f"[0, {N})"], id="equal-num-rows"),
    pytest.param(np.array([5, 10**12]), InvalidArgumentError, ["ids", str(10**12)], id="huge-numpy"),
    pytest.param([0, N + 7], InvalidArgumentError, ["ids", str(N + 7)], id="list-too-big"),
    pytest.param(torch.tensor([0.0, 1.0]), InvalidTypeError, ["ids", "float"], id="float-tensor"),
    pytest.param(np.array([0.0, 1.5]), InvalidTypeError, ["ids", "float"], id="float-numpy"),
    pytest.param([0, 1.5], InvalidTypeError, ["ids"], id="float-list"),
    pytest.param(torch.tensor([True, False]), InvalidTypeError, ["ids", "bool"], id="bool-tensor"),
    pytest.param(torch.zeros(2, 2, dtype=torch.int64), InvalidArgumentError, ["ids", "1-D", "(2, 2)"], id="2-D-tensor"),
    pytest.param(np.zeros((2, 2), np.int64), InvalidArgumentError, ["ids", "1-D"], id="2-D-numpy"),
    pytest.param(torch.tensor(3), InvalidArgumentError, ["ids", "1-D"], id="0-D"),
    pytest.param(["a", "b"], InvalidTypeError, ["ids"], id="strings"),
]


@pytest.mark.parametrize("ids, exc, words", BAD_IDS)
def test_get_rejects_bad_ids(store, ids, exc, words):
    _rejects(store, exc, words, store.get, ids)


@pytest.mark.parametrize("ids, exc, words", BAD_IDS)
def test_update_rejects_bad_ids_and_writes_nothing(store, ids, exc, words):
    n = 2 if getattr(ids, "ndim", 1) != 1 else len(ids)
    _rejects(store, exc, words, store.update, ids, torch.ones(n, DIM))


@pytest.mark.parametrize("ids, exc, words", BAD_IDS[:3])
def test_prefetch_and_fields_reject_bad_ids(store, ids, exc, words):
    _rejects(store, exc, words, store.prefetch, ids)
    _rejects(store, exc, words, store.get_fields, ids, ("m",))


BAD_VALUES = [
    pytest.param(torch.ones(3, DIM + 1), InvalidArgumentError, ["values", f"(3, {DIM})", f"(3, {DIM + 1})"], id="wide"),
    pytest.param(torch.ones(2, DIM), InvalidArgumentError, ["values", "(2, 4)"], id="too-few-rows"),
    pytest.param(torch.ones(3 * DIM), InvalidArgumentError, ["values", "shape"], id="flat"),
    pytest.param(torch.ones(3, DIM, 1), InvalidArgumentError, ["values", "shape"], id="3-D"),
    pytest.param(torch.ones(3, DIM, dtype=torch.complex64), InvalidTypeError, ["values", "complex"], id="complex"),
    pytest.param(torch.ones(3, DIM, dtype=torch.bool), InvalidTypeError, ["values", "bool"], id="bool"),
    pytest.param("abc", InvalidTypeError, ["values"], id="string"),
]


@pytest.mark.parametrize("values, exc, words", BAD_VALUES)
def test_update_rejects_bad_values_and_writes_nothing(store, values, exc, words):
    _rejects(store, exc, words, store.update, torch.tensor([3, 4, 5]), values)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_update_rejects_non_finite_values_when_check_finite(store, bad):
    values = torch.ones(3, DIM)
    values[2, 1] = bad
    msg = _rejects(store, InvalidArgumentError, ["values", "finite", "row 2"], store.update, torch.tensor([3, 4, 5]), values)
    assert "check_finite" in msg


def test_update_fields_rejects_non_finite_moment_and_writes_no_field(store):
    m = torch.ones(2, 4)
    m[0, 0] = math.nan
    _rejects(store, InvalidArgumentError, ["values['m']", "finite"], store.update_fields, [6, 7],
             {"weight": torch.zeros(2, DIM), "m": m})


def test_update_rejects_values_that_overflow_the_store_dtype(store):
    """check_finite judges the values as stored: finite float64 1e300 would become inf in float32."""
    values = torch.full((1, DIM), 1e300, dtype=torch.float64)
    _rejects(store, InvalidArgumentError, ["values", "finite"], store.update, [3], values)


def test_update_fields_rejects_float_into_int_field_and_unknown_field(store):
    _rejects(store, InvalidTypeError, ["values['n']", "float"], store.update_fields, [6, 7],
             {"weight": torch.zeros(2, DIM), "n": torch.ones(2, 1)})
    _rejects(store, InvalidArgumentError, ["'nope'", "weight"], store.update_fields, [6], {"nope": torch.zeros(1, 1)})
    _rejects(store, InvalidArgumentError, ["'nope'"], store.get_fields, [6], ("nope",))
    _rejects(store, InvalidTypeError, ["values"], store.update_fields, [6], {})


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_check_finite_false_accepts_nan_and_inf(shm_path, bad):
    with EmbeddingStore.create(shm_path / "s", N, DIM, check_finite=False, hot_bytes=4 * (16 + 11)) as s:
        values = torch.ones(2, DIM)
        values[1, 3] = bad
        s.update([5, 9], values)
        v = s.flush()
        got = s.get([5, 9])
    assert torch.equal(got[0], values[0]) and math.isnan(got[1, 3]) == math.isnan(bad)
    with EmbeddingStore.open(shm_path / "s", check_finite=False) as s:
        assert s.version == v
        got = s.get([9])[0, 3].item()
        assert got == bad or (math.isnan(bad) and math.isnan(got))
    with EmbeddingStore.open(shm_path / "s") as s:  # the default, check_finite=True, refuses new NaN
        with pytest.raises(InvalidArgumentError, match="finite"):
            s.update([1], torch.full((1, DIM), bad))


def test_evict_and_set_budget_reject_negative_bytes(store):
    _rejects(store, InvalidArgumentError, ["nbytes", "-5"], store.evict, -5)
    _rejects(store, InvalidArgumentError, ["hot_bytes", "-1"], store.set_budget, hot_bytes=-1)
    _rejects(store, InvalidArgumentError, ["warm_bytes", "-1"], store.set_budget, warm_bytes=-1)


CREATE_ARGS = [
    pytest.param(dict(num_rows=0), InvalidArgumentError, ["num_rows", "0"], id="num_rows=0"),
    pytest.param(dict(num_rows=-3), InvalidArgumentError, ["num_rows", "-3"], id="num_rows<0"),
    pytest.param(dict(num_rows=2.5), InvalidTypeError, ["num_rows", "2.5"], id="num_rows-float"),
    pytest.param(dict(dim=-1), InvalidArgumentError, ["dim", "-1"], id="dim=-1"),
    pytest.param(dict(dim=0), InvalidArgumentError, ["dim", "0"], id="dim=0"),
    pytest.param(dict(chunk_rows=0), InvalidArgumentError, ["chunk_rows", "0"], id="chunk_rows=0"),
    pytest.param(dict(compression="zstd"), InvalidArgumentError, ["compression", "zstd", "lz4"], id="zstd"),
    pytest.param(dict(init="uniform"), InvalidArgumentError, ["init", "uniform", "zeros", "normal"], id="uniform"),
    pytest.param(dict(init=3), InvalidTypeError, ["init"], id="init-int"),
    pytest.param(dict(hot_bytes=-1), InvalidArgumentError, ["hot_bytes", "-1"], id="hot_bytes=-1"),
    pytest.param(dict(warm_bytes=-1), InvalidArgumentError, ["warm_bytes", "-1"], id="warm_bytes=-1"),
    pytest.param(dict(warm_bytes=None), InvalidArgumentError, ["warm_bytes", "None"], id="warm_bytes=None"),
    pytest.param(dict(dtype=torch.int32), InvalidTypeError, ["dtype", "int32"], id="int-dtype"),
    pytest.param(dict(dtype="float32"), InvalidTypeError, ["dtype"], id="dtype-str"),
    pytest.param(dict(fields={"weight": (torch.float32, 2)}), InvalidArgumentError, ["fields", "weight"], id="field-weight"),
    pytest.param(dict(fields={"m": (torch.float32, 0)}), InvalidArgumentError, ["fields['m']", "cols"], id="field-cols"),
    pytest.param(dict(fields={"m": (torch.complex64, 2)}), InvalidTypeError, ["fields['m']", "complex64"], id="field-dtype"),
]


@pytest.mark.parametrize("kwargs, exc, words", CREATE_ARGS)
@pytest.mark.parametrize("with_path", [True, False])
def test_create_rejects_bad_arguments_and_creates_nothing(shm_path, kwargs, exc, words, with_path):
    args = dict(num_rows=N, dim=DIM, hot_bytes=1000)
    args.update(kwargs)
    path = shm_path / "new" if with_path else None
    with pytest.raises(exc) as info:
        EmbeddingStore.create(path, **args)
    for w in words:
        assert w in str(info.value), f"message {str(info.value)!r} does not mention {w!r}"
    if with_path:
        assert not (shm_path / "new").exists() or not any((shm_path / "new").iterdir())


def test_create_on_an_existing_store_refuses_and_leaves_it_intact(shm_path):
    path = shm_path / "s"
    with EmbeddingStore.create(path, N, DIM) as s:
        s.update([1, 2], torch.ones(2, DIM))
        v = s.flush()
        before = snapshot(s)
    files = sorted(p.relative_to(path) for p in path.rglob("*"))
    with pytest.raises(InvalidArgumentError, match="already holds a store"):
        EmbeddingStore.create(path, N * 2, DIM)
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == files
    with EmbeddingStore.open(path) as s:
        assert s.version == v and s.num_rows == N
        assert_snapshot_equal(snapshot(s), before)


def test_open_rejects_bad_budgets_and_versions(shm_path):
    from lightning_embcache import VersionNotFoundError

    path = shm_path / "s"
    EmbeddingStore.create(path, N, DIM).close()
    with pytest.raises(InvalidArgumentError, match="hot_bytes"):
        EmbeddingStore.open(path, hot_bytes=-1)
    with pytest.raises(VersionNotFoundError, match="version=7"):
        EmbeddingStore.open(path, version=7)
    EmbeddingStore.open(path).close()  # a refused open left no lock behind


def test_closed_and_readonly_stores_refuse_writes(shm_path):
    path = shm_path / "s"
    s = EmbeddingStore.create(path, N, DIM)
    s.update([1], torch.ones(1, DIM))
    s.flush()
    with EmbeddingStore.open(path, readonly=True) as r:
        before = snapshot(r)
        for call in (lambda: r.update([1], torch.zeros(1, DIM)), r.flush, r.compact, lambda: r.pin(1)):
            with pytest.raises(ReadOnlyError, match="readonly"):
                call()
        assert_snapshot_equal(snapshot(r), before)
    s.close()
    for call in (lambda: s.get([1]), lambda: s.update([1], torch.zeros(1, DIM)), s.flush):
        with pytest.raises(StoreClosedError, match="closed"):
            call()
    s.close()  # closing twice is harmless
