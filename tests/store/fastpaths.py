"""Skips for the store's Linux fast paths (io_uring, hole punching, sync_file_range) that turn
into failures where they must exist: on the reference CI machine `.ci/run` sets
``EMBCACHE_REQUIRE_FAST_PATHS=1``, so a fast path that stopped being detected cannot go
untested silently."""

from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("EMBCACHE_REQUIRE_FAST_PATHS") == "1"


def missing(what: str) -> None:
    """Skip the calling test because ``what`` is not available here, or fail where it must be."""
    if REQUIRED:
        pytest.fail(f"{what} is not available, but EMBCACHE_REQUIRE_FAST_PATHS=1 says this machine has it")
    pytest.skip(f"{what} is not available here")


def skip_unless(available: bool, what: str) -> pytest.MarkDecorator:
    """A module mark: skip unless ``available``; with EMBCACHE_REQUIRE_FAST_PATHS=1 never skipped
    (the tests then run, and fail, where the fast path is missing)."""
    return pytest.mark.skipif(not available and not REQUIRED, reason=f"{what} is not available here")
