"""docs/api.md lists every public method and property of every public class."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import lightning_embcache

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gen_api_docs  # noqa: E402


def test_the_api_reference_lists_every_public_method_of_every_public_class():
    """A public method or property of a public class, its own or a base's inside the package,
    missing from docs/api.md (or without a docstring to put there) fails here."""
    text = (ROOT / "docs" / "api.md").read_text()
    names = {n: getattr(lightning_embcache, n) for n in lightning_embcache.__all__}
    names.update(gen_api_docs.EXTRA)
    missing = []
    for cls_name, cls in names.items():
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        for member, _ in gen_api_docs.public_members(cls):
            if not member.startswith("__") and f"`{cls_name}.{member}" not in text:
                missing.append(f"{cls_name}.{member}")
    assert not missing, f"public members missing from docs/api.md (add a docstring, then `make docs-api`): {missing}"


def test_methods_inherited_from_the_stores_bases_are_listed():
    members = dict(gen_api_docs.public_members(lightning_embcache.EmbeddingStore))
    for name in ("flush", "pin", "unpin", "pinned", "versions", "compact", "set_budget", "evict", "upcoming",
                 "manifest_checksum"):
        assert name in members, name
