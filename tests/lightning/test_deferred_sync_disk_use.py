"""DeferredSync(unflushed_share=...): a flush once a store's rows written to disk since its last
flush (evicted dirty rows) pass that share of its table, so disk use stays near the table when
every row changes between the interval flushes (one an epoch over per-sample rows)."""

from __future__ import annotations

import pytest
from _lightning_helpers import tiny_model, tiny_trainer
from lightning.pytorch.callbacks import Callback

from lightning_embcache import DeferredSync

SAMPLES = 4096  # 64 batches an epoch


class Watch(Callback):
    """After every batch: the store's unflushed share and its disk use over the table."""

    def __init__(self) -> None:
        self.shares: list[float] = []
        self.disk: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        h = pl_module.latents
        self.shares.append(h.unflushed_share)
        st = h.stats()
        self.disk.append(st.disk_bytes / st.table_bytes)


def _fit(tmp_path, share):
    model = tiny_model(tmp_path / "latents", hot_bytes=64 << 10, num_samples=SAMPLES, chunk_rows=64)
    sync, watch = DeferredSync(every_n_epochs=1, unflushed_share=share, background=False), Watch()
    tiny_trainer(tmp_path, callbacks=[sync, watch], max_epochs=3).fit(model)
    return sync, watch


def test_flushes_keep_the_rows_written_since_the_last_flush_under_the_share(tmp_path):
    sync, watch = _fit(tmp_path / "a", 0.1)
    per_batch = max(b - a for a, b in zip(watch.shares, watch.shares[1:]))  # one batch's write-back
    assert max(watch.shares) <= 0.1 + per_batch
    assert sync.syncs > 3 * 2  # more than the epochs' own flushes
    unbounded = _fit(tmp_path / "b", None)[1]
    assert max(unbounded.shares) > 0.5  # the epoch's evicted rows pile up until its flush
    # disk use: the table, compaction's share (segments up to 40%, one round of chunks) and the
    # rows written since the last flush; without the bound the last term reaches most of a table
    assert max(watch.disk) + 0.3 < max(unbounded.disk), (max(watch.disk), max(unbounded.disk))


@pytest.mark.parametrize("bad, error", [(0, ValueError), (1.5, ValueError), ("0.1", TypeError), (True, TypeError)])
def test_the_share_is_validated(bad, error):
    with pytest.raises(error, match="unflushed_share"):
        DeferredSync(unflushed_share=bad)
