"""Fixtures of the sampler tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def shm_path():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="embcache-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)
