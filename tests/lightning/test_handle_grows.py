"""`handle.grow` in a real `lightning.Trainer` fit: a checkpoint taken before the growth resumes the
old table exactly, one taken after resumes the grown one; new rows train like the others."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from _lightning_helpers import tiny_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_embcache import DeferredSync, EmbeddingStore, EmbeddingStoreMixin
from lightning_embcache.store.errors import InvalidArgumentError

N, GROWN, DIM = 100, 260, 4  # chunk_rows=64: the table's last chunk is short when it grows
GROW_AT = 3  # the callback grows the table after this step


class Codes(EmbeddingStoreMixin, L.LightningModule):
    """Trainable codes; batches draw ids over the grown size and keep those the table has now."""

    def __init__(self, path, hot_bytes=None) -> None:
        super().__init__()
        self.codes = self.add_embedding_store("codes", num_rows=N, dim=DIM, path=path, hot_bytes=hot_bytes,
                                              chunk_rows=64, init="normal", seed=4, optimizer="adam", lr=0.1,
                                              if_exists="resume")
        self.head = torch.nn.Linear(DIM, 1)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        ids = ids[ids < self.codes.num_rows]
        return self.head(self.codes.lookup(ids)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.01)

    def train_dataloader(self):
        ids = torch.randint(0, GROWN, (128,), generator=torch.Generator().manual_seed(0))  # 2 steps an epoch
        return DataLoader(TensorDataset(ids), batch_size=64)


class GrowAt(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == GROW_AT:
            pl_module.codes.grow(GROWN)


class RecordRows(Callback):
    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.rows[trainer.global_step] = pl_module.codes.get(torch.arange(pl_module.codes.num_rows))


def fresh_rows(num_rows: int) -> torch.Tensor:
    with EmbeddingStore.create(None, num_rows, DIM, chunk_rows=64, init="normal", seed=4) as s:
        return s.get(torch.arange(num_rows))


@pytest.mark.parametrize(("hot_bytes", "sync"), [(None, False), (40 * (16 * 3 + 11), False), (None, True)],
                         ids=["memory", "disk", "memory-background-flushes"])
def test_checkpoints_before_and_after_the_growth_resume_their_own_size(tmp_path, hot_bytes, sync):
    rows = RecordRows()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    model = Codes(tmp_path / "codes", hot_bytes)
    flushes = [DeferredSync(every_n_steps=1, background=True)] if sync else []
    trainer = tiny_trainer(tmp_path, max_steps=6, callbacks=[GrowAt(), rows, ckpt, *flushes],
                           enable_checkpointing=True)
    trainer.fit(model)
    assert model.codes.num_rows == GROWN
    assert rows.rows[2].shape == (N, DIM) and rows.rows[4].shape == (GROWN, DIM)
    # rows never looked up since the growth hold their initial values, as in a table created at GROWN
    final = model.codes.get(torch.arange(GROWN))
    seen = torch.zeros(GROWN, dtype=torch.bool)
    for (ids,) in Codes(None).train_dataloader():
        seen[ids] = True
    assert torch.equal(final[~seen], fresh_rows(GROWN)[~seen])
    assert not torch.equal(final[N:][seen[N:]], fresh_rows(GROWN)[N:][seen[N:]]), "new rows did not train"

    for step, size in ((2, N), (4, GROWN), (6, GROWN)):
        resumed = Codes(tmp_path / "codes", hot_bytes)  # declared at N, as the run's own code declares it
        tiny_trainer(tmp_path, max_steps=step).fit(resumed, ckpt_path=tmp_path / "ck" / f"step={step}.ckpt")
        assert resumed.codes.num_rows == size, f"checkpoint of step {step}"
        assert torch.equal(resumed.codes.get(torch.arange(size)), rows.rows[step]), f"checkpoint of step {step}"
        with pytest.raises(InvalidArgumentError, match=rf"ids must be in \[0, {size}\)"):
            resumed.codes.get(torch.tensor([size]))
        resumed.codes.close()


def test_resuming_before_the_growth_and_growing_again_repeats_the_run(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    rows = RecordRows()
    tiny_trainer(tmp_path, max_steps=6, callbacks=[GrowAt(), rows, ckpt], enable_checkpointing=True).fit(
        Codes(tmp_path / "codes"))
    again = RecordRows()
    resumed = Codes(tmp_path / "codes")
    tiny_trainer(tmp_path, max_steps=6, callbacks=[GrowAt(), again]).fit(
        resumed, ckpt_path=tmp_path / "ck" / "step=2.ckpt")
    assert resumed.codes.num_rows == GROWN
    assert torch.equal(resumed.codes.get(torch.arange(GROWN)), rows.rows[6])
    resumed.codes.close()


def test_handle_grow_outside_a_fit_is_durable_with_the_next_flush(tmp_path):
    model = Codes(tmp_path / "codes")
    model.codes.update(torch.tensor([99]), torch.ones(1, DIM))
    model.codes.flush()
    model.codes.grow(GROWN)
    assert model.codes.num_rows == GROWN and model.codes.store.num_rows == GROWN
    assert torch.equal(model.codes.get(torch.arange(N, GROWN)), fresh_rows(GROWN)[N:])
    model.codes.close()  # close() flushes: the growth is durable
    again = Codes(tmp_path / "codes")
    assert again.codes.num_rows == N  # declared; the store opens on first use
    assert torch.equal(again.codes.get(torch.tensor([99])), torch.ones(1, DIM))
    assert again.codes.num_rows == GROWN
    with pytest.raises(InvalidArgumentError, match=r"num_rows must be in \[260, .*got 100"):
        again.codes.grow(N)
    assert again.codes.num_rows == GROWN
    again.codes.close()


def test_a_store_smaller_than_declared_is_refused(tmp_path):
    EmbeddingStore.create(tmp_path / "codes", N - 1, DIM, chunk_rows=64).close()
    model = Codes(tmp_path / "codes")
    with pytest.raises(InvalidArgumentError, match=r"holds 99 x 4 rows; add_embedding_store asked for num_rows=100"):
        model.codes.get(torch.tensor([0]))
