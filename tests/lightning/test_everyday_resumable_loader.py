"""Exact mid-epoch resume with a user's own Dataset: kill -9 mid-epoch, resume, and the rows and
parameters equal those of an uninterrupted run (ResumableLoader); a plain shuffled DataLoader does not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import psutil
import pytest
import torch
from _own_dataset_script import BATCH, CKPT_EVERY, SAMPLES, Molecules, train

from lightning_embcache import EmbeddingStore, InvalidArgumentError, ResumableLoader

SCRIPT = Path(__file__).with_name("_own_dataset_script.py")
REPO = Path(__file__).resolve().parents[2]


def _killed_mid_epoch(root: Path, kind: str, kill_at: int, *extra: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(root), "--loader", kind, "--step-sleep", "0.05", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    seen = []
    workers: list[psutil.Process] = []
    for line in proc.stdout:  # type: ignore[union-attr]
        seen.append(line)
        if line.strip() == f"STEP {kill_at}":
            workers = psutil.Process(proc.pid).children(recursive=True)
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    # DataLoader workers forked from the killed process notice it is gone within seconds; until
    # then they hold the copy of the store's lock they were forked with
    psutil.wait_procs(workers, timeout=30)


def _final(root: Path):
    with EmbeddingStore.open(root / "codes", readonly=True) as store:
        rows = store.get(torch.arange(SAMPLES))
    return torch.load(root / "final.pt"), rows


def _kill_resume_compare(tmp_path: Path, kind: str, *extra: str) -> bool:
    hot = int(extra[1]) if extra[:1] == ("--hot-bytes",) else None
    workers = int(extra[-1]) if "--workers" in extra else 0
    train(tmp_path / "reference", kind, hot_bytes=hot, workers=workers)
    killed = tmp_path / "killed"
    kill_at = 2 * CKPT_EVERY + 2  # in epoch 1 (10 batches an epoch); the last checkpoint, step 14, is mid-epoch too
    _killed_mid_epoch(killed, kind, kill_at, *extra)
    ckpt = killed / "checkpoints" / f"step={2 * CKPT_EVERY}.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(killed, kind, resume=str(ckpt), hot_bytes=hot, workers=workers)
    (want_params, want_rows), (got_params, got_rows) = _final(tmp_path / "reference"), _final(killed)
    return torch.equal(got_rows, want_rows) and all(torch.equal(got_params[k], want_params[k]) for k in want_params)


def test_kill_mid_epoch_and_resume_equals_an_uninterrupted_run(tmp_path):
    assert _kill_resume_compare(tmp_path, "resumable")


@pytest.mark.slow
def test_kill_mid_epoch_and_resume_equals_an_uninterrupted_run_disk_mode_with_workers(tmp_path):
    assert _kill_resume_compare(tmp_path, "resumable", "--hot-bytes", "8192", "--workers", "2")


def test_a_plain_shuffled_loader_resumed_mid_epoch_differs(tmp_path):
    # the friction this loader removes: the plain loader replays its epoch from the start
    assert not _kill_resume_compare(tmp_path, "plain")


def test_state_dict_names_the_epoch_and_the_batches_delivered():
    loader = ResumableLoader(Molecules(), batch_size=BATCH, shuffle=True, seed=3)
    loader.sampler.set_epoch(2)
    it = iter(loader)
    first = [next(it)[0] for _ in range(3)]
    assert loader.state_dict() == {"epoch": 2, "batches": 3}
    rest = [b[0] for b in it]
    again = ResumableLoader(Molecules(), batch_size=BATCH, shuffle=True, seed=3)
    again.sampler.set_epoch(2)
    again.load_state_dict({"epoch": 2, "batches": 3})
    resumed = [b[0] for b in again]
    assert len(resumed) == len(rest) and all(torch.equal(a, b) for a, b in zip(resumed, rest))
    assert sorted(torch.cat(first + rest).tolist()) == list(range(SAMPLES))  # every sample once an epoch
    again.sampler.set_epoch(3)
    assert not torch.equal(next(iter(again))[0], first[0])  # another epoch, another order; the state was used once


def test_bad_arguments_are_named():
    with pytest.raises(InvalidArgumentError, match="batch_sampler"):
        ResumableLoader(Molecules(), batch_sampler=[[0]])
    with pytest.raises(InvalidArgumentError, match="shuffle"):
        ResumableLoader(Molecules(), shuffle=True, sampler=range(SAMPLES))
    with pytest.raises(InvalidArgumentError, match="epoch"):
        ResumableLoader(Molecules()).load_state_dict({"batches": 3})
