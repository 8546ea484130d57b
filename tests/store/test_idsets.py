"""The store's sort-based id set operations against numpy's own (any ids, duplicates, empties)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lightning_embcache.store import idsets

ids = arrays(np.int64, st.integers(0, 200), elements=st.integers(-5, 300))


@settings(max_examples=300, deadline=None)
@given(ids, ids)
def test_matches_numpy(a, b):
    assert np.array_equal(idsets.unique(a), np.unique(a))
    assert np.array_equal(idsets.union(a, b), np.union1d(a, b))
    assert np.array_equal(idsets.isin(a, b), np.isin(a, b))
    assert np.array_equal(idsets.isin(a, np.unique(b), b_sorted_unique=True), np.isin(a, b))
    assert np.array_equal(idsets.difference(a, b), np.setdiff1d(a, b))


def test_shapes_and_dtypes_are_kept():
    a = np.array([[3, 1], [3, 2]], np.int32)
    u = idsets.unique(a)
    assert u.dtype == np.int32 and u.tolist() == [1, 2, 3]
    assert idsets.isin(a, np.array([3])).tolist() == [[True, False], [True, False]]
    assert idsets.isin(np.zeros(0, np.int64), np.array([1])).shape == (0,)


@given(st.lists(st.integers(0, 20), max_size=60))
def test_runs_are_the_bounds_of_equal_values(values):
    a = np.sort(np.array(values, dtype=np.int64))
    got = idsets.runs(a)
    if len(a):
        assert np.array_equal(got, np.flatnonzero(np.r_[True, a[1:] != a[:-1], True]))
    else:
        assert got.tolist() == [0]


def test_flushes_and_compaction_use_no_hash_based_numpy_set_operation(tmp_path):
    """``np.unique`` and what calls it (setdiff1d, union1d) answer with a hash table that costs
    more than a sort at batch sizes and imports numpy.ma on first use: a fresh process that
    writes, flushes and folds a store never reaches one."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch\n"
        "from lightning_embcache import EmbeddingStore\n"
        f"s = EmbeddingStore.create({str(tmp_path / 's')!r}, 10000, 8, chunk_rows=256)\n"
        "for i in range(5):\n"
        "    s.update(torch.randint(0, 10000, (500,)), torch.randn(500, 8)); s.flush()\n"
        "s.compact(); s.close()\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": repo}, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
