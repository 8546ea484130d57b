"""`embcache demo`, run tiny."""

from __future__ import annotations

from lightning_embcache.cli import main as embcache


def test_demo_runs_tiny_and_reports(tmp_path, capsys):
    rc = embcache(["demo", "--samples", "4096", "--dim", "16", "--max-steps", "12", "--batch-size", "256",
                   "--workers", "0", "--sync-every", "3", "--ckpt-every", "5", "--root", str(tmp_path / "demo")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "trained 12 steps" in out
    assert "store 'latents'" in out and "hit rate" in out and "DeferredSync:" in out
    assert "memory:" in out and "RSS now" in out
    assert (tmp_path / "demo" / "latents").is_dir()
    assert sorted(p.name for p in (tmp_path / "demo" / "checkpoints").glob("*.ckpt")) == [
        "epoch=0-step=10.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"]
