"""`embcache bench shuffle`: the randomness `ChunkShuffleSampler` trades, measured where it hurts most.

The worst case for a chunked order is a dataset whose store ids follow its content: samples
stored class by class (an ``ImageFolder`` walks its folders in order), so every chunk holds one
class. A uniform shuffle mixes every class into every batch; `ChunkShuffleSampler` draws a batch
from the ``window`` chunks of its group, so a batch sees only the classes of those chunks. Where
ids are unrelated to content, a chunked order is as good as a uniform one.

On synthetic data sorted by class (``--classes`` Gaussian classes in ``--dim`` dimensions, not
linearly trivial: class means at a fixed distance, unit noise), one epoch of softmax regression
(SGD, fixed learning rate, batch ``--batch``) per order, over ``--seeds`` seeds:

* ``uniform``: a random permutation (the baseline);
* ``chunks W=...``: `ChunkShuffleSampler` with each window;
* ``chunks W=..., random ids``: the same, the samples given store ids in a random order when the
  table was built (``store_ids=``): chunks then hold samples of every class;
* ``sequential``: no shuffle (one class after another: the anchor of what ordering can break).

Reported per order: held-out accuracy and loss after the epoch, distinct classes per batch, and
the gradient's deviation: the mean squared distance between each batch's gradient (at the
uniform run's final weights) and the full-data gradient, over the same for uniform batches.

    embcache bench shuffle [--json PATH] [--samples N] [--chunk-rows R] [--windows 4,16,64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from .results import write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embcache bench shuffle", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--chunk-rows", type=int, default=1024)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--windows", default="1,4,16,64", help="ChunkShuffleSampler windows (comma-separated)")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--separation", type=float, default=1.5, help="distance between class means")
    p.add_argument("--seeds", type=int, default=3)
    return p


def make_data(n: int, classes: int, dim: int, separation: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples stored class by class: ids 0..n-1 hold class 0 first, then class 1, ..."""
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((classes, dim))
    means *= separation / np.linalg.norm(means, axis=1, keepdims=True)
    y = np.repeat(np.arange(classes), -(-n // classes))[:n]
    x = (means[y] + rng.standard_normal((n, dim))).astype(np.float32)
    return x, y


def _loss_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Softmax cross-entropy of a linear model ``[x, 1] @ w``: mean loss and its gradient."""
    xb = np.hstack([x, np.ones((len(x), 1), np.float32)])
    z = xb @ w
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    p[np.arange(len(y)), y] -= 1.0
    return loss, xb.T @ p / len(y)


def orders(name: str, n: int, chunk_rows: int, seed: int) -> np.ndarray:
    from lightning_embcache import ChunkShuffleSampler

    if name == "uniform":
        return np.random.default_rng(seed).permutation(n)
    if name == "sequential":
        return np.arange(n)
    window = int(name.split("=")[1].split(",")[0])
    store_ids = np.random.default_rng(seed + 2000).permutation(n) if name.endswith("random ids") else None
    return ChunkShuffleSampler(n, chunk_rows=chunk_rows, window=window, seed=seed, store_ids=store_ids).order(0)


def run_order(order: np.ndarray, x: np.ndarray, y: np.ndarray, xt: np.ndarray, yt: np.ndarray,
              batch: int, lr: float, classes: int) -> dict:
    w = np.zeros((x.shape[1] + 1, classes), np.float32)
    distinct = []
    for a in range(0, len(order) - batch + 1, batch):
        ids = order[a : a + batch]
        distinct.append(len(np.unique(y[ids])))
        _, g = _loss_grad(w, x[ids], y[ids])
        w -= lr * g
    loss, _ = _loss_grad(w, xt, yt)
    acc = float((np.hstack([xt, np.ones((len(xt), 1), np.float32)]) @ w).argmax(axis=1).__eq__(yt).mean())
    return {"test_loss": loss, "test_accuracy": acc, "classes_per_batch": float(np.mean(distinct)), "w": w}


def gradient_spread(order: np.ndarray, w: np.ndarray, x: np.ndarray, y: np.ndarray, batch: int,
                    full: np.ndarray) -> float:
    """Mean squared distance of each batch's gradient at ``w`` from the full-data gradient."""
    d = []
    for a in range(0, len(order) - batch + 1, batch):
        ids = order[a : a + batch]
        _, g = _loss_grad(w, x[ids], y[ids])
        d.append(float(((g - full) ** 2).sum()))
    return float(np.mean(d))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    names = (["uniform"] + [f"chunks W={w}" for w in windows] + [f"chunks W={w}, random ids" for w in windows[:1]]
             + ["sequential"])
    runs: list[dict] = []
    t0 = time.perf_counter()
    for seed in range(args.seeds):
        x, y = make_data(args.samples, args.classes, args.dim, args.separation, seed)
        xt, yt = make_data(20_000, args.classes, args.dim, args.separation, seed)  # same means (same seed)
        shuffled = np.random.default_rng(seed + 1000).permutation(len(xt))
        xt, yt = xt[shuffled], yt[shuffled]
        results = {}
        for name in names:
            order = orders(name, args.samples, args.chunk_rows, seed)
            assert np.array_equal(np.sort(order), np.arange(args.samples)), name  # each sample once
            results[name] = run_order(order, x, y, xt, yt, args.batch, args.lr, args.classes)
        w = results["uniform"]["w"]
        _, full = _loss_grad(w, x, y)
        base = None
        for name in names:
            spread = gradient_spread(orders(name, args.samples, args.chunk_rows, seed), w, x, y, args.batch, full)
            base = spread if name == "uniform" else base
            r = results[name]
            r.pop("w")
            runs.append({"seed": seed, "order": name, **r, "gradient_spread": spread,
                         "gradient_spread_vs_uniform": spread / base})
    summary = {}
    print(f"{args.samples:,} samples of {args.classes} classes stored class by class, chunks of "
          f"{args.chunk_rows} rows, batch {args.batch}, one epoch of softmax regression, {args.seeds} seeds")
    print(f"{'order':26s} {'test accuracy':>22s} {'test loss':>10s} {'classes/batch':>14s} {'grad spread vs uniform':>23s}")
    for name in names:
        rs = [r for r in runs if r["order"] == name]
        s = {k: statistics.median(r[k] for r in rs) for k in ("test_accuracy", "test_loss", "classes_per_batch",
                                                              "gradient_spread_vs_uniform")}
        s["test_accuracy_range"] = [min(r["test_accuracy"] for r in rs), max(r["test_accuracy"] for r in rs)]
        summary[name] = s
        print(f"{name:26s} {s['test_accuracy']:8.4f} ({s['test_accuracy_range'][0]:.4f}-{s['test_accuracy_range'][1]:.4f})"
              f" {s['test_loss']:10.4f} {s['classes_per_batch']:14.2f} {s['gradient_spread_vs_uniform']:23.2f}")
    result = {"command": "embcache bench shuffle " + " ".join(argv if argv is not None else sys.argv[1:]),
              "config": vars(args), "summary": summary, "runs": runs, "seconds": time.perf_counter() - t0}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
