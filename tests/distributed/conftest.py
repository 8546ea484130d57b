"""Fixtures shared by the distributed tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _spawn import RankPool  # noqa: E402


@pytest.fixture(scope="module")
def ranks():
    """Two Gloo processes shared by a test module's tests (each test gets fresh folders)."""
    pool = RankPool(2)
    yield pool
    pool.close()
