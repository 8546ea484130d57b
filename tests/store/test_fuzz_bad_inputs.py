"""Bad ids and arguments: always a named StoreError subclass, never a wrong row, never a raw error.

Covers ids the old per-tensor validation cache let through (refilled through a numpy view or
``.data``), inference tensors, ids on the meta device, crafted-but-checksummed files naming id -1,
integer values that do not fit their field, and the arguments accepted before that should not be.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from _store_helpers import in_forked_child
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import (
    CorruptStoreError,
    EmbeddingStore,
    InvalidArgumentError,
    InvalidTypeError,
    StoreError,
)
from lightning_embcache.store import fileio
from lightning_embcache.store.validate import as_ids

N, DIM = 64, 4


@pytest.fixture(params=["memory", "disk"])
def store(request, shm_path):
    hot = None if request.param == "memory" else 16 * (DIM * 4 + 11)
    s = EmbeddingStore.create(shm_path / "store", N, DIM, chunk_rows=16, hot_bytes=hot,
                              fields={"step": (torch.int32, 1)})
    s.update(torch.arange(N), torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM))
    s.flush()
    yield s
    s.close()


def _all(store):
    return store.get_fields(torch.arange(N), store.field_names)


def test_ids_refilled_through_a_numpy_view_are_validated_again(store):
    before = _all(store)
    ids = torch.tensor([1, 2, 3])
    store.get(ids)
    ids.numpy()[0] = -1  # no version counter bump: a cache keyed on it would serve row 63
    for call in (lambda: store.get(ids), lambda: store.get_fields(ids, ["weight"]),
                 lambda: store.update(ids, torch.ones(3, DIM)),
                 lambda: store.update_fields(ids, {"weight": torch.ones(3, DIM)})):
        with pytest.raises(InvalidArgumentError, match=r"-1"):
            call()
    after = _all(store)
    for k in before:
        assert torch.equal(before[k], after[k]), f"field {k} changed by rejected calls"


def test_ids_refilled_through_data_are_validated_again(store):
    ids = torch.tensor([5, 6])
    store.get(ids)
    ids.data[1] = N + 3
    with pytest.raises(InvalidArgumentError, match=str(N + 3)):
        store.update(ids, torch.ones(2, DIM))


def test_get_under_inference_mode(store):
    with torch.inference_mode():
        ids = torch.tensor([0, 7, 63])
        got = store.get(ids)
        got2 = store.get(ids)
    want = torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM)[[0, 7, 63]]
    assert torch.equal(got, want) and torch.equal(got2, want)


def test_ids_are_copied_before_use():
    """The store validates and uses its own copy: a caller changing the ids afterwards (another
    thread, a DataLoader reusing the buffer) cannot make a checked id reach another row."""
    for ids in (torch.tensor([1, 2, 3]), np.array([1, 2, 3]), torch.tensor([1, 2, 3], dtype=torch.int32)):
        arr = as_ids(ids, 10)
        if isinstance(ids, torch.Tensor):
            ids.fill_(-1)
        else:
            ids[:] = -1
        assert arr.tolist() == [1, 2, 3]


def test_int64_value_out_of_an_int32_field_is_rejected(store):
    before = _all(store)
    with pytest.raises(InvalidArgumentError, match=r"int32"):
        store.update_fields(torch.tensor([3]), {"step": torch.tensor([[2**40 + 7]], dtype=torch.int64)})
    assert torch.equal(_all(store)["step"], before["step"])


def test_meta_device_ids_and_values_are_named_errors(store):
    with pytest.raises(InvalidArgumentError, match="meta"):
        store.get(torch.empty(3, dtype=torch.int64, device="meta"))
    with pytest.raises(InvalidArgumentError, match="meta"):
        store.update(torch.tensor([1, 2]), torch.empty(2, DIM, device="meta"))


def _craft_segment_with_id(path, bad_id: int) -> None:
    """Rewrite the newest segment so its (checksummed, valid-header) directory lists ``bad_id``."""
    seg = max((path / "segments").iterdir())
    data = bytearray(seg.read_bytes())
    head = bytes(data[: fileio.HEADER_SIZE])
    length, _ = fileio.parse_header(seg, head, b"segment")
    directory = bytearray(data[fileio.HEADER_SIZE : fileio.HEADER_SIZE + length])
    np.frombuffer(directory, np.int64, 1, 28)[:] = 0  # make the array writable view below
    ids = np.frombuffer(directory, np.int64, 1, 28).copy()
    ids[0] = bad_id
    directory[28:36] = ids.tobytes()
    new_head = fileio.pack(b"segment", bytes(directory), fileio.header_uuid(head), seg.name)[0]
    seg.write_bytes(bytes(new_head) + bytes(directory) + bytes(data[fileio.HEADER_SIZE + length :]))


@pytest.mark.parametrize("bad_id", [-1, N, 2**62])
def test_checksummed_segment_listing_an_out_of_range_id_is_refused(shm_path, bad_id):
    path = shm_path / "store"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=16) as s:
        s.update(torch.tensor([0, 1]), torch.ones(2, DIM))
        s.flush()
    _craft_segment_with_id(path, bad_id)
    with pytest.raises(CorruptStoreError, match="ids"):
        with EmbeddingStore.open(path) as s:
            s.get(torch.arange(N))


BAD_CALLS = [
    ("create num_rows=2**62", lambda p: EmbeddingStore.create(None, 2**62, 4), InvalidArgumentError),
    ("create num_rows=2**62 on disk", lambda p: EmbeddingStore.create(p / "x", 2**62, 4, hot_bytes=1 << 20), InvalidArgumentError),
    ("create chunk_rows=2**32", lambda p: EmbeddingStore.create(p / "x", 100, 4, chunk_rows=2**32), InvalidArgumentError),
    ("create init_std=nan", lambda p: EmbeddingStore.create(None, 10, 4, init="normal", init_std=math.nan), InvalidArgumentError),
    ("create init_std=inf", lambda p: EmbeddingStore.create(None, 10, 4, init="normal", init_std=math.inf), InvalidArgumentError),
    ("create seed='a'", lambda p: EmbeddingStore.create(None, 10, 4, seed="a"), InvalidTypeError),
    ("create dim=True", lambda p: EmbeddingStore.create(None, 10, True), InvalidTypeError),
    ("open version=1.7", lambda p: EmbeddingStore.open(p / "store", version=1.7), InvalidTypeError),
    ("open version=True", lambda p: EmbeddingStore.open(p / "store", version=True), InvalidTypeError),
    ("open version=-1", lambda p: EmbeddingStore.open(p / "store", version=-1), InvalidArgumentError),
    ("open version='1'", lambda p: EmbeddingStore.open(p / "store", version="1"), InvalidTypeError),
    ("open path=3", lambda p: EmbeddingStore.open(3), InvalidTypeError),
]


@pytest.mark.parametrize("name, call, err", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_raise_named_errors(shm_path, name, call, err):
    with EmbeddingStore.create(shm_path / "store", N, DIM, chunk_rows=16) as s:
        s.update(torch.tensor([1]), torch.ones(1, DIM))
        s.flush()
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(err):
        call(shm_path)
    assert len(os.listdir("/proc/self/fd")) == fds, f"{name} leaked a file descriptor"
    assert not (shm_path / "x").exists() or not any((shm_path / "x").iterdir()), f"{name} left a half-made store"


@pytest.mark.parametrize("bad", [1.9, True, "2", -1, None])
def test_pin_and_unpin_take_only_int_versions(shm_path, bad):
    with EmbeddingStore.create(shm_path / "store", N, DIM, chunk_rows=16) as s:
        s.update(torch.tensor([1]), torch.ones(1, DIM))
        s.flush()
        for call in (s.pin, s.unpin, s.manifest_checksum):
            with pytest.raises((InvalidArgumentError, InvalidTypeError)):
                call(bad)
        assert s.pinned() == []


_ids = st.one_of(
    st.lists(st.integers(-2**63, 2**63 - 1), max_size=8),
    st.lists(st.integers(-3, N + 3), max_size=8),
    st.builds(lambda a: torch.tensor(a, dtype=torch.int64), st.lists(st.integers(-2**63, 2**63 - 1), max_size=8)),
    st.builds(lambda a: np.array(a, dtype=np.uint64), st.lists(st.integers(0, 2**64 - 1), max_size=8)),
    st.builds(lambda a: torch.tensor(a, dtype=torch.float32), st.lists(st.floats(0, 60), max_size=4)),
    st.builds(lambda a: torch.tensor(a, dtype=torch.int16).reshape(-1, 1), st.lists(st.integers(0, 60), max_size=4)),
    st.sampled_from([None, "abc", 3, 2.5, [[1, 2]], object(), [1.5], [True]]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(ids=_ids)
def test_any_ids_give_rows_or_a_named_error_and_never_a_wrong_row(ids):
    store = _fuzz_store()
    want = torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM)
    try:
        got = store.get(ids)
    except StoreError:
        return
    idx = np.asarray(ids.numpy() if isinstance(ids, torch.Tensor) else ids).astype(np.int64).reshape(-1)
    assert ((idx >= 0) & (idx < N)).all(), f"accepted out-of-range ids {ids!r}"
    assert torch.equal(got, want[torch.from_numpy(idx)])


_FUZZ: list = []


def _fuzz_store():
    if not _FUZZ:
        s = EmbeddingStore.create(None, N, DIM)
        s.update(torch.arange(N), torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM))
        _FUZZ.append(s)
    return _FUZZ[0]


def test_an_ephemeral_store_closed_in_a_forked_child_keeps_the_parents_files():
    s = EmbeddingStore.create(None, N, DIM, hot_bytes=16 * (DIM * 4 + 11))
    s.update(torch.arange(N), torch.ones(N, DIM))
    root = s._core.root
    in_forked_child(s.close)
    assert root.exists(), "the child deleted the parent's ephemeral store folder"
    assert torch.equal(s.get(torch.arange(N)), torch.ones(N, DIM))
    s.close()
    assert not root.exists()


_ARG = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=4), st.sampled_from([torch.float32, torch.int8, torch.bfloat16, "lz4", "zeros",
                                                        "normal", [1], {"a": (torch.int32, 1)}]))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(num_rows=_ARG, dim=_ARG, chunk_rows=_ARG, hot_bytes=_ARG, dtype=_ARG, compression=_ARG, init=_ARG,
       seed=_ARG, init_std=_ARG, fields=_ARG, small=st.booleans())
def test_any_create_arguments_give_a_store_or_a_named_error(tmp_path_factory, num_rows, dim, chunk_rows, hot_bytes,
                                                            dtype, compression, init, seed, init_std, fields, small):
    if small:  # mostly valid sizes, so the other arguments are reached
        num_rows, dim, chunk_rows = 100, 4, 16
    kwargs = dict(num_rows=num_rows, dim=dim, chunk_rows=chunk_rows, hot_bytes=hot_bytes, compression=compression,
                  init=init, seed=seed, init_std=init_std, fields=fields)
    if isinstance(dtype, torch.dtype):
        kwargs["dtype"] = dtype
    path = tmp_path_factory.mktemp("c") / "s"
    fds = len(os.listdir("/proc/self/fd"))
    try:
        s = EmbeddingStore.create(path if hot_bytes is not None or small else None, **kwargs)
    except StoreError:
        assert len(os.listdir("/proc/self/fd")) == fds
        return
    with s:
        s.update(torch.tensor([0]), torch.ones(1, s.dim))
        assert torch.equal(s.get(torch.tensor([0])).float(), torch.ones(1, s.dim))


_VAL = st.one_of(st.none(), st.integers(), st.floats(allow_nan=True), st.text(max_size=3),
                 st.builds(torch.zeros, st.integers(0, 3), st.integers(0, 5)),
                 st.builds(lambda n: torch.full((n, DIM), float("nan")), st.integers(1, 3)),
                 st.builds(lambda n: torch.ones(n, DIM, dtype=torch.complex64), st.integers(1, 3)),
                 st.builds(lambda n: torch.ones(n, DIM, dtype=torch.bool), st.integers(1, 3)),
                 st.builds(lambda n: torch.ones(n, DIM, requires_grad=True), st.integers(1, 3)),
                 st.builds(lambda n: np.ones((n, DIM), dtype=object), st.integers(1, 3)),
                 st.builds(lambda n: torch.full((n, 1), 2**40, dtype=torch.int64), st.integers(1, 3)))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(ids=_ids, values=_VAL, field=st.sampled_from(["weight", "step", "nope"]))
def test_any_update_gives_the_rows_or_a_named_error_and_changes_nothing_when_rejected(ids, values, field):
    store = _fuzz_fields_store()
    before = store.get_fields(torch.arange(N), store.field_names)
    try:
        store.update_fields(ids, {field: values})
    except StoreError:
        after = store.get_fields(torch.arange(N), store.field_names)
        assert all(torch.equal(before[k], after[k]) for k in before), "a rejected update changed rows"
        return
    store.update_fields(torch.arange(N), before)  # accepted: restore the reference for the next example


_FUZZ_FIELDS: list = []


def _fuzz_fields_store():
    if not _FUZZ_FIELDS:
        s = EmbeddingStore.create(None, N, DIM, fields={"step": (torch.int32, 1)})
        s.update(torch.arange(N), torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM))
        _FUZZ_FIELDS.append(s)
    return _FUZZ_FIELDS[0]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["get_fields", "evict", "set_budget_hot", "set_budget_warm", "pin", "unpin",
                               "manifest_checksum", "prefetch", "field_spec", "open_hot", "open_warm"]),
       arg=_ARG)
def test_any_argument_to_the_other_calls_gives_a_result_or_a_named_error(tmp_path_factory, method, arg):
    path = tmp_path_factory.mktemp("m") / "s"
    with EmbeddingStore.create(path, N, DIM, chunk_rows=16, hot_bytes=16 * (DIM * 4 + 11)) as s:
        s.update(torch.arange(N), torch.ones(N, DIM))
        s.flush()
        calls = {
            "get_fields": lambda: s.get_fields(torch.tensor([1]), arg),
            "evict": lambda: s.evict(arg),
            "set_budget_hot": lambda: s.set_budget(hot_bytes=arg),
            "set_budget_warm": lambda: s.set_budget(warm_bytes=arg),
            "pin": lambda: s.pin(arg),
            "unpin": lambda: s.unpin(arg),
            "manifest_checksum": lambda: s.manifest_checksum(arg),
            "prefetch": lambda: s.prefetch(arg),
            "field_spec": lambda: s.field_spec(arg),
        }
        if method in calls:
            try:
                calls[method]()
            except StoreError:
                pass
            assert torch.equal(s.get(torch.arange(N)), torch.ones(N, DIM))
    if method.startswith("open"):
        kw = {"hot_bytes": arg} if method == "open_hot" else {"warm_bytes": arg}
        try:
            EmbeddingStore.open(path, **kw).close()
        except StoreError:
            pass
