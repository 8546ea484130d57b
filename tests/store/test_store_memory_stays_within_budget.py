"""Resident memory of a disk store is bounded by its budget, measured, not assumed.

A subprocess creates a store 4x larger than hot_bytes + warm_bytes, reads and writes random rows
over the whole table until >= 90% of the rows were touched (or trains two epochs in chunk order
with lookahead), and reports its peak RSS increase.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastpaths import missing

from lightning_embcache.store import uring

PROBE = Path(__file__).with_name("_rss_probe.py")
REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20

HOT, WARM = 12 * MIB, 4 * MIB
DIM = 32
ROWS = 4 * (HOT + WARM) // (DIM * 4)  # a 64 MiB table
# Fixed overhead beyond the budget: the id -> slot map (4 B per table row, 2 MiB here), the
# batch's temporaries (4096 rows x 128 B, a few copies), chunk I/O buffers, segment indexes and
# the malloc heap slack they leave. Measured on the 2-core CI VM: 34-36 MiB, of which ~16 MiB is
# heap slack that malloc_trim(0) returns. The compaction process (a 64 MiB table has one) adds
# what it holds beyond its interpreter, a round's buffers: 3.4-4.5 MiB. The whole run's peak,
# brief (a flush's 4 MiB blocks beside a batch's temporaries, before close), measured 45.9-63.6
# MiB over its start on the CI VM (16 runs; 44 MiB of overhead failed about one run in four).
# Not all of it is fixed: with the table twice as large (same budgets) it was 72-77 MiB (the
# map, segment indexes). A resident table would exceed this bound by > 30 MiB.
OVERHEAD = 47 * MIB


def _probe(path, order: str = "random", **env) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env)
    r = subprocess.run([sys.executable, str(PROBE), str(path), str(HOT), str(WARM), str(ROWS), str(DIM), "0", order],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _assert_within(m: dict, overhead: int) -> None:
    table = ROWS * DIM * 4
    grew = m["peak"] - m["base"]
    allowed = HOT + WARM + overhead
    assert m["touched"] >= 0.9 and m["cold_reads"] > 0, m
    assert allowed < table, "the bound must be able to tell a bounded store from a resident table"
    assert grew <= allowed, (
        f"peak RSS grew by {grew / MIB:.1f} MiB over a {table / MIB:.0f} MiB table; allowed hot {HOT / MIB:.0f} "
        f"+ warm {WARM / MIB:.0f} + {overhead / MIB:.0f} MiB fixed overhead = {allowed / MIB:.0f} MiB ({m})"
    )


@pytest.mark.timeout(900)  # a subprocess over a 64 MiB table: minutes on a host loaded several times over
def test_peak_rss_stays_within_budget_plus_fixed_overhead(shm_path):
    _assert_within(_probe(shm_path / "store"), OVERHEAD)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("runs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_chunks_read_ahead_add_no_memory_beyond_the_warm_budget(shm_path, runs):
    """`ChunkShuffleSampler` order with lookahead, whose chunks are read ahead whole into the warm
    tier: the slots being read into count against its budget, so the epochs' peak is no higher
    than in the same run without read-ahead (io_uring off), within noise. (Absolute: in this
    order every row of a batch is new to the hot tier and dirty, and the epochs peaked 55-63 MiB
    over the start here with or without read-ahead, against 46 MiB for random rows: above the
    bound the test above can afford at this table size.) The peak is brief, where transients meet (a
    flush's 4 MiB blocks beside a batch's temporaries); with and without read-ahead one run each
    differed by -0.8 to +4.3 MiB, the lower of two runs each by -1.5 to +5.0 MiB (2-vCPU
    host). So 8 MiB is the noise allowed: the default suite runs each way once, the slow suite
    twice, interleaved, the lower peak counting; a read-ahead that held chunks outside the budget
    could add up to the 64 MiB table."""
    if uring.async_ring(2) is None:
        missing("io_uring")
    ahead, plain = [], []
    for i in range(runs):
        ahead.append(_probe(shm_path / f"a{i}", "chunk"))
        plain.append(_probe(shm_path / f"b{i}", "chunk", EMBCACHE_NO_IO_URING="1"))
    for a, p in zip(ahead, plain):
        assert a["chunks_read_ahead"] >= ROWS // 1024 and a["warm_bytes"] <= WARM, a
        assert p["chunks_read_ahead"] == 0, p
    grew_ahead = min(a["peak"] - a["base"] for a in ahead)
    grew_plain = min(p["peak"] - p["base"] for p in plain)
    assert grew_ahead <= grew_plain + 8 * MIB, (ahead, plain)
