"""`embcache bench first-touch`: how soon a memory-mode table trains, against nn.Embedding + SparseAdam.

Three figures, each from fresh processes, variants in a rotating order within each repetition
(`harness.py`), reported as the median of per-repetition paired ratios with their range:

* ``first_batch``: seconds from nothing to the first training step done (build + one step of
  ``--batch`` random ids with Adam on the rows): the store created lazily (``store``), the store
  created with ``materialize=True`` (``materialized``), and ``nn.Embedding(rows, dim, sparse=True)`` +
  ``torch.optim.SparseAdam`` (``anchor``).
* ``first_epoch``: the store's median step over its first ``--steps`` steps (rows first touched)
  against its median step once every row was made (``--steps`` steps over ids already read).
* ``table_size``: the same ``--small``-row id range trained in a ``--rows`` table and in a table of
  ``--small`` rows: a step's cost should follow the batch, not the table.

    embcache bench first-touch [--rows 10000000] [--dim 64] [--batch 2048] [--steps 40] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.harness import paired_ratios, run_interleaved
from benchmarks.results import write_json


def _worker(cfg: dict) -> dict:
    import torch

    from lightning_embcache import EmbeddingStore, TrainableRows, make_row_optimizer, trainable_fields

    torch.manual_seed(cfg["seed"])
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    rows, dim, batch, steps = cfg["rows"], cfg["dim"], cfg["batch"], cfg["steps"]
    kind = cfg["kind"]
    id_range = cfg.get("id_range") or rows
    t0 = time.perf_counter()
    if kind == "anchor":
        emb = torch.nn.Embedding(rows, dim, sparse=True)
        opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-2)

        def step(ids: torch.Tensor, i: int) -> None:
            z = emb(ids)
            (z * z).sum().backward()
            opt.step()
            opt.zero_grad()
    else:
        ro = make_row_optimizer("adam", lr=1e-2)
        store = EmbeddingStore.create(None, rows, dim, init="normal", fields=trainable_fields(ro, dim, torch.float32),
                                      materialize=kind == "materialized")
        trainable = TrainableRows(store, ro)

        def step(ids: torch.Tensor, i: int) -> None:
            z = trainable.lookup(ids)
            (z * z).sum().backward()
            trainable.apply(step=i + 1)
            trainable.settle()

    step(torch.randint(0, id_range, (batch,)), 0)
    out: dict[str, Any] = {"first_batch_s": time.perf_counter() - t0}
    if cfg.get("epochs"):
        ids = torch.randperm(id_range)[: steps * batch].view(steps, batch) if steps * batch <= id_range else \
            torch.randint(0, id_range, (steps, batch))
        times = []
        for rep in range(2):  # the same ids twice: first touches, then rows already made
            for i in range(steps):
                t = time.perf_counter()
                step(ids[i], 1 + rep * steps + i)
                times.append(time.perf_counter() - t)
        out["first_ms"] = 1e3 * statistics.median(times[:steps])
        out["steady_ms"] = 1e3 * statistics.median(times[steps:])
    return out


def _spawn(cfg: dict) -> dict:
    r = subprocess.run([sys.executable, "-m", "benchmarks.first_touch", "--worker", json.dumps(cfg)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embcache bench first-touch", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=40, help="steps of each epoch timed by first_epoch and table_size")
    p.add_argument("--small", type=int, default=20_000, help="rows of the small table of table_size")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--figures", default="first_batch,first_epoch,table_size")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads in every worker (default: torch's). On a loaded host give 1: "
                        "small steps whose ops split over busy cores stall at OpenMP's barriers (200 ms steps)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    base = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "steps": args.steps, "threads": args.threads}
    figures = args.figures.split(",")
    result: dict[str, Any] = {"benchmark": "first-touch", "args": vars(args), "host": platform.node(),
                              "machine": platform.processor() or platform.machine()}
    seed = iter(range(1, 10_000))

    def timed(cfg: dict, key: str):
        return lambda: _spawn(dict(base, **cfg, seed=next(seed)))[key]

    if "first_batch" in figures:
        runs = run_interleaved({"anchor": timed({"kind": "anchor"}, "first_batch_s"),
                                "store": timed({"kind": "store"}, "first_batch_s"),
                                "materialized": timed({"kind": "materialized"}, "first_batch_s")}, args.reps)
        result["first_batch"] = {"seconds": runs,
                                 "store_vs_anchor": paired_ratios(runs, "store", "anchor").as_dict(),
                                 "materialized_vs_anchor": paired_ratios(runs, "materialized", "anchor").as_dict()}
        print(f"first batch (s, {args.rows:,} x {args.dim}): " + ", ".join(
            f"{k} {statistics.median(v):.2f}" for k, v in runs.items()))
        print(f"  store / anchor {paired_ratios(runs, 'store', 'anchor')}; "
              f"materialized / anchor {paired_ratios(runs, 'materialized', 'anchor')}")
    if "first_epoch" in figures:
        firsts, steadies = [], []
        for _ in range(args.reps):
            r = _spawn(dict(base, kind="store", epochs=True, seed=next(seed)))
            firsts.append(r["first_ms"])
            steadies.append(r["steady_ms"])
        runs = {"first": firsts, "steady": steadies}
        result["first_epoch"] = {"ms": runs, "first_vs_steady": paired_ratios(runs, "first", "steady").as_dict()}
        print(f"first-touch step / steady step: {paired_ratios(runs, 'first', 'steady')}")
    if "table_size" in figures:
        runs = run_interleaved({
            "large": lambda: _spawn(dict(base, kind="store", epochs=True, id_range=args.small,
                                         seed=next(seed)))["steady_ms"],
            "small": lambda: _spawn(dict(base, rows=args.small, kind="store", epochs=True,
                                         seed=next(seed)))["steady_ms"]}, args.reps)
        result["table_size"] = {"ms": runs, "large_vs_small": paired_ratios(runs, "large", "small").as_dict()}
        print(f"same ids, {args.rows:,}- vs {args.small:,}-row table: {paired_ratios(runs, 'large', 'small')}")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
