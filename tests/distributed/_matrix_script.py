"""One cell of the strategy matrix: a small LightningModule with two stores (trainable rows through
`lookup`, direct writes through `get`/`update`), DeferredSync, MemoryPressure, StepProfiler and
ModelCheckpoint; optional resume, and an optional kill -9 of one rank.

Run as `python _matrix_script.py CONFIG.json`. Lightning's launcher starts the other ranks by
re-running this script. Every rank writes `rank{r}.pt` (its view of every row of both stores and
its step times) into config["out"]; rank 0 also writes `result.json`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_embcache import DeferredSync, EmbeddingStoreMixin, MemoryPressure, StepProfiler
from lightning_embcache.lightning.memory_reading import MemoryReading

N, DIM, OUT = 256, 8, 4


class Targets(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        t = torch.arange(OUT, dtype=torch.float32)
        return torch.tensor(i), torch.sin(0.05 * i * (t + 1))


class CombinedBatches:
    """The global batches of a W-rank run under Lightning's DistributedSampler (shuffled with seed 0
    + epoch, rank r taking every W-th index from r), as one process's batches."""

    def __init__(self, world: int, batch: int) -> None:
        self.world, self.batch, self.epoch = world, batch, 0
        self.sampler = self  # where Lightning looks for set_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        ranks = [perm[r::self.world] for r in range(self.world)]
        for k in range(len(self)):
            yield [i for r in range(self.world) for i in ranks[r][k * self.batch:(k + 1) * self.batch]]

    def __len__(self) -> int:
        return N // self.world // self.batch


class RowsModel(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path: str | None, if_exists: str = "error", hot_bytes: int | None = None) -> None:
        super().__init__()
        bank = None if path is None else path + "_bank"
        self.latents = self.add_embedding_store("latents", N, DIM, path=path, init="normal", seed=1, optimizer="adam",
                                                lr=0.05, if_exists=if_exists, hot_bytes=hot_bytes, chunk_rows=16)
        self.bank = self.add_embedding_store("bank", N, DIM, path=bank, if_exists=if_exists, chunk_rows=16)
        torch.manual_seed(0)
        self.decoder = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUT))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.latents.lookup(ids))

    def training_step(self, batch, batch_idx):
        ids, y = batch
        pred = self(ids)
        loss = torch.nn.functional.mse_loss(pred.float(), y)
        # a memory bank written directly: the mean prediction seen for each id
        old = self.bank.get(ids)
        self.bank.update(ids, 0.5 * old + 0.5 * pred.detach()[:, :1].float().expand(-1, DIM))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.decoder.parameters(), lr=0.01)


class Killer(Callback):
    """kill -9 of one rank, or of every process of one node (``node``: its first rank, which
    Lightning's launcher made the parent of the node's other ranks, kills their process group)."""

    def __init__(self, rank: int, step: int, node: int | None = None) -> None:
        self.rank, self.step, self.node = rank, step, node

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        if self.node is None and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.node is not None and trainer.node_rank == self.node and trainer.local_rank == 0:
            os.killpg(os.getpgid(0), signal.SIGKILL)


class Grower(Callback):
    """Both stores grow to `num_rows` rows when epoch `epoch` starts (every rank: a collective)."""

    def __init__(self, epoch: int, num_rows: int) -> None:
        self.epoch, self.num_rows = epoch, num_rows

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            pl_module.latents.grow(self.num_rows)
            pl_module.bank.grow(self.num_rows)


class StepClock(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter() - self._t0)


def calm() -> MemoryReading:
    """MemoryPressure reads an unpressured machine: rank r at (4 + r)/8 used, (1 + r) x 256 MiB RSS."""
    r = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return MemoryReading(system_total=8 << 30, system_available=(4 - r) << 30, rss_bytes=(1 + r) << 28)


def fit(cfg: dict, out: Path, tag: str, resume: str | None, ckpt_dir: str | None) -> L.Trainer:
    model = RowsModel(cfg.get("path"), cfg.get("if_exists", "error"), cfg.get("hot_bytes"))
    fit_model = torch.compile(model) if cfg.get("compile") else model
    clock = StepClock()
    share = cfg.get("sync_share", 0.1)
    if isinstance(share, list):  # one per rank (Lightning sets LOCAL_RANK in the processes it starts)
        share = share[int(os.environ.get("LOCAL_RANK", 0))]
    sync = DeferredSync(every_n_steps=cfg.get("sync_every", 3), unflushed_share=share,
                        background=cfg.get("sync_background", True))
    callbacks = [sync, MemoryPressure(check_every_n_steps=2, reader=calm),
                 StepProfiler(log_every_n_steps=4, report=False), clock]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=cfg.get("save_top_k", -1),
                                         monitor="step" if cfg.get("save_top_k", -1) > 0 else None, mode="max",
                                         save_last=True))
    if cfg.get("grow_epoch") is not None:
        callbacks.append(Grower(cfg["grow_epoch"], cfg["grow_to"]))
    if cfg.get("kill_step") is not None:
        callbacks.append(Killer(cfg.get("kill_rank", 1), cfg["kill_step"], cfg.get("kill_node")))
    devices = cfg.get("devices", 1)
    trainer = L.Trainer(accelerator=cfg.get("accelerator", "cpu"), devices=devices, num_nodes=cfg.get("num_nodes", 1),
                        strategy=cfg.get("strategy", "auto"),
                        precision=cfg.get("precision", "32-true"), max_epochs=cfg.get("epochs", 2),
                        max_steps=cfg.get("max_steps", -1), logger=False,
                        callbacks=callbacks, enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=True)
    batch = cfg.get("batch", 16)
    if cfg.get("combined_world"):  # one process fed the global batches of a W-rank run
        loader = DataLoader(Targets(), batch_sampler=CombinedBatches(cfg["combined_world"], batch))
    else:
        loader = DataLoader(Targets(), batch_size=batch)
    trainer.fit(fit_model, loader, ckpt_path=resume)
    rank = trainer.global_rank
    with torch.no_grad():
        rows = {"latents": model.latents.get(torch.arange(model.latents.num_rows)),
                "bank": model.bank.get(torch.arange(model.bank.num_rows))}
    steady = clock.times[len(clock.times) // 2:] or clock.times
    step_s = sorted(steady)[len(steady) // 2] if steady else 0.0  # a resume with no step left
    torch.save({"rows": rows, "step_s": step_s, "world": trainer.world_size,
                "decoder": {k: v.detach().clone() for k, v in model.decoder.state_dict().items()},
                "paths": {n: str(h.path) for n, h in model.embedding_stores.items()},
                "deferred_syncs": callbacks[0].syncs, "mem_metrics": callbacks[1].last_metrics,
                "sync_metrics": callbacks[0].last_metrics, "profile": callbacks[2].summary()},
               out / f"rank{rank}{tag}.pt")
    return trainer


def main(config_file: str) -> None:
    cfg = json.loads(Path(config_file).read_text())
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    trainer = fit(cfg, out, "", cfg.get("resume"), cfg.get("ckpt_dir"))
    if cfg.get("resume_after"):  # then, in the same processes, resume a fresh model from a checkpoint
        fit(cfg, out, "_resumed", cfg["resume_after"], cfg.get("ckpt_dir_after"))
    if trainer.global_rank == 0:
        world = trainer.world_size
        (out / "result.json").write_text(json.dumps({"ok": True, "world": world, "steps": trainer.global_step}))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Before the interpreter shuts down: a Gloo group left to its destructor can abort the
        # process at exit ("terminate called without an active exception", once in ~50 runs here).
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
