"""Multi-thread and multi-process load against a reference (slow suite): a training thread,
flush/compact/stats threads, and read-only handles in other processes that must always read
exactly the version they opened."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _store_helpers import looping

from lightning_embcache import EmbeddingStore

N, DIM, CHUNK = 8192, 16, 128
ROW = DIM * 4
READER = Path(__file__).with_name("_load_reader.py")
WEIGHTS = torch.from_numpy(np.random.default_rng(99).standard_normal((N, DIM)))


def _digest(rows: torch.Tensor) -> float:
    return float((rows.double() * WEIGHTS).sum())


def _run(path, steps: int, readers: int, seconds: float):
    hot = 2048 * (ROW + 11)
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=hot)
    store.flush()
    model = torch.zeros(N, DIM)
    digests = {store.version: _digest(model)}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(READER), str(path), str(seconds), str(N), str(DIM)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(readers)]
    rng = np.random.default_rng(7)
    wrong = ops = 0
    with looping([store.compact, store.stats], pause=0.005) as errors:
        for step in range(steps):
            ids = torch.from_numpy(rng.choice(N, 256, replace=False))
            wrong += int((store.get(ids) != model[ids]).any(dim=1).sum())
            vals = torch.randn(256, DIM)
            store.update(ids, vals)
            model[ids] = vals
            ops += 512
            if step % 20 == 19:
                digests[store.flush()] = _digest(model)
    v = store.flush()
    digests[v] = _digest(model)
    store.close()
    seen = bad = 0
    for p in procs:
        out, err = p.communicate(timeout=seconds + 120)
        assert p.returncode == 0, f"a reader process failed: {err[-2000:]}"
        for line in out.splitlines():
            rv, d = line.split()
            seen += 1
            # a version no flush returned is a compaction round's, published as a new version
            # beside a reader of the current one: the rows of the newest flushed version below it
            flushed = max(v for v in digests if v <= int(rv))
            if f"{digests[flushed]:.6e}" != d:
                bad += 1
    assert not errors, repr(errors[0])
    with EmbeddingStore.open(path, hot_bytes=hot) as s:
        lost = int((s.get(torch.arange(N)) != model).any(dim=1).sum())
    return {"ops": ops, "wrong": wrong, "lost": lost, "reader_reads": seen, "reader_wrong": bad}


@pytest.mark.slow
def test_load_a_million_row_operations(shm_path):
    out = _run(shm_path / "store", int(os.environ.get("EMBCACHE_LOAD_STEPS", "2000")), 2, 60.0)
    print(f"\nLOAD {out}")
    assert out["ops"] >= 10**6 or "EMBCACHE_LOAD_STEPS" in os.environ
    assert out["wrong"] == out["lost"] == out["reader_wrong"] == 0, out
    assert out["reader_reads"] > 0
