"""Suite-wide settings and fixtures: the cores are shared fairly between pytest-xdist workers;
`shm_path`, a fresh folder on tmpfs, for the tests of every package.

`make test` runs the default suite on one xdist worker per core. Each worker (and every process a
test starts: docs pages, DDP ranks, crash children) gets its share of the cores for torch's
intra-op threads, never all of them: on a 2-core host two workers of 2 OpenMP threads each spend
their time in spinning barrier waits, and a test's tiny ops compute the same on one thread.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


def _workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)


def pytest_configure(config) -> None:
    workers = _workers()
    if workers <= 1:
        return  # one process: torch's own default, as a user's run has
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # processes the tests start
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def shm_path():
    """A fresh folder on tmpfs where there is one (fsync is free there), else under /tmp."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="embcache-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)
