"""`embcache bench sync`: DeferredSync flushing on every step vs the field report's per-update sync.

Workload: a table of ``--rows`` x ``--dim`` float32 rows; each training step takes a batch of
``--batch`` ids from a random permutation (one epoch order), gets their rows and writes them back
changed. Systems:

* ``naive``: the field report's design (``bench.store_systems.NaiveChunkStore``): chunk files of
  1024 rows; every update loads each touched chunk file, changes it and ``torch.save``s it back
  (no fsync). Timed in a plain loop over ``--naive-steps`` steps (it is slow).
* ``no_sync``: a Lightning ``Trainer`` whose module gets and updates rows of an
  ``EmbeddingStoreMixin`` store; no flush until ``fit`` ends (the floor: Lightning + get/update).
* ``deferred_bg``: the same with ``DeferredSync(every_n_steps=1, background=True)``: a durable,
  fsynced version after every step, written by the worker thread (coalesced when it falls behind).
* ``deferred_fg``: ``DeferredSync(every_n_steps=1, background=False)``: the step waits for its flush.

Systems run in a rotating order within each of ``--reps`` repetitions; "vs naive" is the median of
per-repetition paired ratios (naive's step over the system's), with their range.

Figure: median and mean wall time of a training step, batch start to next batch start after 5
warm-up steps (Lightning's own per-step overhead included for the store systems, so the
comparison is conservative; the mean carries what a background flush takes from the training
thread on 2 cores), and for the DeferredSync runs the flushes
completed, coalesced and their median duration. The store runs in memory mode (``hot_bytes=None``
with a path) by default, so the sync cost is not mixed with cold reads; ``--hot-mib`` sets a
budget (disk mode).

    embcache bench sync [--rows 1000000] [--dim 64] [--batch 512] [--steps 200] [--naive-steps 5]
                        [--hot-mib MiB] [--reps 5] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import MIN_REPS, paired_ratios, rotating_order

MiB = 1 << 20


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="embcache bench sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=200, help="training steps per store system")
    p.add_argument("--naive-steps", type=int, default=5, help="steps of the naive design (about 1 s each)")
    p.add_argument("--reps", type=int, default=MIN_REPS,
                   help=f"repetitions, the systems in a rotating order in each (default {MIN_REPS})")
    p.add_argument("--hot-mib", type=float, default=None, help="store hot budget (default: whole table resident)")
    p.add_argument("--json", "--out", dest="json", default=None, help="write the JSON results here (default: print only)")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = p.parse_args(list(argv))
    if args.quick:
        args.rows, args.steps, args.naive_steps, args.reps = 20_000, 20, 2, 1
    return args


def _ids(rows: int, batch: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(rows, generator=g)
    need = steps * batch
    while len(order) < need:
        order = torch.cat([order, torch.randperm(rows, generator=g)])
    return list(order[:need].split(batch))


class _Batches:
    """The id batches as one iterable (a bare list would be taken for several dataloaders)."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        return iter(self.batches)


def run_naive(workdir: Path, args: argparse.Namespace, batches: list[torch.Tensor]) -> dict[str, Any]:
    from benchmarks.store_systems import Batch, NaiveChunkStore, create_naive_files, random_block

    root = workdir / "naive"
    block = random_block(args.dim, seed=1)
    create_naive_files(root, args.rows, args.dim, 1024, block)
    system = NaiveChunkStore(root, args.rows, args.dim, 1024, preload=False)
    times = []
    for ids in batches[: args.naive_steps]:
        b = Batch.of(ids)
        start = time.perf_counter()
        rows = system.get(b)
        system.update(b, rows + 0.01)
        times.append(time.perf_counter() - start)
    return {"step_ms": [t * 1e3 for t in times], "median_step_ms": statistics.median(times) * 1e3,
            "mean_step_ms": statistics.fmean(times) * 1e3,
            "steps": len(times), "durable_per_step": "torch.save per touched chunk, no fsync"}


