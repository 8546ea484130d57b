"""Two fits under Lightning DDP (2 CPU processes, Gloo) of a module whose trainable rows are read
by ``lookup``: one whose train loader's batches come from a `LookaheadSampler` announcing them to
the store's handle, one with the same batches and no announcements. Every rank writes
``rank{r}.pt``: both fits' rows and how many lookups found their exchange done ahead.

Run as ``python _lookahead_script.py OUT_DIR``; Lightning's launcher re-runs it for rank 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from lightning_embcache import EmbeddingStoreMixin, LookaheadSampler

N, DIM, BATCH, EPOCHS = 96, 8, 8, 2


class Targets(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.sin(0.05 * i * torch.arange(1, 5, dtype=torch.float32))


class _NoHints:
    def prefetch(self, ids) -> None:
        pass


class Rows(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, announce: bool) -> None:
        super().__init__()
        self.announce = announce
        self.latents = self.add_embedding_store("latents", N, DIM, path=None, init="normal", seed=1,
                                                optimizer="adam", lr=0.05)
        torch.manual_seed(0)
        self.decoder = torch.nn.Linear(DIM, 4)

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return torch.nn.functional.mse_loss(self.decoder(self.latents.lookup(ids)), y)

    def train_dataloader(self):
        batches = BatchSampler(DistributedSampler(Targets(), shuffle=True, seed=0), BATCH, drop_last=False)
        # the same batches either way (the sampler also passes set_epoch on to the DistributedSampler)
        batches = LookaheadSampler(batches, self.latents if self.announce else _NoHints(), lookahead=2)
        return DataLoader(Targets(), batch_sampler=batches)

    def configure_optimizers(self):
        return torch.optim.Adam(self.decoder.parameters(), lr=0.01)


def fit(announce: bool) -> tuple[int, dict]:
    model = Rows(announce)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(model)
    ahead = model.latents.store.ahead
    got = {"hits": ahead.hits, "announced": ahead.announced, "steps": trainer.global_step}
    with torch.no_grad():
        got["rows"] = model.latents.get(torch.arange(N))  # a collective: every rank reads
    return trainer.global_rank, got


def main(out: str) -> None:
    rank, announced = fit(True)
    _, plain = fit(False)
    torch.save({"announced": announced, "plain": plain}, Path(out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
