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


@pytest.fixture
def numpy_gets(monkeypatch):
    """Gets over mapped chunk files take the numpy path and the general miss path (the reference of
    the C loop, store/mappedget.py), as where the C helpers do not build."""
    from lightning_embcache.store import mappedget

    monkeypatch.setattr(mappedget.NativeGet, "ready", lambda self: False)


@pytest.fixture
def native_gets():
    """The C loop of store/mappedget.py; skipped where the C helpers or ISA-L's CRC are not there."""
    from lightning_embcache import native
    from lightning_embcache.store import mappedget

    if native.library() is None or mappedget.crc32_function() is None:
        missing("the C helpers (a C compiler) and isal")
