"""`handle.stats()` after `fit`: the figures of the store the fit used, not those of a store reopened
to count nothing."""

from __future__ import annotations

import torch
from _lightning_helpers import tiny_model, tiny_trainer
from lightning.pytorch.callbacks import Callback


class LastFigures(Callback):
    """The open store's own stats at teardown (this callback runs before the mixin closes it)."""

    def teardown(self, trainer, pl_module, stage):
        assert pl_module.latents._is_open()
        self.stats = pl_module.latents.store.stats()


def test_stats_after_fit_are_the_closed_stores_last_figures(tmp_path):
    model = tiny_model(tmp_path / "latents")
    last = LastFigures()
    tiny_trainer(tmp_path, callbacks=[last], max_steps=6).fit(model)
    assert not model.latents._is_open()
    after = model.latents.stats()
    assert not model.latents._is_open()  # reading the figures does not reopen the store
    assert last.stats.gets >= 6 and last.stats.flushes >= 1  # the fit did read and flush
    for key in ("gets", "updates", "flushes", "flushed_rows", "hot_hits", "hot_misses", "version", "table_bytes"):
        assert getattr(after, key) == getattr(last.stats, key), key


def test_counters_add_up_over_the_stores_a_handle_opened(tmp_path):
    model = tiny_model(tmp_path / "latents")
    tiny_trainer(tmp_path, max_steps=4).fit(model)
    after_fit = model.latents.stats()
    model.latents.get(torch.arange(10))  # reopens the store read-only: its own counters start at 0
    assert model.latents._is_open() and model.latents._store.stats().gets == 1
    now = model.latents.stats()
    assert (now.gets, now.flushes) == (after_fit.gets + 1, after_fit.flushes)
    model.latents.close()
    assert model.latents.stats().gets == after_fit.gets + 1
