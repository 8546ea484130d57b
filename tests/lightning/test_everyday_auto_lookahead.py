"""The mixin announces the training loader's coming batches by default, once the first batches show
that the loader's indices are the ids the step reads; otherwise it announces nothing."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from _lightning_helpers import tiny_trainer
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

from lightning_embcache import EmbeddingStoreMixin, LookaheadSampler

N = 2048


class Codes(EmbeddingStoreMixin, L.LightningModule):
    """Reads row ``(index + shift) % N`` for sample ``index``: shift 0 means indices are ids."""

    def __init__(self, path, shift=0, announce=True, loader=None):
        super().__init__()
        self.shift, self.announce_upcoming, self.loader = shift, announce, loader
        self.codes = self.add_embedding_store("codes", num_rows=N, dim=8, path=path, hot_bytes=24 << 10,
                                              init="normal", optimizer="sgd", lr=0.5)
        torch.manual_seed(0)
        self.head = torch.nn.Linear(8, 4)

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return F.mse_loss(self.head(self.codes.lookup((ids + self.shift) % N)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


class WithItsOwnLoader(Codes):
    def train_dataloader(self):
        return _loader()


def _loader(**kw):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.arange(N), torch.randn(N, 4, generator=g))
    return DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1), **kw)


def _fit(model, tmp_path, loader=None):
    tiny_trainer(tmp_path, max_epochs=2).fit(model, loader)
    stats = model.codes.stats()
    return model.codes.get(torch.arange(N)), stats.prefetch_hits + stats.prefetch_misses, stats


def test_a_plain_shuffled_loader_is_announced_and_the_rows_are_those_of_a_run_without(tmp_path):
    loader = _loader()
    own = loader.batch_sampler
    rows, hinted, stats = _fit(Codes(tmp_path / "a"), tmp_path, loader)
    assert hinted > N  # rows of both epochs were announced before their batches read them
    assert stats.prefetch_hits > 0
    assert loader.batch_sampler is own  # the user's loader is as it was after fit
    rows_off, hinted_off, _ = _fit(Codes(tmp_path / "b", announce=False), tmp_path, _loader())
    assert hinted_off == 0
    assert torch.equal(rows, rows_off)  # a hint never changes a row


def test_indices_that_are_not_the_ids_read_announce_nothing(tmp_path):
    rows, hinted, _ = _fit(Codes(tmp_path / "a", shift=5), tmp_path, _loader())
    assert hinted == 0  # not even the batches in the window while the first ones were checked


def test_a_loader_made_by_the_module_is_announced_and_the_module_left_as_it_was(tmp_path):
    model = WithItsOwnLoader(tmp_path / "a")
    _, hinted, _ = _fit(model, tmp_path)
    assert hinted > N
    assert "train_dataloader" not in vars(model)


def test_a_loader_already_wrapped_by_the_user_is_left_alone(tmp_path):
    model = Codes(tmp_path / "a")
    base = _loader()
    calls = []

    class Counting(LookaheadSampler):
        def _hint(self, indices):
            calls.append(1)
            super()._hint(indices)

    def wrapped():
        return DataLoader(base.dataset, batch_sampler=Counting(BatchSampler(base.sampler, 64, False),
                                                               model.codes._store))

    model.train_dataloader = wrapped
    _, hinted, _ = _fit(model, tmp_path)
    assert calls and hinted > 0  # the user's own sampler announced; nothing was stacked on it


def test_a_loader_with_workers_is_announced(tmp_path):
    rows, hinted, _ = _fit(Codes(tmp_path / "a"), tmp_path, _loader(num_workers=2))
    assert hinted > N
    rows_off, _, _ = _fit(Codes(tmp_path / "b", announce=False), tmp_path, _loader())
    assert torch.equal(rows, rows_off)


def test_a_loader_that_cannot_be_wrapped_leaves_the_handles_noting_nothing(tmp_path):
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for start in range(0, N, 64):
                yield torch.arange(start, start + 64), torch.randn(64, 4, generator=g)

    noted = []

    class Watch(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            noted.append(pl_module.codes._noted)

    model = Codes(tmp_path / "a")
    tiny_trainer(tmp_path, max_steps=5, callbacks=[Watch()]).fit(model, DataLoader(Stream(), batch_size=None))
    assert noted == [None] * 5  # no ids kept for a check that will never come
    assert model.codes.stats().prefetch_hits + model.codes.stats().prefetch_misses == 0


def test_overfit_batches_leaves_the_loader_to_lightning(tmp_path):
    # Lightning rebuilds the loader's sampler for overfit_batches, which a wrapped batch sampler refuses
    model = Codes(tmp_path / "a")
    tiny_trainer(tmp_path, max_epochs=1, overfit_batches=2).fit(model, _loader())
    assert model.trainer.global_step == 2
