"""Fixtures of the store tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def shm_path():
    """A fresh folder on tmpfs where there is one (fsync is free there), else under /tmp."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="embcache-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)
