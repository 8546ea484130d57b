"""A store folder deleted or moved between a checkpoint and its resume."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from _lightning_helpers import RecordRows, tiny_model, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_embcache import VersionNotFoundError
from lightning_embcache.lightning.mixin import follow_moved_files

ALL = torch.arange(512)


def _fit(run, steps, *callbacks, ckpt_path=None):
    model = tiny_model(run / "latents")
    every = ModelCheckpoint(dirpath=run / "ck", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = tiny_trainer(run, max_steps=steps, callbacks=[every, *callbacks], enable_checkpointing=True)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def test_resume_with_the_store_folder_deleted_refuses_before_creating_anything(tmp_path):
    run = tmp_path / "run"
    _fit(run, 4)
    shutil.rmtree(run / "latents")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    ckpt = run / "ck" / "step=4.ckpt"
    with pytest.raises(VersionNotFoundError) as err:
        _fit(run, 6, ckpt_path=ckpt)
    msg = str(err.value)
    assert str(run / "latents") in msg and "does not exist" in msg and str(ckpt) in msg
    assert "reclaimed" not in msg  # the old message blamed retention
    assert not (run / "latents").exists()  # no empty store made in its place
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_moved_run_folder_warns_and_keeps_every_checkpoint_resumable(tmp_path):
    rows = RecordRows()
    _fit(tmp_path / "a", 6, rows)
    shutil.move(tmp_path / "a", tmp_path / "b")
    run = tmp_path / "b"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(run, 10, ckpt_path=run / "ck" / "step=6.ckpt")  # saves at steps 8 and 10 sweep the registry
    moved = [str(w.message) for w in caught if "when checkpointed and is at" in str(w.message)]
    assert moved and str(tmp_path / "a" / "latents") in moved[0] and str(run / "latents") in moved[0]
    # every checkpoint that moved with the store still opens at the rows it saved
    for step in (2, 4, 6):
        resumed = _fit(run, step, ckpt_path=run / "ck" / f"step={step}.ckpt")
        assert torch.equal(resumed.latents.get(ALL), rows.rows[step]), step
        resumed.latents.close()


def test_follow_moved_files_rewrites_only_files_that_exist_under_the_new_folder(tmp_path):
    (tmp_path / "new" / "ck").mkdir(parents=True)
    (tmp_path / "new" / "ck" / "x.ckpt").write_bytes(b"")
    (tmp_path / "elsewhere.ckpt").write_bytes(b"")
    versions = {1: [str(tmp_path / "old" / "ck" / "x.ckpt")], 2: [str(tmp_path / "old" / "ck" / "gone.ckpt")],
                3: [str(tmp_path / "elsewhere.ckpt")]}
    assert follow_moved_files(versions, tmp_path / "old" / "latents", tmp_path / "new" / "latents") == 1
    assert versions == {1: [str(tmp_path / "new" / "ck" / "x.ckpt")], 2: [str(tmp_path / "old" / "ck" / "gone.ckpt")],
                        3: [str(tmp_path / "elsewhere.ckpt")]}


def test_load_from_checkpoint_with_the_store_folder_deleted_names_it_and_makes_nothing(tmp_path):
    from lightning_embcache.demo import AutoDecoder

    run = tmp_path / "run"
    _fit(run, 4)
    shutil.rmtree(run / "latents")
    with pytest.raises(VersionNotFoundError, match="does not exist"):
        AutoDecoder.load_from_checkpoint(run / "ck" / "step=4.ckpt")
    assert not (run / "latents").exists()
