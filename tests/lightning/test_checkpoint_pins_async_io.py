"""A checkpoint written asynchronously (Lightning's AsyncCheckpointIO) keeps its store version
pinned from the save until its file exists: a sweep in between (the next save's, or a removal's)
must not release it, or a flush reclaims the version and resuming from that file fails."""

from __future__ import annotations

import threading

import torch
from _lightning_helpers import RecordRows, tiny_model, tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from lightning_embcache import EmbeddingStore
from lightning_embcache.store.pins_registry import CHECKPOINT_KEY


class _GatedIO(TorchCheckpointIO):
    """Writes a checkpoint only once the gate opens (the async writer thread waits there)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        assert self.gate.wait(120), "the test never opened the gate"
        super().save_checkpoint(checkpoint, path, storage_options)


class _OpenAt(Callback):
    def __init__(self, gate: threading.Event, step: int) -> None:
        self.gate, self.step = gate, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            self.gate.set()


def test_an_async_checkpoint_keeps_its_version_until_its_file_is_written(tmp_path):
    gate = threading.Event()
    model = tiny_model(tmp_path / "latents")
    rows = RecordRows()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1,
                           filename="{step}")
    # three saves (steps 2, 4, 6), each flushing a new version, while the first file waits
    trainer = tiny_trainer(tmp_path, callbacks=[ckpt, rows, _OpenAt(gate, 7)], max_epochs=1,
                           enable_checkpointing=True, plugins=[AsyncCheckpointIO(_GatedIO(gate))])
    trainer.fit(model)
    files = sorted((tmp_path / "ckpt").glob("step=*.ckpt"))
    assert len(files) >= 3
    for f in files:
        ck = torch.load(f, map_location="cpu", weights_only=False)
        ref = ck[CHECKPOINT_KEY]["latents"]
        step = int(f.stem.split("=")[1])
        with EmbeddingStore.open(tmp_path / "latents", version=ref["version"], readonly=True) as s:
            assert torch.equal(s.get(torch.arange(s.num_rows)), rows.rows[step]), f.name


def test_a_removal_swept_between_a_pin_and_its_file_keeps_the_new_version(tmp_path):
    """The window inside one save: the version is pinned, the file not yet attached, and another
    thread handles a removal (detach + sweep). The fresh version stays pinned through it and the
    flushes after it; its file attached later keeps it."""
    from lightning_embcache.store.pins_registry import CheckpointPins

    store = EmbeddingStore.create(tmp_path / "s", 100, 4, init="zeros", chunk_rows=16)
    pins = CheckpointPins(tmp_path / "s")
    store.update(torch.tensor([1]), torch.ones(1, 4))
    v = store.flush()
    old = tmp_path / "old.ckpt"
    old.write_bytes(b"x")
    pins.attach(v, str(old))
    store.update(torch.tensor([2]), torch.ones(1, 4))
    fresh = store.flush()
    pins.pin(store, fresh)  # on_save_checkpoint
    old.unlink()
    pins.detach(str(old))  # a removal handled meanwhile
    pins.sweep(store)
    for k in range(3):  # flushes reclaim every version nobody pins
        store.update(torch.tensor([3 + k]), torch.ones(1, 4))
        store.flush()
    assert fresh in store.versions() and v not in store.versions()
    new = tmp_path / "new.ckpt"
    new.write_bytes(b"x")
    pins.attach(fresh, str(new))
    pins.sweep(store)
    assert fresh in store.versions()
    store.close()
