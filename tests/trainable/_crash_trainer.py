"""Child of the trainable-rows crash test: trains rows deterministically, flushing every few steps.

    python _crash_trainer.py PATH STEPS

After each completed flush prints `FLUSHED <version> <steps done>`; the parent kills it at random.
"""

from __future__ import annotations

import sys

import torch

from lightning_embcache.optim import make_row_optimizer
from lightning_embcache.store import EmbeddingStore
from lightning_embcache.trainable import TrainableRows, trainable_fields

N, DIM = 2048, 16


def train(store: EmbeddingStore, steps: int, on_flush=None, flush_every: int = 3) -> None:
    opt = make_row_optimizer("adam", lr=0.05)
    rows = TrainableRows(store, opt)
    g = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        ids = torch.randint(0, N, (256,), generator=g)
        target = torch.randn(256, DIM, generator=g)
        ((rows.lookup(ids) - target) ** 2).sum().backward()
        rows.apply(step)
        if step % flush_every == 0 and on_flush is not None:
            rows.settle()
            on_flush(store.flush(), step)


def fields() -> dict:
    return trainable_fields(make_row_optimizer("adam", lr=0.05), DIM, torch.float32)


if __name__ == "__main__":
    path, steps = sys.argv[1], int(sys.argv[2])
    store = EmbeddingStore.create(path, N, DIM, chunk_rows=128, hot_bytes=300 * 300, fields=fields())
    train(store, steps, on_flush=lambda v, s: print(f"FLUSHED {v} {s}", flush=True))
    print("DONE", flush=True)
