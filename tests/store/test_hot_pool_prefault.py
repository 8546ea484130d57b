"""The hot tier's pool is faulted in ahead of the slots in use, in the background, within the budget.

Measured on the process itself: the resident bytes of the pool's mapping (``/proc/self/smaps``),
against the bytes of rows written into it.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import prefault as prefault_mod
from lightning_embcache.store.hot import HotTier
from lightning_embcache.store.prefault import Prefault

MiB = 1 << 20
DIM = 64  # 256-byte rows

pytestmark = pytest.mark.skipif(not prefault_mod._libc_madvise(), reason="needs libc madvise (Linux)")


def _mapping_rss(addr: int) -> int:
    """Resident bytes of the mapping holding ``addr``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the pool")


def _wait(cond, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _populating() -> bool:
    return any(t.name == "embcache-prefault" for t in threading.enumerate())


def _populated_ok(hot) -> bool:
    """Population got its memory (a kernel that refuses MADV_POPULATE_WRITE closes it)."""
    return not hot._prefault._closed or hot._prefault.populated > 0


def test_pool_is_resident_ahead_of_the_rows_written(tmp_path):
    budget = 24 * MiB
    s = EmbeddingStore.create(tmp_path / "s", 400_000, DIM, hot_bytes=budget, chunk_rows=1024)
    ids = torch.arange(0, 4096)
    s.update(ids, s.get(ids) + 1)  # 1 MiB of rows in the lowest slots
    hot = s._hot
    if not _populated_ok(hot) and hot._prefault._closed:
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE")
    limit = hot.limit * hot.row_bytes
    _wait(lambda: hot._prefault.populated >= min(limit, 4096 * hot.row_bytes + prefault_mod.AHEAD) - 4096)
    rss = _mapping_rss(hot.pool_np.ctypes.data)
    # without the prefault only the written megabyte (2 MiB with a huge page) would be resident
    assert rss >= 0.9 * min(limit, prefault_mod.AHEAD), (rss, limit)
    assert rss <= hot.capacity * hot.row_bytes + 2 * MiB
    _wait(lambda: not _populating())  # the thread ends once it has nothing to do
    s.close()


def test_population_stays_within_a_lowered_budget(tmp_path):
    s = EmbeddingStore.create(tmp_path / "s", 400_000, DIM, hot_bytes=40 * MiB, chunk_rows=1024)
    ids = torch.arange(0, 1024)
    s.update(ids, s.get(ids) + 1)
    hot = s._hot
    _wait(lambda: hot._prefault._thread is None)
    s.set_budget(hot_bytes=6 * MiB)
    for a in range(0, 60_000, 2048):  # more rows than the budget holds: evictions, a full tier
        ids = torch.arange(a, a + 2048)
        s.update(ids, s.get(ids) + 1)
    _wait(lambda: hot._prefault._thread is None)
    limit = hot.limit * hot.row_bytes
    assert hot._prefault.populated <= limit + 4096
    assert _mapping_rss(hot.pool_np.ctypes.data) <= limit + 2 * MiB
    assert torch.equal(s.get(torch.arange(0, 1024)), torch.full((1024, DIM), 2.0))
    assert torch.equal(s.get(torch.arange(1024, 60_000)), torch.ones(58_976, DIM))
    s.close()


def test_population_changes_no_byte_of_the_rows():
    hot = HotTier(100_000, 256, 1024, 20_000, private=True)
    slots = hot.take_free(10_000)
    rows = np.random.default_rng(0).integers(0, 256, (10_000, 256), dtype=np.uint8)
    hot.install(np.arange(10_000), slots, rows)
    p = Prefault(hot.pool_np.ctypes.data, hot.capacity * 256)
    p.want(hot.capacity * 256)  # over the rows just written, and the rest
    _wait(lambda: p._thread is None)
    assert p.populated >= hot.capacity * 256 - 4096 or p._closed
    assert np.array_equal(hot.pool_np[slots], rows)
    p.close()
    hot.close()


def _child_closes(hot_prefault: Prefault, q) -> None:
    hot_prefault.want(1 << 30)
    hot_prefault.limit(0)
    hot_prefault.close()
    q.put("ok")


def test_a_forked_child_never_waits_for_the_parents_locks():
    buf = np.zeros(8 * MiB, np.uint8)
    p = Prefault(buf.ctypes.data, buf.nbytes)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with p._work:  # held at the fork, as by a populate call running in the parent's thread
        child = ctx.Process(target=_child_closes, args=(p, q))
        child.start()
        child.join(30)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
    assert q.get(timeout=5) == "ok"
    p.close()
