"""validate / test / predict read the rows a fit trained, under inference mode and under no_grad.

Reference: the rows as a separate read-only `EmbeddingStore.open` of the same path sees them, and
the decoder applied to those rows by hand.
"""

from __future__ import annotations

import pytest
import torch
from _everyday_model import Model, N, data, on_disk, trainer

from lightning_embcache import EmbeddingStore


@pytest.mark.parametrize("inference_mode", [True, False], ids=["inference_mode", "no_grad"])
@pytest.mark.parametrize("read", ["get", "lookup"])
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "direct"])
def test_every_stage_reads_the_trained_rows(tmp_path, read, inference_mode, trainable):
    if read == "lookup" and not trainable:
        pytest.skip("lookup needs optimizer=")
    path = tmp_path / "latents"
    model = Model(path, read, trainable)
    init = model.latents.get(torch.arange(N))
    trainer(tmp_path, inference_mode=inference_mode).fit(model, data(), data())
    trained = on_disk(path)
    assert not torch.equal(trained, init), "fit trained no row"
    # validation during fit ran before the last steps; the eval stages below see the final rows
    for stage in ("validate", "test", "predict"):
        out = getattr(trainer(tmp_path, inference_mode=inference_mode), stage)(model, data())
        ids = torch.cat([i for i, _ in model.seen[stage]])
        rows = torch.cat([z for _, z in model.seen[stage]])
        torch.testing.assert_close(rows, trained[ids], rtol=0, atol=0)
        if stage == "predict":
            with torch.no_grad():
                torch.testing.assert_close(torch.cat(out), model.decoder(trained[ids]))
    assert torch.equal(on_disk(path), trained), "evaluation changed rows"


def test_validation_inside_fit_under_inference_mode_leaves_training_working(tmp_path):
    """Sanity check + per-epoch validation under inference mode, then more training steps on the same store."""
    path = tmp_path / "latents"
    model = Model(path, "get")
    trainer(tmp_path, max_epochs=3, num_sanity_val_steps=2).fit(model, data(), data())
    meta = model.latents.row_meta(torch.arange(N))
    assert int(meta["updates"].min()) == 3, "every row is trained once per epoch"
    assert len(model.seen["validate"]) == 2 + 3 * 6


def test_bare_store_calls_inside_inference_mode(tmp_path):
    model = Model(tmp_path / "latents", "get")
    ids = torch.arange(10)
    with torch.inference_mode():
        z = model.latents.get(torch.arange(10))
        model.latents.update(ids, z + 1)
        again = model.latents.lookup(ids=torch.arange(10))
    assert torch.equal(again, z + 1)
    model.latents.update(ids, again * 2)  # the store holds no inference tensor: in-place updates still work
    assert torch.equal(model.latents.get(ids), (z + 1) * 2)
    model.latents.close()


def test_predict_with_a_model_loaded_from_a_checkpoint_reads_its_version(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    path = tmp_path / "latents"
    model = Model(path, "lookup")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1)
    trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[ckpt]).fit(model, data())
    first = tmp_path / "ck" / "epoch=0-step=6.ckpt"
    at_first = torch.load(first, weights_only=False)["embedding_stores"]["latents"]["version"]
    with EmbeddingStore.open(path, version=at_first, readonly=True) as store:
        expected = store.get(torch.arange(N))
    loaded = Model.load_from_checkpoint(first, path=path, read="lookup")  # another process would do the same
    out = trainer(tmp_path).predict(loaded, data())
    ids = torch.cat([i for i, _ in loaded.seen["predict"]])
    torch.testing.assert_close(torch.cat([z for _, z in loaded.seen["predict"]]), expected[ids], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(out), loaded.decoder(expected[ids]))
    assert not torch.equal(on_disk(path), expected), "the newest version differs: the checkpoint's was read"


def test_row_meta_of_a_store_trained_elsewhere_is_a_plain_read(tmp_path):
    path = tmp_path / "latents"
    trained = Model(path, "get")
    trainer(tmp_path, max_epochs=2).fit(trained, data())
    expected = trained.latents.row_meta(torch.arange(N))
    trained.latents.close()
    reader = Model(path, "get")  # a new process evaluating the rows: no if_exists, no writer lock
    got = reader.latents.row_meta(torch.arange(N))
    assert torch.equal(got["updates"], expected["updates"]) and int(got["updates"].min()) == 2
    assert torch.equal(got["last_step"], expected["last_step"])
    with EmbeddingStore.open(path) as writer:  # the lock is free: the read took none
        assert writer.version >= 1
