"""Every checkpoint kept (save_top_k=-1) pins a store version; the pinned versions share the
chunk files, so the store holds about one table plus the rows each epoch changed, and each
checkpoint still restores its own rows bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch
from _lightning_helpers import BATCH, RecordRows, tiny_model, tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_embcache.demo import AutoDecoder

ROWS, CHUNK = 2048, 128
ALL = torch.arange(ROWS)


class CompactEachEpoch(Callback):
    """Compaction run to completion at each epoch start (as background passes do over a longer
    epoch), so every kept checkpoint spans a compaction."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        pl_module.latents.store.compact()


def _model(path: Path) -> AutoDecoder:
    return tiny_model(path, hot_bytes=64 << 10, num_samples=ROWS, chunk_rows=CHUNK)


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_checkpoints_kept_share_the_stores_chunk_files(tmp_path):
    store_path = tmp_path / "latents"
    # One full epoch writes every row (then compacted, the table lives in base chunk files), and
    # seven epochs of two batches each follow, each kept as a checkpoint.
    full = ModelCheckpoint(dirpath=tmp_path / "full", filename="{epoch}", every_n_epochs=1)
    tiny_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[full]).fit(_model(store_path))
    model = _model(store_path)
    rows = RecordRows()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    trainer = tiny_trainer(tmp_path, max_epochs=8, limit_train_batches=2, enable_checkpointing=True,
                           callbacks=[rows, ckpt, CompactEachEpoch()])
    trainer.fit(model, ckpt_path=tmp_path / "full" / "epoch=0.ckpt")
    store = model.latents.store
    table = store.stats().table_bytes
    changed = 7 * 2 * BATCH * store._core.row_bytes  # rows updated (at most) after the first epoch
    store.compact()
    pinned = store.pinned()
    model.latents._release()
    assert len(pinned) >= 6
    held = _disk_bytes(store_path)
    assert held <= 1.3 * table + 1.5 * changed + (64 << 10), (
        f"{len(pinned)} checkpoints kept: {held / table:.2f} tables on disk for {changed / table:.2f} tables of rows "
        f"changed")
    first = min(rows.rows)
    path = tmp_path / "ck" / "epoch=1.ckpt"
    old = AutoDecoder.load_from_checkpoint(path)
    assert torch.equal(old.latents.get(ALL), rows.rows[first])
    old.latents._release()
    resumed = _model(store_path)
    tiny_trainer(tmp_path, max_epochs=2, limit_train_batches=2).fit(resumed, ckpt_path=path)
    assert torch.equal(resumed.latents.get(ALL), rows.rows[first]), "resume from the first checkpoint"
