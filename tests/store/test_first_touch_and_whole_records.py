"""A memory-mode table pays a first touch per row, not per chunk; `materialize=True` pays it up
front; whole records (`read_records`/`write_records`) never take a field-by-field path, in disk mode
or in a partly touched memory-mode table; never-written rows are the seeded normals of the
documented formula, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import EmbeddingStore, InvalidArgumentError
from lightning_embcache.store import fill, tiers
from lightning_embcache.store.initrows import normal_rows

CHUNK = 64
FIELDS = {"m": (torch.float32, 3), "k": (torch.int32, 1)}


def reference_normal(ids: np.ndarray, dim: int, seed: int, std: float) -> np.ndarray:
    """The documented init="normal" rows: splitmix64 of (seed, id, column pair), Box-Muller in float32."""
    def mix(x):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    pairs = (dim + 1) // 2
    with np.errstate(over="ignore"):
        key = mix(np.asarray([(seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & (2**64 - 1)], np.uint64))
        ctr = ids.astype(np.uint64)[:, None] * np.uint64(pairs) + np.arange(pairs, dtype=np.uint64)
        h = mix(ctr * np.uint64(0x9E3779B97F4A7C15) + key)
    u1 = ((h >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    u2 = ((h & np.uint64(0xFFFFFF)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    r = np.sqrt(np.float32(-2.0) * np.log(u1)) * np.float32(std)
    t = np.float32(2 * np.pi) * u2
    out = np.empty((len(ids), 2 * pairs), np.float32)
    out[:, 0::2], out[:, 1::2] = r * np.cos(t), r * np.sin(t)
    return out[:, :dim]


@settings(max_examples=60, deadline=None)
@given(dim=st.integers(1, 300), seed=st.integers(0, 2**40), std=st.floats(1e-3, 10.0),
       ids=st.lists(st.integers(0, 2**45), min_size=1, max_size=200))
def test_normal_rows_are_the_documented_formula_bit_for_bit(dim, seed, std, ids):
    ids = np.asarray(ids, np.int64)
    want = reference_normal(ids, dim, seed, std)
    assert np.ascontiguousarray(normal_rows(ids, dim, seed, std)).tobytes() == np.ascontiguousarray(want).tobytes()
    into = np.full((len(ids), dim + 3), 7.0, np.float32)
    normal_rows(ids, dim, seed, std, out=into[:, 1 : dim + 1])
    assert np.array_equal(into[:, 1 : dim + 1], want) and (into[:, 0] == 7).all() and (into[:, dim + 1 :] == 7).all()


@pytest.mark.parametrize("on_disk", [False, True], ids=["ephemeral", "path"])
def test_a_first_touch_makes_the_rows_read_not_their_chunks(tmp_path, on_disk, monkeypatch):
    monkeypatch.setattr(fill, "BACKGROUND_FILL", False)  # what the training thread makes, alone
    monkeypatch.setattr(tiers, "ROWS_ON_FIRST_TOUCH", True)
    n = 100 * CHUNK
    with EmbeddingStore.create(tmp_path / "s" if on_disk else None, n, 8, chunk_rows=CHUNK, init="normal",
                               seed=5, fields=FIELDS) as s:
        ids = torch.arange(10) * CHUNK + 3  # ten rows in ten chunks
        got = s.get(ids)
        assert s.stats().hot_bytes == 10 * s.row_bytes  # per chunk it was 10 * CHUNK rows
        assert torch.equal(got, torch.from_numpy(reference_normal(ids.numpy(), 8, 5, 1.0)))
        rec = s.read_records(ids)
        assert (s.record_view(rec, "m") == 0).all() and s.stats().hot_bytes == 10 * s.row_bytes


@pytest.mark.parametrize("init", ["normal", "zeros", "callable"])
def test_materialize_makes_every_row_up_front_with_the_same_values(tmp_path, init):
    n = 20 * CHUNK + 5
    fields = dict(FIELDS, acc=(torch.float32, 2, 0.25))  # a field with a fill value
    kind = (lambda ids: ids[:, None].float().expand(-1, 6) * 0.5) if init == "callable" else init
    with EmbeddingStore.create(tmp_path / "m", n, 6, chunk_rows=CHUNK, init=kind, seed=2, fields=fields,
                               materialize=True) as s:
        assert s.stats().hot_bytes == n * s.row_bytes
        made = s.read_records(torch.arange(n))
    with EmbeddingStore.create(None, n, 6, chunk_rows=CHUNK, init=kind, seed=2, fields=fields) as lazy:
        assert torch.equal(lazy.read_records(torch.arange(n)), made)
        assert (lazy.record_view(made, "acc") == 0.25).all()


def test_materialize_in_disk_mode_is_refused_by_name_and_creates_nothing(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"materialize=True.*hot_bytes=None.*got hot_bytes=4096"):
        EmbeddingStore.create(tmp_path / "d", 1000, 4, hot_bytes=4096, materialize=True)
    assert not (tmp_path / "d").exists()
    with pytest.raises(TypeError, match="materialize must be True or False"):
        EmbeddingStore.create(None, 10, 4, materialize="yes")


def _no_field_path(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("whole records went through the field-by-field path")

    monkeypatch.setattr(EmbeddingStore, "get_fields", refuse)
    monkeypatch.setattr(EmbeddingStore, "update_fields", refuse)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(hot_rows=st.sampled_from([None, 16, 200]), data=st.data())
def test_whole_records_match_a_model_in_every_mode_without_a_field_by_field_path(tmp_path_factory, hot_rows, data):
    n, dim = 6 * CHUNK, 4
    path = tmp_path_factory.mktemp("s")
    probe = EmbeddingStore.create(None, 2, dim, fields=FIELDS)
    rb = probe.row_bytes
    probe.close()
    hot = None if hot_rows is None else hot_rows * (rb + 11)
    model = None
    with pytest.MonkeyPatch.context() as mp:
        _no_field_path(mp)
        s = EmbeddingStore.create(path / "s", n, dim, chunk_rows=CHUNK, init="normal", seed=9, fields=FIELDS,
                                  hot_bytes=hot)
        try:
            model = s.read_records(torch.arange(n)) if hot_rows is None else None
            s.close()
            s = EmbeddingStore.open(path / "s", hot_bytes=hot)  # a partly touched table again
            if model is None:
                model = s.read_records(torch.arange(n))
                s.close()
                s = EmbeddingStore.open(path / "s", hot_bytes=hot)
            for _ in range(data.draw(st.integers(1, 12))):
                op = data.draw(st.sampled_from(["read", "write", "flush", "evict", "compact"]))
                ids = torch.tensor(sorted(set(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40)))))
                if op == "read":
                    assert torch.equal(s.read_records(ids), model[ids])
                elif op == "write":
                    new = model[ids].clone()
                    w = s.record_view(new, "weight")
                    w += torch.randn(w.shape, generator=torch.Generator().manual_seed(len(ids)))
                    s.record_view(new, "k")[:] += 1
                    s.write_records(ids, new)
                    model[ids] = new
                elif op == "flush":
                    s.flush()
                elif op == "evict":
                    s.evict(data.draw(st.integers(1, n * rb)))
                else:
                    s.flush()
                    s.compact()
            s.flush()
        finally:
            s.close()
        with EmbeddingStore.open(path / "s", readonly=True) as r:
            assert torch.equal(r.read_records(torch.arange(n)), model)


@pytest.mark.parametrize("with_fields", [False, True])
def test_the_background_fill_makes_every_row_and_keeps_rows_changed_meanwhile(tmp_path, with_fields):
    """The fill runs beside updates and flushes of the same rows: at the end every row is either
    its initial value or the value written last, and the table reaches the one-gather state."""
    n = 40 * CHUNK + 3
    fields = FIELDS if with_fields else None
    s = EmbeddingStore.create(tmp_path / "s", n, 4, chunk_rows=CHUNK, init="normal", seed=11, fields=fields)
    try:
        want = torch.from_numpy(reference_normal(np.arange(n), 4, 11, 1.0))
        g = torch.Generator().manual_seed(0)
        for k in range(30):
            ids = torch.unique(torch.randint(0, n, (50,), generator=g))
            vals = torch.randn(len(ids), 4, generator=g)
            s.update(ids, vals)
            want[ids] = vals
            if k % 10 == 9:
                s.flush()
        s._tiers.fill.executor.shutdown(wait=True)  # the fill is done
        assert s._tiers.hot.all_loaded
        assert torch.equal(s.get(torch.arange(n)), want)
        s.flush()
    finally:
        s.close()
    with EmbeddingStore.open(tmp_path / "s", readonly=True) as r:
        assert torch.equal(r.get(torch.arange(n)), want)
