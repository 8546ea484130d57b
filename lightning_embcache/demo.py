"""`embcache demo`: train an auto-decoder whose per-sample latent codes live in a disk store.

Each of N samples has a target vector generated on the fly from its id; the model learns one
latent code per sample (rows of an `EmbeddingStore`, updated directly) and a small decoder
(ordinary parameters, Adam). The table is larger than the store's RAM budget, so rows stream
between RAM and disk while DeferredSync, MemoryPressure, ModelCheckpoint and (if present)
StepProfiler run. The report gives epoch times, store figures and memory.

    embcache demo                          # 1M samples x 64-dim codes, 1 epoch
    embcache demo --samples 20000 --max-steps 50
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator
from torch import nn
from torch.utils.data import DataLoader

from lightning_embcache.lightning import DeferredSync, EmbeddingStoreMixin, MemoryPressure
from lightning_embcache.profiling import StepProfiler

MiB = 1 << 20


# ---------------------------------------------------------------------- data
class SyntheticTargets:
    """Sample i's target: ``tanh(W sin(f * i + p))``, computed from the id, so any N costs no memory."""

    def __init__(self, num_samples: int, out_dim: int = 32, true_dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.num_samples = num_samples
        self.freq = torch.rand(true_dim, generator=g, dtype=torch.float64) * 3.0 + 0.01
        self.phase = torch.rand(true_dim, generator=g, dtype=torch.float64) * 6.283
        self.proj = torch.randn(true_dim, out_dim, generator=g) / math.sqrt(true_dim)

    def __getitem__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        true = torch.sin(ids.double()[:, None] * self.freq + self.phase).float()
        return ids, torch.tanh(true @ self.proj)


class EpochBatches:
    """Shuffled batches of ids, the same order for an epoch however often it is replayed."""

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0) -> None:
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:  # called by Lightning before each epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def batches(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=g).split(self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        skip, self.skip = self.skip, 0
        yield from self.batches()[skip:]


class DemoLoader:
    """A DataLoader over `EpochBatches` that Lightning can checkpoint mid-epoch (state_dict/load_state_dict),
    telling the store each next batch's ids. For your own dataset, use `lightning_embcache.ResumableLoader`.

    Resuming replays the rest of the interrupted epoch in the same order, which is what makes a
    resumed run equal an uninterrupted one.
    """

    def __init__(self, num_samples: int, batch_size: int, out_dim: int, seed: int, num_workers: int,
                 prefetch: Callable[[torch.Tensor], None] | None = None) -> None:
        self.sampler = EpochBatches(num_samples, batch_size, seed)
        self.prefetch = prefetch  # told the ids of the next batch while this one trains
        dataset: Any = SyntheticTargets(num_samples, out_dim, seed=seed)  # a map-style dataset by protocol
        self.loader: DataLoader[Any] = DataLoader(dataset, sampler=self.sampler, batch_size=None,
                                                  num_workers=num_workers, persistent_workers=num_workers > 0)
        self._consumed = 0
        self._resume: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        self._consumed = 0
        if resume is not None and resume["epoch"] == self.sampler.epoch:
            self._consumed = self.sampler.skip = resume["consumed"]
        upcoming = self.sampler.batches() if self.prefetch is not None else ()
        for batch in self.loader:
            self._consumed += 1
            if self._consumed < len(upcoming):
                self.prefetch(upcoming[self._consumed])  # type: ignore[misc]
            yield batch

    def close(self) -> None:
        """Stops the loader's worker processes now. Lightning stops the workers of the DataLoaders
        it is given, and it sees this wrapper, not the DataLoader inside; left to the garbage
        collector (the loader sits in reference cycles with the Trainer), the workers' shutdown ran
        inside a finalizer and waited 5 s for them, stalling whatever ran next in the process."""
        _shutdown_workers_and_reset_iterator(self.loader)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = dict(state)


