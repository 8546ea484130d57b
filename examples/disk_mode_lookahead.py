"""Per-sample rows in disk mode, read ahead with LookaheadSampler (optionally in chunk order).

A table of trainable rows four times larger than the store's hot tier; each step reads the rows
of its batch, takes a gradient step on them (here: pull each row towards a per-sample target) and
writes them back. The sampler announces the next batches: while reads wait for the disk their
rows are loaded in the background while the current batch trains, and while the page cache
serves them the next get that misses reads them together with its own. The loop flushes a few
times an epoch, as `DeferredSync` would (rows evicted between flushes are kept on disk beside the
last flushed version). In chunk order (`--chunk-order`) the store gets a warm tier of two
windows of chunks: announced chunks are read whole into it ahead of their batches. At the end
the store reports how many announced rows were already in memory, how long reads stalled the
steps, and the disk use against the table.

    python examples/disk_mode_lookahead.py [--rows 200000] [--chunk-order] [--workers 2] [--flushes-per-epoch 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from lightning_embcache import ChunkShuffleSampler, EmbeddingStore, LookaheadSampler


class Targets(Dataset):
    """Sample i: its index (the store id of its row) and a target its row should move to.

    Fetched a batch at a time (``__getitems__``: the DataLoader passes a whole batch of indices)
    and built in a few tensor operations: made one sample at a time, with a collate stacking
    them, the loader took longer than the store and the update together."""

    def __init__(self, n: int, dim: int) -> None:
        self.n, self.dim = n, dim
        self._phase = torch.arange(dim, dtype=torch.float64) * 1.3

    def __len__(self) -> int:
        return self.n

    def _targets(self, ids: torch.Tensor) -> torch.Tensor:
        # a fixed function of the index, unit variance like a normal draw
        return (2**0.5 * torch.sin(ids[:, None].to(torch.float64) * 0.618 + self._phase)).to(torch.float32)

    def __getitem__(self, i: int):
        return i, self._targets(torch.tensor([i]))[0]

    def __getitems__(self, indices: list[int]):
        ids = torch.as_tensor(indices, dtype=torch.int64)
        return ids, self._targets(ids)


def as_batch(batch):
    """The collate of a dataset that returns whole batches (``__getitems__``): nothing to do."""
    return batch


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--chunk-order", action="store_true", help="ChunkShuffleSampler instead of a uniform shuffle")
    p.add_argument("--flushes-per-epoch", type=int, default=8,
                   help="flush this many times an epoch (as DeferredSync(every_n_steps=...) would); between "
                        "flushes the rows evicted from the hot tier are kept on disk beside the last flushed "
                        "version, so disk use grows with the rows updated between flushes")
    p.add_argument("--root", help="store folder (default: a temporary one)")
    args = p.parse_args(argv)

    root = args.root or tempfile.mkdtemp(prefix="embcache-example-")
    table = args.rows * args.dim * 4
    store = EmbeddingStore.create(f"{root}/rows", args.rows, args.dim, hot_bytes=table // 4, init="normal",
                                  init_std=0.1)
    data = Targets(args.rows, args.dim)
    window = 16
    if args.chunk_order:  # two windows of chunks held whole: each chunk is read once an epoch, ahead
        store.set_budget(warm_bytes=2 * window * store.chunk_rows * store.row_bytes)
    order = (ChunkShuffleSampler(len(data), chunk_rows=store.chunk_rows, window=window, seed=0) if args.chunk_order
             else RandomSampler(data, generator=torch.Generator().manual_seed(0)))
    sampler = LookaheadSampler(BatchSampler(order, args.batch, drop_last=False), store)  # window sized from measured read latency
    loader = DataLoader(data, batch_sampler=sampler, num_workers=args.workers, collate_fn=as_batch,
                        persistent_workers=args.workers > 0)
    lr = 0.5
    flush_every = max(1, -(-len(sampler) // max(1, args.flushes_per_epoch)))
    peak_disk = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, loss_sum, steps = time.perf_counter(), 0.0, 0
        for ids, target in loader:
            rows = store.get(ids)
            diff = rows - target
            loss_sum += float((diff**2).mean())
            store.update(ids, rows - lr * diff)  # a step of SGD on 0.5 * ||row - target||^2
            steps += 1
            if steps % flush_every == 0:
                store.flush()
                peak_disk = max(peak_disk, store.stats().disk_bytes)
        store.flush()
        peak_disk = max(peak_disk, store.stats().disk_bytes)
        print(f"epoch {epoch}: loss {loss_sum / steps:.4f}, {steps * args.batch / (time.perf_counter() - t0):,.0f} rows/s")
    st = store.stats()
    report = {"prefetch_hit_rate": st.prefetch_hit_rate, "stall_ms_per_step": 1e3 * st.stall_seconds / max(st.gets, 1),
              "disk_use_ratio": st.disk_use_ratio, "peak_disk_use_ratio": peak_disk / table, "loss": loss_sum / steps,
              "chunks_read_ahead": st.chunks_read_ahead}
    print(f"announced rows already in memory: {st.prefetch_hit_rate:.1%} ({st.chunks_read_ahead} chunks read ahead whole); "
          f"read stall {report['stall_ms_per_step']:.2f} ms/step; "
          f"disk {st.disk_bytes / 2**20:.0f} MiB for a {table / 2**20:.0f} MiB table ({st.disk_use_ratio:.2f}x; "
          f"{report['peak_disk_use_ratio']:.2f}x at most after a flush)")
    store.close()
    return report


if __name__ == "__main__":
    main()
