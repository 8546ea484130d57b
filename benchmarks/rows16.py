"""16-bit rows that learn: an auto-decoder trained with float32 rows, bfloat16 rows with stochastic
rounding, and bfloat16 rows rounded to nearest.

Each repetition trains the same auto-decoder (per-sample codes through `TrainableRows` with Adam,
a dense decoder with Adam) from the same initial state on the same batches for ``--steps`` steps,
once per configuration, the configurations in a rotating order; then reports the reconstruction
loss over every sample, the seconds per step and the bytes per row of the store (weight, moments,
metadata). Speed is the median of per-repetition ratios against float32 rows, with the range.

    embcache bench rows16 [--samples 4096] [--steps 600] [--reps 5] [--device cpu|cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from benchmarks.results import write_json
from lightning_embcache.device_tier import DeviceTier
from lightning_embcache.optim import make_row_optimizer
from lightning_embcache.store import EmbeddingStore
from lightning_embcache.trainable import TrainableRows, trainable_fields

#: name -> (row dtype, stochastic_rounding)
CONFIGS: dict[str, tuple[torch.dtype, bool | None]] = {
    "float32": (torch.float32, None),
    "bf16+SR": (torch.bfloat16, True),
    "bf16 nearest": (torch.bfloat16, False),
}


def _data(samples: int, dim: int, out_dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(samples, dim, generator=g)
    w1, w2 = torch.randn(dim, 128, generator=g) / dim ** 0.5, torch.randn(128, out_dim, generator=g) / 128 ** 0.5
    return torch.tanh(true @ w1) @ w2


def train(config: str, args: argparse.Namespace, targets: torch.Tensor) -> dict[str, Any]:
    dtype, rounding = CONFIGS[config]
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    decoder = nn.Sequential(nn.Linear(args.dim, 128), nn.ReLU(), nn.Linear(128, targets.shape[1])).to(device)
    dense = torch.optim.Adam(decoder.parameters(), lr=1e-3)
    opt = make_row_optimizer("adam", lr=args.row_lr)
    store = EmbeddingStore.create(None, args.samples, args.dim, dtype=dtype, init="normal", init_std=args.init_std,
                                  seed=args.seed, fields=trainable_fields(opt, args.dim, dtype))
    tier = DeviceTier(store, device, 1 << 40) if device.type == "cuda" else None
    rows = TrainableRows(store, opt, device_tier=tier, stochastic_rounding=rounding)
    y = targets.to(device)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, args.samples, (args.batch,), generator=g) for _ in range(args.steps)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step, ids in enumerate(batches, start=1):
        z = rows.lookup(ids, device=device)
        loss = nn.functional.mse_loss(decoder(z.float()), y[ids.to(device)])
        dense.zero_grad()
        loss.backward()
        dense.step()
        rows.apply(step=step)
    rows.write_down()
    rows.settle()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        codes = store.get(torch.arange(args.samples)).float().to(device)
        final = nn.functional.mse_loss(decoder(codes), y).item()
    out = {"loss": final, "seconds_per_step": seconds / args.steps, "row_bytes": store.row_bytes,
           "weight_bytes_per_row": args.dim * torch.empty(0, dtype=dtype).element_size()}
    if tier is not None:
        tier.close()
    store.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="embcache bench rows16", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--row-lr", type=float, default=1e-3)
    p.add_argument("--init-std", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    targets = _data(args.samples, args.dim, 64, args.seed + 100)
    names = list(CONFIGS)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotating order
        for n in order:
            runs[n].append(train(n, args, targets))
    base = runs["float32"]
    summary = {}
    for n in names:
        ratios = [b["seconds_per_step"] / r["seconds_per_step"] for r, b in zip(runs[n], base)]
        loss = runs[n][0]["loss"]  # every repetition trains identically: the same loss each time
        summary[n] = {"loss": loss, "loss_vs_float32": loss / base[0]["loss"] - 1.0,
                      "speed_vs_float32_median": statistics.median(ratios),
                      "speed_vs_float32_range": [min(ratios), max(ratios)],
                      "ms_per_step_median": 1e3 * statistics.median(r["seconds_per_step"] for r in runs[n]),
                      "row_bytes": runs[n][0]["row_bytes"], "weight_bytes_per_row": runs[n][0]["weight_bytes_per_row"]}
    print(f"auto-decoder, {args.samples} samples x {args.dim}, {args.steps} steps of {args.batch}, "
          f"Adam rows lr {args.row_lr}, {args.reps} reps, {args.device}")
    print(f"{'rows':<14}{'loss':>10}{'vs f32':>9}{'speed vs f32 (range)':>26}{'ms/step':>9}{'B/row':>7}")
    for n, s in summary.items():
        lo, hi = s["speed_vs_float32_range"]
        print(f"{n:<14}{s['loss']:>10.5f}{100 * s['loss_vs_float32']:>+8.2f}%"
              f"{s['speed_vs_float32_median']:>11.3f}x ({lo:.3f}-{hi:.3f}){s['ms_per_step_median']:>9.3f}"
              f"{s['row_bytes']:>7}")
    result = {"args": vars(args), "summary": summary, "runs": runs}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