# ---------------------------------------------------------------------- model
class AutoDecoder(EmbeddingStoreMixin, L.LightningModule):
    """Learns a latent code per sample (store rows, updated by hand) and a decoder (Adam).

    Args:
        num_samples: samples, i.e. rows of the latent table.
        code_dim: size of a latent code.
        store_path: where the table lives; None keeps it in memory.
        hot_bytes: RAM budget of the table's hot tier; None keeps it all in RAM.
        warm_bytes: RAM budget of LZ4-compressed chunks.
        chunk_rows: rows per store chunk, the unit compaction rewrites (a miss reads only the
            4 KiB blocks of its rows, whatever the chunk size); small chunks mean many files.
        latent_init: initial codes, "zeros" or "normal" (std 0.01). Rows are initialised lazily
            chunk by chunk on first touch; "normal" makes a first epoch about 3x slower in the store.
        prefetch: tell the store each next batch's ids while the current one trains (the demo's
            command line turns it on: on 2 cores its median step came out 6-11% shorter, `store_io` 8-12%
            of a step instead of 13-20%).
        batch_size, num_workers: data loading.
        lr: Adam learning rate of the decoder.
        latent_lr: SGD learning rate of the per-sample codes.
        seed: data order, targets and initial codes.
    """

    def __init__(
        self,
        num_samples: int = 1_000_000,
        code_dim: int = 64,
        out_dim: int = 32,
        hidden: int = 128,
        store_path: str | None = "runs/demo/latents",
        hot_bytes: int | None = 64 * MiB,
        warm_bytes: int = 0,
        chunk_rows: int = 1024,
        latent_init: str = "zeros",
        prefetch: bool = False,
        batch_size: int = 1024,
        num_workers: int = 0,
        lr: float = 1e-3,
        latent_lr: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.latents = self.add_embedding_store(
            "latents", num_samples, code_dim, path=store_path, hot_bytes=hot_bytes, warm_bytes=warm_bytes,
            chunk_rows=chunk_rows, init=latent_init, init_std=0.01, seed=seed,
        )
        self.decoder = nn.Sequential(nn.Linear(code_dim, hidden), nn.ReLU(), nn.Linear(hidden, out_dim))
        self._loader: DemoLoader | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x = batch
        z = self.latents.get(ids).requires_grad_()
        loss = F.mse_loss(self.decoder(z), x)
        opt = self.optimizers()
        assert not isinstance(opt, list)  # one optimizer
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        with torch.no_grad():  # per-sample SGD: the mean loss scales each code's gradient by 1/len(ids)
            self.latents.update(ids, z - self.hparams["latent_lr"] * len(ids) * z.grad)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.decoder.parameters(), lr=self.hparams["lr"])

    def train_dataloader(self) -> DemoLoader:
        h: Any = self.hparams
        loader = DemoLoader(h.num_samples, h.batch_size, h.out_dim, h.seed, h.num_workers,
                            prefetch=self.latents.prefetch if h.prefetch else None)
        self._loader = loader
        return loader

    def teardown(self, stage: str) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.close()
        super().teardown(stage)


