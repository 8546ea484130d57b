"""`fold.fold_chunk` says with its result, not an exception, that a chunk needs initial values
only the store can compute (the compaction process then leaves the chunk to the store), and
otherwise folds exactly what a dict model of the records says."""

from __future__ import annotations

import numpy as np
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.store.fold import SPARSE_SHARE, fold_chunk

N, DIM, CHUNK = 256, 4, 64


def _flushed(path, rows: np.ndarray) -> tuple[EmbeddingStore, dict[int, np.ndarray]]:
    """A store whose only writes are ``rows`` (one flush, no compaction): its records, by id."""
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK)
    values = torch.arange(len(rows) * DIM, dtype=torch.float32).reshape(len(rows), DIM) + 1
    s.update(torch.from_numpy(rows), values)
    s.flush()
    model = {int(i): s.read_records(torch.tensor([int(i)])).numpy()[0] for i in rows}
    return s, model


def test_a_chunk_that_needs_initial_values_is_left_to_the_store(tmp_path):
    rows = np.arange(int(SPARSE_SHARE * CHUNK) + 1)  # chunk 0 turns dense: the rest need initial values
    s, model = _flushed(tmp_path / "s", rows)
    with s:
        v = s._versions
        assert fold_chunk(v.disk, 0, int(v.cmap[0]), v.committed, verify=True, init_rows=None) is None
        got = fold_chunk(v.disk, 0, int(v.cmap[0]), v.committed, verify=True, init_rows=s._core.init_rows)
        assert got is not None
        recs, present = got
        assert present is None and recs.shape == (CHUNK, s.row_bytes)
        for i, rec in model.items():
            assert np.array_equal(recs[i], rec)
        want_rest = s._core.init_rows(np.arange(len(rows), CHUNK))
        assert np.array_equal(recs[len(rows):], want_rest)


def test_a_chunk_that_stays_sparse_folds_without_initial_values(tmp_path):
    rows = np.array([3, 17, 40])  # few rows of chunk 0: it stays sparse, no initial value written
    s, model = _flushed(tmp_path / "s", rows)
    with s:
        v = s._versions
        got = fold_chunk(v.disk, 0, int(v.cmap[0]), v.committed, verify=True, init_rows=None)
        assert got is not None
        recs, present = got
        assert present is not None and present.tolist() == rows.tolist()
        for k, i in enumerate(rows.tolist()):
            assert np.array_equal(recs[k], model[i])
