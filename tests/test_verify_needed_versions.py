"""`embcache verify` checks every version something still names: a pinned version (PINS) or one a
checkpoint registry names, whose manifest was deleted, fails verify by name instead of a later resume."""

from __future__ import annotations

import json

import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.cli import main as embcache
from lightning_embcache.lightning.checkpoint_pins import registry_path


def _store(path):
    with EmbeddingStore.create(path, 100, 4) as s:
        s.update(torch.arange(5), torch.ones(5, 4))
        v1 = s.flush()
        s.pin(v1)
        s.update(torch.arange(5), torch.full((5, 4), 2.0))
        s.flush()
    return v1


def test_a_deleted_pinned_version_fails_verify_by_name(tmp_path, capsys):
    path = tmp_path / "s"
    v1 = _store(path)
    assert embcache(["verify", str(path)]) == 0
    capsys.readouterr()
    (path / f"manifest-{v1:012d}").unlink()
    assert embcache(["verify", str(path)]) != 0
    out = capsys.readouterr().out
    assert f"version {v1} is pinned (PINS)" in out and f"manifest-{v1:012d}" in out
    assert embcache(["verify", str(path), "--latest"]) != 0


def test_a_version_a_checkpoint_names_is_checked_even_when_only_the_latest_is(tmp_path, capsys):
    path = tmp_path / "s"
    v1 = _store(path)
    registry_path(path).write_text(json.dumps({"format": 1, "versions": {str(v1): [str(tmp_path / "last.ckpt")]}}))
    (path / f"manifest-{v1:012d}").unlink()
    assert embcache(["verify", str(path), "--latest"]) != 0
    out = capsys.readouterr().out
    assert "named by checkpoint" in out and "last.ckpt" in out
