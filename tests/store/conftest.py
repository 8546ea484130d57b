"""Fixtures of the store tests."""

from __future__ import annotations

import pytest
from fastpaths import missing


@pytest.fixture
def no_read_ahead(monkeypatch):
    """Announced chunks are not read ahead by kernel threads (as where io_uring is not there):
    the store asks the kernel to read them into the page cache instead."""
    from lightning_embcache.store import chunkload

    monkeypatch.setattr(chunkload.uring, "async_ring", lambda entries: None)


@pytest.fixture
def read_ahead():
    """Announced chunks are read ahead by kernel threads (io_uring); skipped where it is not there."""
    from lightning_embcache.store import uring

    ring = uring.async_ring(2)
    if ring is None:
        missing("io_uring")
    ring.close()
