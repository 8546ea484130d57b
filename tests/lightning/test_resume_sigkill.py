"""Resume after SIGKILL: rows and parameters equal an uninterrupted run, bit for bit (CPU)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _lightning_train_script import train

from lightning_embcache import EmbeddingStore

SCRIPT = Path(__file__).with_name("_lightning_train_script.py")
REPO = Path(__file__).resolve().parents[2]
STEPS, CKPT_EVERY = 24, 5


def _start(root: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(SCRIPT), str(root), "--steps", str(STEPS),
                             "--ckpt-every", str(CKPT_EVERY), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


def _latest_loadable_checkpoint(folder: Path) -> Path:
    """The checkpoint with the highest step that loads (one being written at the kill may be torn)."""
    for path in sorted(folder.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]), reverse=True):
        try:
            torch.load(path, map_location="cpu", weights_only=False)
            return path
        except Exception:
            continue
    raise AssertionError(f"no loadable checkpoint in {folder}")


def _final_state(root: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    params = torch.load(root / "final.pt")
    with EmbeddingStore.open(root / "latents", readonly=True) as store:
        rows = store.get(torch.arange(store.num_rows))
    return params, rows


def _kill_after_a_checkpoint(root: Path, seed: int, *extra: str) -> int:
    """Start a run, SIGKILL it at a random step after its first checkpoint; returns that step."""
    kill_at = random.Random(seed).randint(CKPT_EVERY + 1, STEPS - 2)
    proc = _start(root, "--step-sleep", "0.05", *extra)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.strip() == f"STEP {kill_at}":
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    return kill_at


def _resume_equivalence(tmp_path: Path, seed: int, hot_bytes: int | None = None) -> None:
    extra = ("--hot-bytes", str(hot_bytes)) if hot_bytes else ()
    train(tmp_path / "reference", STEPS, CKPT_EVERY, hot_bytes=hot_bytes)  # uninterrupted, in this process
    killed = tmp_path / "killed"
    kill_at = _kill_after_a_checkpoint(killed, seed, *extra)
    ckpt = _latest_loadable_checkpoint(killed / "checkpoints")
    resumed_from = int(ckpt.stem.split("=")[1])
    assert CKPT_EVERY <= resumed_from <= kill_at
    # The killed run flushed after that checkpoint: the store's latest version is not the checkpoint's.
    with EmbeddingStore.open(killed / "latents", readonly=True) as store:
        ref = torch.load(ckpt, weights_only=False)["embedding_stores"]["latents"]
        assert store.versions()[-1] >= ref["version"]
    train(killed, STEPS, CKPT_EVERY, resume=str(ckpt), hot_bytes=hot_bytes)

    want_params, want_rows = _final_state(tmp_path / "reference")
    got_params, got_rows = _final_state(killed)
    assert torch.equal(got_rows, want_rows), f"rows differ after resume from step {resumed_from}"
    assert want_params.keys() == got_params.keys()
    for name in want_params:
        assert torch.equal(got_params[name], want_params[name]), name


def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path):
    _resume_equivalence(tmp_path, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_resume_after_sigkill_equals_uninterrupted_run_disk_mode(tmp_path, seed):
    # Disk mode: rows stream through an 8 KiB hot tier (a quarter of the table).
    _resume_equivalence(tmp_path, seed, hot_bytes=8192)