# ---------------------------------------------------------------------- report
class EpochClock(Callback):
    """Wall time and steps of each training epoch, and the peak RSS seen at epoch ends."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []
        self.peak_rss = 0
        self.store_stats: dict[str, Any] = {}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._step = time.perf_counter(), trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seconds = time.perf_counter() - self._start
        steps = trainer.global_step - self._step
        loss = trainer.callback_metrics.get("loss")
        self.peak_rss = max(self.peak_rss, psutil.Process().memory_info().rss)
        self.epochs.append({"seconds": seconds, "steps": steps, "loss": float(loss) if loss is not None else math.nan,
                            "epoch_steps": float(trainer.num_training_batches)})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Before teardown closes the stores: the counters of this run.
        stores: dict[str, Any] = pl_module.embedding_stores  # type: ignore[assignment]  # the mixin's handles
        self.store_stats = {name: h.stats() for name, h in stores.items()}
        self.peak_rss = max(self.peak_rss, psutil.Process().memory_info().rss)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="embcache demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000, help="rows of the latent table (default 1M)")
    p.add_argument("--dim", type=int, default=64, help="latent code size (default 64)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=400,
                   help="stop after this many steps (default 400, about 40%% of an epoch of 1M samples; -1: no limit)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--hot-mib", type=float, default=None,
                   help="hot-tier budget in MiB (default: a quarter of the table)")
    p.add_argument("--chunk-rows", type=int, default=1024, help="rows per store chunk (default 1024)")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="tell the store each next batch's ids while the current one trains, so their rows are "
                        "read in the background (default on; --no-prefetch reads them in the step)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers (default 1)")
    p.add_argument("--sync-every", type=int, default=100, help="DeferredSync every N steps (default 100)")
    p.add_argument("--ckpt-every", type=int, default=250, help="checkpoint every N steps (default 250)")
    p.add_argument("--root", default="runs/demo",
                   help="run folder (default runs/demo); a folder the demo made is emptied first, any other "
                        "non-empty folder is refused")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accelerator", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where the model trains (default cpu); on cuda the codes live in a device tier")
    p.add_argument("--progress", action="store_true", help="show Lightning's progress bar")
    return p.parse_args(list(argv))


RUN_MARKER = ".embcache-demo"  # written into the run folder; only a folder holding it is ever emptied


# what a run folder of a demo version before RUN_MARKER holds: recognised so that `make demo` runs again
_OLD_RUN_LAYOUT = {"latents", "latents.checkpoints.json", "checkpoints"}


def _made_by_demo(root: Path) -> bool:
    if not root.is_dir() or root.is_symlink():
        return False
    if (root / RUN_MARKER).is_file():
        return True
    names = {p.name for p in root.iterdir()}
    return names <= _OLD_RUN_LAYOUT and (root / "latents" / "META").is_file()


def prepare_run_folder(root: Path) -> str | None:
    """Make `root` an empty run folder; returns why not (nothing deleted) when it holds files the demo did not make."""
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        if not _made_by_demo(root):
            return (f"--root {root} is not empty and was not made by the demo; refusing to delete it. "
                    f"Choose an empty or new folder.")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / RUN_MARKER).write_text("made by `embcache demo`; the next demo run with this --root empties it\n")
    return None


def _optional_profiler() -> list[Callback]:
    """The demo's callbacks that time the run (the profiler benchmark swaps in its own)."""
    return [StepProfiler(log_every_n_steps=50, warmup_steps=5, report=False)]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    warnings.filterwarnings("ignore", message=".*manual optimization and every_n_train_steps.*")
    warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
    root = Path(args.root)
    refusal = prepare_run_folder(root)
    if refusal:
        print(f"embcache demo: {refusal}", file=sys.stderr)
        return 2
    table_bytes = args.samples * args.dim * 4
    hot = int(args.hot_mib * MiB) if args.hot_mib is not None else max(table_bytes // 4, 1 * MiB)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    L.seed_everything(args.seed, verbose=False)
    model = AutoDecoder(num_samples=args.samples, code_dim=args.dim, store_path=str(root / "latents"),
                        hot_bytes=hot, chunk_rows=args.chunk_rows, prefetch=args.prefetch,
                        batch_size=args.batch_size, num_workers=args.workers, seed=args.seed)
    clock = EpochClock()
    sync = DeferredSync(every_n_steps=args.sync_every, every_n_epochs=1)
    pressure = MemoryPressure(check_every_n_steps=50)
    ckpt = ModelCheckpoint(
        dirpath=root / "checkpoints",
        every_n_train_steps=args.ckpt_every,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    profilers = _optional_profiler()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=[clock, sync, pressure, ckpt, *profilers],
        logger=False,
        enable_progress_bar=args.progress,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    print(
        f"embcache demo: {args.samples:,} samples x {args.dim}-dim codes = {table_bytes / MiB:.0f} MiB table, "
        f"hot budget {hot / MiB:.0f} MiB, store at {root / 'latents'}",
        flush=True,
    )
    started = time.perf_counter()
    trainer.fit(model)
    total = time.perf_counter() - started
    _report(model, trainer, clock, sync, pressure, ckpt, profilers, total)
    return 0


def _report(
    model: AutoDecoder,
    trainer: L.Trainer,
    clock: EpochClock,
    sync: DeferredSync,
    pressure: MemoryPressure,
    ckpt: ModelCheckpoint,
    profilers: list[Callback],
    total: float,
) -> None:
    print(
        f"\ntrained {trainer.global_step} steps in {total:.1f} s (setup, final flushes and closing the store included)"
    )
    sp = next((p for p in profilers if isinstance(p, StepProfiler)), None)
    summaries = sp.summary() if sp is not None else []
    for i, e in enumerate(clock.epochs):
        rate = e["steps"] / e["seconds"] if e["seconds"] else 0.0
        line = f"  epoch {i}: {e['seconds']:.1f} s, {e['steps']} steps ({rate:.1f} steps/s), loss {e['loss']:.4f}"
        # stopped inside the epoch: what the profiler predicts a whole one takes (the store's hot
        # tier filling, the saves still to come), not the rate so far times the batches
        full = summaries[i].get("predicted_full_epoch_seconds") if i < len(summaries) else None
        if e["steps"] < e["epoch_steps"] and full is not None:
            line += (
                f" (stopped at step {e['steps']} of {e['epoch_steps']:.0f}: StepProfiler predicts a full "
                f"epoch at {full:.1f} +/- {summaries[i]['predicted_full_epoch_std_seconds']:.1f} s)"
            )
        elif e["steps"] < e["epoch_steps"] and rate:
            line += (
                f" (stopped at step {e['steps']} of {e['epoch_steps']:.0f}: a full epoch at this rate "
                f"takes about {e['epoch_steps'] / rate:.0f} s)"
            )
        print(line)
    store = model.latents._ensure_open(writable=False)  # read-only: no writer lock, no garbage collection
    s = clock.store_stats.get("latents") or model.latents.stats()
    print("store 'latents':")
    print(f"  version {store.version}, versions on disk {store.versions()}, pinned by checkpoints {store.pinned()}")
    print(
        f"  hot tier {s.hot_bytes / MiB:.1f} of {s.hot_budget_bytes / MiB:.1f} MiB, hit rate {s.hot_hit_rate:.1%}, "
        f"cold reads {s.cold_reads:,}; read {s.bytes_read / MiB:.1f} MiB, wrote {s.bytes_written / MiB:.1f} MiB; "
        f"disk {s.disk_bytes / MiB:.1f} MiB; waited {s.io_wait_seconds:.1f} s in store calls"
    )
    if model.hparams["prefetch"]:
        print(
            f"  prefetch: {s.prefetched_rows:,} rows read ahead of their step, hit rate {s.prefetch_hit_rate:.1%}, "
            f"gets waited {s.stall_seconds:.2f} s on reads"
        )
    print(
        f"  DeferredSync: {sync.syncs} flushes ({sync.coalesced} coalesced), "
        f"last {sync.last_metrics.get('embcache/sync_seconds', 0.0) * 1e3:.1f} ms"
    )
    checkpoints = sorted(p.name for p in Path(str(ckpt.dirpath)).glob("*.ckpt"))
    print(f"  checkpoints kept: {checkpoints}")
    r = pressure.last_reading
    rss = psutil.Process().memory_info().rss
    print("memory:")
    print(f"  RSS now {rss / MiB:.0f} MiB, peak seen {clock.peak_rss / MiB:.0f} MiB")
    if r is not None:
        cg = f", cgroup limit {r.cgroup_limit / MiB:.0f} MiB" if r.cgroup_limit else ""
        print(
            f"  used {r.used_fraction:.0%} of {r.limit_bytes / MiB:.0f} MiB{cg}; "
            f"evicted under pressure: {pressure.evicted_bytes_total / MiB:.0f} MiB"
        )
    for epoch in summaries:
        phases = epoch.get("phases_ms", {})
        if phases:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
            print(f"step profile (ms per batch): {parts}")
            break
    model.latents._release()


if __name__ == "__main__":
    sys.exit(main())
