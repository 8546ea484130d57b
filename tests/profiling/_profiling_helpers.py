"""Models, loaders and a fake clock whose phases cost known amounts of (fake or real) time."""

from __future__ import annotations

import time

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

MS = 1e-3


class FakeClock:
    """Stands in for time.perf_counter: moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Cost:
    """Where a phase's cost comes from: advance the fake clock, or sleep for real."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock

    def __call__(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            time.sleep(seconds)


class BatchDataset(Dataset):
    """Yields whole batches (use with batch_size=None); each costs `data_s`, measured in `loaded_s`."""

    def __init__(self, n: int, cost: Cost, data_s: float, batch: int = 4, dim: int = 8) -> None:
        self.n, self.cost, self.data_s, self.batch, self.dim = n, cost, data_s, batch, dim
        self.loaded_s = 0.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        t0 = time.perf_counter()
        self.cost(self.data_s)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.batch, self.dim, generator=g)
        self.loaded_s += time.perf_counter() - t0
        return x, x.sum(1, keepdim=True)


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cost, seconds):
        ctx.cost, ctx.seconds = cost, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.cost(ctx.seconds)
        return grad, None, None


class CostSGD(torch.optim.SGD):
    def __init__(self, params, cost: Cost, seconds: float) -> None:
        super().__init__(params, lr=0.01)
        self.cost, self.seconds = cost, seconds

    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning passes forward + backward + on_before_optimizer_step here
            with torch.enable_grad():
                loss = closure()
        self.cost(self.seconds)
        super().step()
        return loss


class FakeStats:
    def __init__(self, io_wait_seconds: float) -> None:
        self.io_wait_seconds = io_wait_seconds


class FakeStore:
    """Has the one thing the profiler reads: stats().io_wait_seconds."""

    def __init__(self, cost: Cost, seconds: float) -> None:
        self.cost, self.seconds, self.io = cost, seconds, 0.0

    def get(self, ids):
        t0 = time.perf_counter()
        self.cost(self.seconds)
        self.io += time.perf_counter() - t0
        return torch.zeros(len(ids), 1)

    def stats(self) -> FakeStats:
        return FakeStats(self.io)


class CostModel(L.LightningModule):
    """forward costs `fwd_s`, backward `bwd_s`, optimizer.step `opt_s`, a store get `store_s`."""

    def __init__(self, cost: Cost, fwd_s: float, bwd_s: float, opt_s: float, store_s: float = 0.0,
                 val_s: float = 0.0, manual: bool = False, tail_s: float = 0.0, dim: int = 8,
                 pre_transfer_s: float = 0.0, transfer_s: float = 0.0) -> None:
        super().__init__()
        self.cost, self.fwd_s, self.bwd_s, self.opt_s = cost, fwd_s, bwd_s, opt_s
        self.pre_transfer_s, self.transfer_s = pre_transfer_s, transfer_s
        self.val_s, self.tail_s = val_s, tail_s
        self.layer = torch.nn.Linear(dim, 1)
        self.automatic_optimization = not manual
        if store_s:
            self.embedding_stores = {"rows": FakeStore(cost, store_s)}

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.cost(self.pre_transfer_s)  # loop code between the loader and the transfer: "other"
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.cost(self.transfer_s)  # inside Lightning's batch_to_device: "data_wait"
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _loss(self, batch):
        x, y = batch
        self.cost(self.fwd_s)
        if hasattr(self, "embedding_stores"):
            x = x + self.embedding_stores["rows"].get(range(len(x)))
        out = _SlowBackward.apply(self.layer(x), self.cost, self.bwd_s)
        return torch.nn.functional.mse_loss(out, y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.cost(self.tail_s)  # user code after the step: counted as forward
        return loss

    def validation_step(self, batch, batch_idx):
        self.cost(self.val_s)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return CostSGD(self.parameters(), self.cost, self.opt_s)


class LoopOverhead(L.Callback):
    """Costs `seconds` after each batch (stands for logging/progress-bar work between batches)."""

    def __init__(self, cost: Cost, seconds: float) -> None:
        self.cost, self.seconds = cost, seconds

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.cost(self.seconds)


class EpochWall(L.Callback):
    """Independent reference: wall time of each training epoch, minus validation, and batch ends."""

    def __init__(self) -> None:
        self.epochs: list[float] = []
        self.val = 0.0

    def on_train_epoch_start(self, *args) -> None:
        self.t0 = time.perf_counter()
        self.val = 0.0

    def on_validation_start(self, trainer, *args) -> None:
        self.v0 = time.perf_counter()

    def on_validation_end(self, trainer, *args) -> None:
        if not trainer.sanity_checking:
            self.val += time.perf_counter() - self.v0

    def on_train_epoch_end(self, *args) -> None:
        self.epochs.append(time.perf_counter() - self.t0 - self.val)


class ActualWall(L.Callback):
    """Independent reference: the wall time of the latest training epoch (``seconds``)."""

    def on_train_epoch_start(self, *args) -> None:
        self.t0 = time.perf_counter()

    def on_train_epoch_end(self, *args) -> None:
        self.seconds = time.perf_counter() - self.t0


def loader(ds: Dataset, workers: int = 0) -> DataLoader:
    return DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=False)


def trainer(**kw) -> L.Trainer:
    args = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    args.update(kw)
    return L.Trainer(**args)
