"""`embcache bench train`: the path users run, timed: a Lightning fit of an auto-decoder.

Every variant is the same model and data: ids -> a ``dim``-wide trainable code per sample -> MLP
``dim``-``hidden``-``hidden``-``out`` -> MSE against a target fixed by the id, trained with Adam
for the MLP and a sparse Adam for the codes, in a real ``lightning.Trainer.fit``:

* ``anchor``: ``nn.Embedding(rows, dim, sparse=True)`` + ``torch.optim.SparseAdam`` on the same
  device (what a user would pick instead; manual optimization, two optimizers).
* ``memory``: `EmbeddingStoreMixin` with ``optimizer="adam"``, whole table in host RAM
  (``hot_bytes=None``, ``device_bytes=0``).
* ``disk``: the same with a hot budget of a quarter of the table (rows beyond it on disk).
* ``device`` (CUDA): the device tier holding the whole table on the GPU (``device_bytes=None``).
* ``device_4x`` (CUDA): a device tier of a quarter of the table, the rest in host RAM, the next
  batch's ids prefetched (``handle.prefetch``) after each lookup.
* ``disk_4x`` (CUDA): ``disk`` (a hot tier of a quarter of the table, the rest on disk) under a
  device tier of a quarter of the table, the next batch's ids prefetched: rows beyond host RAM
  trained on the GPU.
* ``device_4x_lookahead`` (CUDA): the same tier, the batches' ids announced ``--lookahead``
  batches ahead by a ``LookaheadSampler`` over the loader's batch sampler (the ids are the
  dataset's indices, fetched a batch at a time), no prefetch call in the step.
* ``memory_small``: ``memory`` with a table of only ``--id-range`` rows: with ``--id-range``,
  ``memory`` against ``memory_small`` shows whether a step's cost grows with the table (the same
  ids, a table 50x larger).

Each fit runs two epochs of ``--steps`` batches: the first warms up (tiers filled, kernels
compiled), the second is timed, by the wall clock (device drained at both ends) and by
`StepProfiler`, whose phases for that epoch are reported beside steps/s and the ratio to the anchor
(> 1: faster than the anchor). Every batch draws fresh ids. Variants run one after another in
this process, ``--reps`` times in a rotating order; "vs anchor" is the median of per-repetition
paired ratios (anchor's ms over the variant's; > 1: faster), with their range.

    embcache bench train [--device cpu|cuda] [--rows N] [--dim D] [--batch B] [--hidden H]
                         [--steps S] [--variants a,b] [--reps R] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import paired_ratios, rotating_order
from benchmarks.results import write_json

VARIANTS = ("anchor", "memory", "disk", "device", "device_4x", "disk_4x", "device_4x_lookahead", "memory_small")
CUDA_ONLY = ("device", "device_4x", "disk_4x", "device_4x_lookahead")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embcache bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows (default 1M)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=None, help="ids per step (default 4096 on CUDA, 2048 on CPU)")
    p.add_argument("--hidden", type=int, default=None, help="MLP width (default 1024 on CUDA, 128 on CPU)")
    p.add_argument("--out-dim", type=int, default=None, help="target width (default 256 on CUDA, 64 on CPU)")
    p.add_argument("--id-range", type=int, default=None,
                   help="draw ids from [0, N) only (default: the whole table); needed by memory_small")
    p.add_argument("--steps", type=int, default=60, help="batches per epoch (one warm-up epoch, one timed)")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--reps", type=int, default=1, help="repetitions, variants in a rotating order (paired ratios reported)")
    p.add_argument("--lookahead", type=int, default=4, help="batches announced ahead in device_4x_lookahead")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: torch's default)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    return p


def _model_classes():
    import lightning as L

    from lightning_embcache import EmbeddingStoreMixin

    class _Data(torch.utils.data.Dataset):
        """Every batch fresh ids (and the next batch's, for prefetch), from a fixed seed."""

        def __init__(self, rows: int, batch: int, steps: int, seed: int = 0) -> None:
            self.rows, self.batch, self.steps, self.seed = rows, batch, steps, seed
            self.calls = 0  # read in the main process (num_workers=0)

        def __len__(self) -> int:
            return self.steps

        def ids(self, i: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            return torch.randint(0, self.rows, (self.batch,), generator=g)

        def __getitem__(self, i: int):
            self.calls += 1
            return self.ids(self.calls), self.ids(self.calls + 1)

    class _RandomIdBatches(torch.utils.data.Sampler):
        """The same ids as `_Data`, as a batch sampler of dataset indices (what LookaheadSampler wraps)."""

        def __init__(self, data: _Data) -> None:
            self.data = data

        def __len__(self) -> int:
            return self.data.steps

        def __iter__(self):
            for i in range(self.data.steps):
                self.data.calls += 1
                yield self.data.ids(self.data.calls)

    class _Ids(torch.utils.data.Dataset):
        """Index i is sample i's id; a whole batch is fetched at once (``__getitems__``)."""

        def __init__(self, rows: int) -> None:
            self.rows = rows

        def __len__(self) -> int:
            return self.rows

        def __getitems__(self, idx):
            return (torch.as_tensor(idx), None)

    def decoder(dim: int, hidden: int, out: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                   torch.nn.ReLU(), torch.nn.Linear(hidden, out))

    def target(ids: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return torch.sin(ids[:, None].float() * freqs)

    class Anchor(L.LightningModule):
        def __init__(self, rows: int, dim: int, hidden: int, out: int) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.codes = torch.nn.Embedding(rows, dim, sparse=True)
            self.net = decoder(dim, hidden, out)
            self.register_buffer("freqs", torch.linspace(1e-4, 1e-2, out))

        def training_step(self, batch, batch_idx):
            ids, _ = batch
            opt_net, opt_codes = self.optimizers()
            opt_net.zero_grad()
            opt_codes.zero_grad()
            loss = torch.nn.functional.mse_loss(self.net(self.codes(ids)), target(ids, self.freqs))
            self.manual_backward(loss)
            opt_net.step()
            opt_codes.step()
            return loss

        def configure_optimizers(self):
            return [torch.optim.Adam(self.net.parameters(), lr=1e-3),
                    torch.optim.SparseAdam(self.codes.parameters(), lr=1e-2)]

    class Store(EmbeddingStoreMixin, L.LightningModule):
        def __init__(self, rows: int, dim: int, hidden: int, out: int, *, path: str, hot_bytes: int | None,
                     device_bytes: int | None, prefetch_next: bool) -> None:
            super().__init__()
            self.codes = self.add_embedding_store("codes", num_rows=rows, dim=dim, path=path, hot_bytes=hot_bytes,
                                                  device_bytes=device_bytes, init="normal", optimizer="adam",
                                                  lr=1e-2, if_exists="overwrite")
            self.net = decoder(dim, hidden, out)
            self.register_buffer("freqs", torch.linspace(1e-4, 1e-2, out))
            self.prefetch_next = prefetch_next

        def training_step(self, batch, batch_idx):
            ids, next_ids = batch
            z = self.codes.lookup(ids)
            if self.prefetch_next:
                self.codes.prefetch(next_ids)
            return torch.nn.functional.mse_loss(self.net(z), target(ids, self.freqs))

        def configure_optimizers(self):
            return torch.optim.Adam(self.net.parameters(), lr=1e-3)

    return L, _Data, Anchor, Store, _RandomIdBatches, _Ids


class _WallClock:
    """Wall time over the steady batches, with the device drained at both ends (bench only)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.t0 = self.t1 = 0.0
        self.n = 0
        self.tier_stats: dict[str, Any] | None = None

    def callback(self):
        import lightning as L

        outer = self

        class _CB(L.Callback):
            def on_train_epoch_start(self, trainer, pl_module):
                if outer.device == "cuda":
                    torch.cuda.synchronize()
                outer.t0 = time.perf_counter()

            def on_train_epoch_end(self, trainer, pl_module):
                if outer.device == "cuda":
                    torch.cuda.synchronize()
                outer.t1 = time.perf_counter()
                outer.n = trainer.num_training_batches
                tier = getattr(getattr(pl_module, "codes", None), "_device_tier", None)
                outer.tier_stats = tier.stats() if tier is not None else None  # before teardown closes it

        return _CB()


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    L, Data, Anchor, Store, RandomIdBatches, Ids = _model_classes()
    from lightning_embcache import StepProfiler

    dim, steps = args.dim, args.steps
    rows = args.id_range if name == "memory_small" else args.rows
    id_range = args.id_range or rows
    if name == "anchor":
        model = Anchor(rows, dim, args.hidden, args.out_dim)
    else:
        from lightning_embcache import make_row_optimizer, trainable_fields
        from lightning_embcache.store.schema import Schema

        fields = trainable_fields(make_row_optimizer("adam", lr=1e-2), dim, torch.float32)
        table = rows * Schema(dim, torch.float32, fields).row_bytes
        hot = table // 4 if name in ("disk", "disk_4x") else None
        device_bytes = {"device": None, "device_4x": table // 4, "disk_4x": table // 4,
                        "device_4x_lookahead": table // 4}.get(name, 0)
        model = Store(rows, dim, args.hidden, args.out_dim, path=str(workdir / name), hot_bytes=hot,
                      device_bytes=device_bytes, prefetch_next=name in ("device_4x", "disk_4x"))
        model.announce_upcoming = False  # each variant says how it announces ids
    prof = StepProfiler(report=False, log_every_n_steps=10_000)
    clock = _WallClock(args.device)
    trainer = L.Trainer(max_epochs=2, accelerator=args.device, devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[prof, clock.callback()])
    if name == "device_4x_lookahead":
        from lightning_embcache import LookaheadSampler

        batches = LookaheadSampler(RandomIdBatches(Data(id_range, args.batch, steps)), model.codes,
                                   lookahead=args.lookahead)
        data = torch.utils.data.DataLoader(Ids(id_range), batch_sampler=batches, collate_fn=lambda b: b,
                                           pin_memory=True)
    else:
        data = torch.utils.data.DataLoader(Data(id_range, args.batch, steps), batch_size=None, shuffle=False,
                                           pin_memory=args.device == "cuda")
    t = time.perf_counter()
    trainer.fit(model, data)
    fit_s = time.perf_counter() - t
    summary = prof.summary()[-1]
    wall_ms = 1e3 * (clock.t1 - clock.t0) / max(clock.n, 1)
    out = {"variant": name, "steady_batch_ms": summary.get("steady_batch_ms"), "wall_batch_ms": wall_ms,
           "steps_per_s": 1e3 / wall_ms, "phases_ms": summary.get("phases_ms"), "fit_seconds": fit_s}
    if name != "anchor":
        out["store_stats"] = {"device": clock.tier_stats}  # both epochs: bytes moved, rows loaded
    del model, trainer, data
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("embcache bench train: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    args.batch = args.batch or (4096 if cuda else 2048)
    args.hidden = args.hidden or (1024 if cuda else 128)
    args.out_dim = args.out_dim or (256 if cuda else 64)
    if not cuda and args.threads:
        torch.set_num_threads(args.threads)
    names = args.variants.split(",") if args.variants else [
        v for v in VARIANTS if (cuda or v not in CUDA_ONLY) and (v != "memory_small" or args.id_range)]
    bad = [v for v in names if v not in VARIANTS or (v in CUDA_ONLY and not cuda)
           or (v == "memory_small" and not args.id_range)]
    if bad:
        print(f"embcache bench train: unknown or CUDA-only variants {bad}; choose from {VARIANTS}", file=sys.stderr)
        return 2
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    runs: dict[str, list[dict]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory(prefix="embcache-bench-train-") as tmp:
        for rep in range(args.reps):
            for v in rotating_order(names, rep):  # no variant always first (after the last one's teardown)
                r = run_variant(v, args, Path(tmp) / f"rep{rep}")
                runs[v].append(r)
                print(f"  rep {rep} {v:10s} {r['wall_batch_ms']:8.2f} ms/step (profiler steady "
                      f"{r['steady_batch_ms'] or float('nan'):.2f})", flush=True)
    med = {v: statistics.median(r["wall_batch_ms"] for r in rs) for v, rs in runs.items()}
    anchor = med.get("anchor")
    times = {v: [r["wall_batch_ms"] for r in rs] for v, rs in runs.items()}
    paired = {v: paired_ratios(times, "anchor", v) for v in names} if anchor else {}
    device_name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    print(f"\nembcache bench train: {args.rows:,} rows x {args.dim}, batch {args.batch}, MLP "
          f"{args.dim}-{args.hidden}-{args.hidden}-{args.out_dim}, {args.steps} steps after as many warm-up steps, "
          f"{args.reps} rep(s), {args.device} ({device_name})")
    print(f"{'variant':10s} {'ms/step':>9s} {'steps/s':>8s} {'vs anchor':>9s}  phases (ms: data fwd bwd opt store other)")
    for v in names:
        last = runs[v][-1]["phases_ms"] or {}
        ph = " ".join(f"{last.get(k, 0):.2f}" for k in ("data_wait", "forward", "backward", "optimizer", "store_io",
                                                          "other"))
        ratio = f"{paired[v].median:.2f}x" if anchor else "-"
        spread = f" ({paired[v].low:.2f}-{paired[v].high:.2f})" if anchor and len(runs[v]) > 1 else ""
        print(f"{v:10s} {med[v]:9.2f} {1e3 / med[v]:8.1f} {ratio:>9s}  {ph}{spread}")
    result = {"benchmark": "train", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "device": args.device, "device_name": device_name, "torch": torch.__version__,
              "args": vars(args), "median_ms": med,
              "paired_vs_anchor": {v: p.as_dict() for v, p in paired.items()} if anchor else None, "runs": runs}
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
