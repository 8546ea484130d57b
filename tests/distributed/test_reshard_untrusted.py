"""`embcache reshard` reads a checkpoint the way Lightning's own resume does: weights only, so a
crafted file cannot run code, while a real checkpoint of a fit still reshards."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lightning"))
from _lightning_helpers import SAMPLES, tiny_model, tiny_trainer  # noqa: E402

from lightning_embcache import EmbeddingStore, InvalidArgumentError  # noqa: E402
from lightning_embcache.cli import main as cli  # noqa: E402
from lightning_embcache.distributed.reshard import reshard_checkpoint  # noqa: E402
from lightning_embcache.distributed.sharding import GlobalNormalInit, RowSharding, shard_dir  # noqa: E402


class _Payload:
    """Unpickling this calls os.mkdir(marker): proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _crafted(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "code-ran"
    ckpt = tmp_path / "evil.ckpt"
    torch.save({"embedding_stores": {"latents": {"path": str(tmp_path / "s"), "version": 1}},
                "state_dict": {}, "hyper_parameters": {"x": _Payload(marker)}}, ckpt, pickle_module=pickle)
    return ckpt, marker


def test_a_crafted_checkpoint_is_refused_by_the_cli_and_its_code_never_runs(tmp_path, capsys):
    ckpt, marker = _crafted(tmp_path)
    assert cli(["reshard", "--checkpoint", str(ckpt), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert "weights-only" in err and "checkpoint=" in err and str(ckpt) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.ckpt"]  # nothing written


def test_a_crafted_checkpoint_is_refused_through_the_python_api(tmp_path):
    ckpt, marker = _crafted(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"checkpoint=.*weights-only.*safe_globals"):
        reshard_checkpoint(ckpt, 2, paths={"latents": str(tmp_path / "new")})
    assert not marker.exists() and not (tmp_path / "new").exists()


def test_a_file_that_is_no_checkpoint_is_refused_by_name(tmp_path):
    bad = tmp_path / "notes.ckpt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(InvalidArgumentError, match=r"checkpoint=.*notes\.ckpt"):
        reshard_checkpoint(bad, 2)
    with pytest.raises(InvalidArgumentError, match=r"does not exist"):
        reshard_checkpoint(tmp_path / "missing.ckpt", 2)


def test_a_real_fit_checkpoint_still_reshards_with_every_row(tmp_path):
    store = tmp_path / "store"
    model = tiny_model(store)
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    trainer = tiny_trainer(tmp_path, callbacks=[ck], max_epochs=1, enable_checkpointing=True)
    trainer.fit(model)
    with EmbeddingStore.open(store, readonly=True) as s:
        want = s.get(torch.arange(SAMPLES))
    out = reshard_checkpoint(tmp_path / "ck" / "last.ckpt", 2, paths={"latents": str(tmp_path / "two")})
    refs = torch.load(out, weights_only=True)["embedding_stores"]["latents"]
    sharding = RowSharding(SAMPLES, 2)
    got = torch.empty_like(want)
    for q in range(2):
        sh = refs["shards"]
        init = GlobalNormalInit(sharding, q, sh["dim"], sh["seed"], sh["init_std"])
        with EmbeddingStore.open(shard_dir(tmp_path / "two", q, 2), version=sh["versions"][q], readonly=True,
                                 init=init) as s:
            ids = sharding.global_ids(q, torch.arange(sharding.shard_rows(q)))
            got[ids] = s.get(torch.arange(sharding.shard_rows(q)))
    assert torch.equal(got, want)
