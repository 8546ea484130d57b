"""One huge get/update/read_records call holds bounded temporaries (docs/store.md, "Memory").

Whatever the batch, a call is resolved and served in slices of `SLICE_ROWS` rows: beyond the
store's checked copy of the ids (8 bytes per id) and the result the caller asked for, it holds a
slice's temporaries; a disk-mode update larger than a slice also stages its distinct ids and
their positions (at most 24 bytes per id). Measured as peak RSS in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.store.tiers import SLICE_ROWS
from lightning_embcache.store.writeback import _last_of_each

PROBE = Path(__file__).with_name("_huge_call_probe.py")
REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
N_IDS, ROWS, DIM = 5_000_000, 1_000_000, 4
# The documented terms (docs/store.md): 8 bytes per id (the checked copy), 24 more per id for a
# disk-mode update's staging; SLACK covers a slice's temporaries, chunk buffers and malloc's heap.
IDS_COPY, STAGING, SLACK = 8 * N_IDS, 24 * N_IDS, 16 * MIB


def _grew(path: Path, mode: str, op: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(PROBE), str(path / "s"), mode, op, str(N_IDS), str(ROWS), str(DIM)],
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_a_5m_id_update_stays_within_its_documented_bound(shm_path, mode):
    m = _grew(shm_path, mode, "update")
    bound = IDS_COPY + (STAGING if mode == "disk" else 0) + SLACK
    print(f"\nHUGE update of {N_IDS} ids, {mode} mode: peak grew {m['grew'] / MIB:.1f} MiB, bound {bound / MIB:.1f}")
    assert not m["all_loaded"] or mode == "disk", "the memory-mode table must be partly touched"
    assert m["grew"] <= bound, f"{m['grew'] / MIB:.1f} MiB > {bound / MIB:.1f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("op", ["get", "read_records"])
@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_a_5m_id_read_holds_its_result_and_the_ids(shm_path, mode, op):
    m = _grew(shm_path, mode, op)
    result = N_IDS * (DIM * 4 if op == "get" else m["row_bytes"])
    bound = result + IDS_COPY + SLACK
    print(f"\nHUGE {op} of {N_IDS} ids, {mode} mode: peak grew {m['grew'] / MIB:.1f} MiB, bound {bound / MIB:.1f}")
    assert m["grew"] <= bound, f"{m['grew'] / MIB:.1f} MiB > {bound / MIB:.1f} MiB"


def test_last_of_each_matches_a_dict_of_last_writes():
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 1000):
        idx = rng.integers(0, max(1, n // 3), n)
        uniq, pos = _last_of_each(idx)
        last = {int(i): p for p, i in enumerate(idx.tolist())}
        assert uniq.tolist() == sorted(last)
        assert pos.tolist() == [last[i] for i in sorted(last)]


@pytest.mark.parametrize("hot_rows", [None, 2000])
def test_a_call_of_several_slices_with_duplicates_matches_a_tensor_model(tmp_path, hot_rows):
    """Duplicates across slice boundaries: the last write wins, reads see every slice's rows."""
    rows, dim = 3 * SLICE_ROWS, 3
    hot = None if hot_rows is None else hot_rows * dim * 4 * 2
    model = torch.zeros(rows, dim)
    rng = np.random.default_rng(5)
    with EmbeddingStore.create(tmp_path / "s", num_rows=rows, dim=dim, hot_bytes=hot, init="zeros") as s:
        s.get(torch.arange(5))  # partly touched
        for rnd in range(3):
            ids = torch.from_numpy(rng.integers(0, rows, 3 * SLICE_ROWS + 17))
            vals = torch.randn(len(ids), dim)
            s.update(ids, vals)
            for i, v in zip(ids.tolist(), vals):  # in order: the last write wins
                model[i] = v
            if rnd == 1:
                s.flush()
            q = torch.from_numpy(rng.integers(0, rows, 2 * SLICE_ROWS + 5))
            assert torch.equal(s.get(q), model[q])
            rec = s.read_records(q)
            assert torch.equal(s.record_view(rec, "weight"), model[q])
        s.flush()
    with EmbeddingStore.open(tmp_path / "s", readonly=True) as s:
        assert torch.equal(s.get(torch.arange(rows)), model)