def run_lightning(workdir: Path, args: argparse.Namespace, batches: list[torch.Tensor], name: str,
                  sync_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_embcache import DeferredSync, EmbeddingStoreMixin

    hot = int(args.hot_mib * MiB) if args.hot_mib is not None else None

    class Rows(EmbeddingStoreMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.rows = self.add_embedding_store("rows", args.rows, args.dim, path=workdir / name, hot_bytes=hot,
                                                 init="normal", seed=1)
            self.automatic_optimization = False

        def training_step(self, ids: torch.Tensor, batch_idx: int) -> None:
            self.rows.update(ids, self.rows.get(ids) + 0.01)

        def configure_optimizers(self) -> None:
            return None

        def train_dataloader(self) -> Any:
            return _Batches(batches)

    class StepClock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, *a: Any) -> None:
            now = time.perf_counter()
            if self._t:
                self.times.append(now - self._t)  # batch start to next batch start: the whole step
            self._t = now

    clock = StepClock()
    sync = DeferredSync(**sync_kwargs) if sync_kwargs is not None else DeferredSync(every_n_epochs=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[clock, sync], num_sanity_val_steps=0)
    model = Rows()
    flush_seconds: list[float] = []
    real_flush = model.rows.flush

    def timed_flush() -> int:
        start = time.perf_counter()
        try:
            return real_flush()
        finally:
            flush_seconds.append(time.perf_counter() - start)

    model.rows.flush = timed_flush  # type: ignore[method-assign]
    start = time.perf_counter()
    trainer.fit(model)
    total = time.perf_counter() - start
    stats = model.rows.stats()
    model.rows._release()
    steady = clock.times[5:] or clock.times
    return {
        "median_step_ms": statistics.median(steady) * 1e3,
        "mean_step_ms": statistics.fmean(steady) * 1e3,
        "p90_step_ms": sorted(steady)[int(0.9 * (len(steady) - 1))] * 1e3,
        "steps": len(batches), "fit_seconds": total,
        "flushes": len(flush_seconds), "coalesced": sync.coalesced,
        "median_flush_ms": statistics.median(flush_seconds) * 1e3 if flush_seconds else None,
        "store_version": stats.version,
        "durable_per_step": {"no_sync": "none until fit ends",
                             "deferred_bg": "fsynced version requested every step, off-thread, coalesced",
                             "deferred_fg": "fsynced version per step, step waits"}[name],
    }


def machine_info() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    own = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="embcache-bench-sync-"))
    workdir.mkdir(parents=True, exist_ok=True)
    batches = _ids(args.rows, args.batch, args.steps)
    print(f"embcache bench sync: {args.rows:,} rows x {args.dim} float32 ({args.rows * args.dim * 4 / MiB:.0f} MiB), "
          f"batch {args.batch}, {args.steps} steps; store "
          f"{'memory mode' if args.hot_mib is None else f'disk mode, hot {args.hot_mib} MiB'}", flush=True)
    systems: dict[str, Any] = {
        "no_sync": None,
        "deferred_bg": {"every_n_steps": 1, "every_n_epochs": None, "background": True},
        "deferred_fg": {"every_n_steps": 1, "every_n_epochs": None, "background": False},
        "naive": "naive",
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    try:
        for rep in range(args.reps):
            for name in rotating_order(list(systems), rep):  # no system always first
                where = workdir / f"rep{rep}"
                r = (run_naive(where, args, batches) if name == "naive"
                     else run_lightning(where, args, batches, name, systems[name]))
                runs[name].append(r)
                print(f"  rep {rep} {name:12s} {r['median_step_ms']:9.2f} ms/step", flush=True)
            shutil.rmtree(workdir / f"rep{rep}", ignore_errors=True)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    results = {name: _summary(rs) for name, rs in runs.items()}
    medians = {name: [r["median_step_ms"] for r in rs] for name, rs in runs.items()}
    means = {name: [r["mean_step_ms"] for r in rs] for name, rs in runs.items()}
    for name in ("no_sync", "deferred_bg", "deferred_fg"):  # > 1: faster than naive, paired by repetition
        results[name]["vs_naive"] = paired_ratios(medians, "naive", name).as_dict()
        results[name]["mean_vs_naive"] = paired_ratios(means, "naive", name).as_dict()
    out = {"benchmark": "sync", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "embcache bench sync " + " ".join(argv if argv is not None else sys.argv[1:]),
           "config": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")},
           "machine": machine_info(), "results": results}
    print(_table(results))
    if args.json:  # written only where the user says
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
    return 0


def _summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's repetitions: the median of each figure over them, and every repetition."""
    out: dict[str, Any] = {"reps": rs, "durable_per_step": rs[0]["durable_per_step"]}
    for key in ("median_step_ms", "mean_step_ms", "p90_step_ms", "flushes", "coalesced", "median_flush_ms"):
        vals = [r[key] for r in rs if r.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    return out


def _table(results: dict[str, Any]) -> str:
    lines = ["| system | sync | ms per step: median | mean | p90 | flushes | coalesced | flush ms (median) "
             "| vs naive: median step, mean step (paired by repetition; range) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in ("naive", "no_sync", "deferred_bg", "deferred_fg"):
        r = results[name]
        p90 = f"{r['p90_step_ms']:.2f}" if "p90_step_ms" in r else "-"
        fl = f"{r['median_flush_ms']:.2f}" if r.get("median_flush_ms") else "-"
        n = f"{r['flushes']:.0f}" if "flushes" in r else "-"
        c = f"{r['coalesced']:.0f}" if "coalesced" in r else "-"
        sp = (f"{_ratio(r['vs_naive'])}, {_ratio(r['mean_vs_naive'])}" if "vs_naive" in r else "1x")
        lines.append(f"| {name} | {r['durable_per_step']} | {r['median_step_ms']:.2f} | {r['mean_step_ms']:.2f} | {p90} | "
                     f"{n} | {c} | {fl} | {sp} |")
    return "\n".join(lines)


def _ratio(pr: dict[str, Any]) -> str:
    return f"{pr['median']:.0f}x ({pr['low']:.0f}-{pr['high']:.0f}, {pr['reps']} reps)"


if __name__ == "__main__":
    sys.exit(main())
