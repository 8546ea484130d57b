"""A missing fast path skips its tests, except where EMBCACHE_REQUIRE_FAST_PATHS=1 (the reference
CI machine, through .ci/run): there it fails them."""

from __future__ import annotations

import fastpaths
import pytest


def test_a_missing_fast_path_skips_by_default(monkeypatch):
    monkeypatch.setattr(fastpaths, "REQUIRED", False)
    with pytest.raises(pytest.skip.Exception, match="io_uring is not available here"):
        fastpaths.missing("io_uring")
    assert fastpaths.skip_unless(False, "io_uring").args == (True,)


def test_a_missing_fast_path_fails_where_it_is_required(monkeypatch):
    monkeypatch.setattr(fastpaths, "REQUIRED", True)
    with pytest.raises(pytest.fail.Exception, match="EMBCACHE_REQUIRE_FAST_PATHS=1"):
        fastpaths.missing("io_uring")
    assert fastpaths.skip_unless(False, "io_uring").args == (False,)
