"""`embcache bench optim`: one sparse Adam step per batch, ours against `nn.Embedding` + `SparseAdam`.

A step starts from a batch of ids (uniform over the table, duplicates possible) and one gradient
row per id, and ends when the rows and both moments are updated in the table:

* ``sparse_adam``: `nn.Embedding(N, dim, sparse=True)` whose `.grad` is set to the uncoalesced
  sparse gradient its backward would produce, then `torch.optim.SparseAdam.step()` (timed: the step).
* ``rows``: `step_rows` with the `"adam"` row optimizer on three flat tables (weight, exp_avg,
  exp_avg_sq): `coalesce`, gather the rows and moments, update, scatter back.
* ``rows_thp`` (CPU): the same on tables allocated with `mmap` + `madvise(MADV_HUGEPAGE)`.
* ``rows_packed`` (CPU: on huge pages): one table `[N, 3 * dim]` holding weight | exp_avg |
  exp_avg_sq side by side, so a row and its moments are one gather and one scatter of 1.5 KiB.
* ``rows_fused`` (CUDA): `step_rows(..., fused=True)`, the Triton kernels of
  `lightning_embcache.optim.fused`: one launch (batches <= 2048 ids) or a sort and one launch,
  in place, no host sync. ``rows_fused_sort`` forces the sort kernel at every size. On CPU,
  ``rows_fused`` is the compiled loop of `lightning_embcache.optim.fused_cpu` on huge-page tables
  (`coalesce`, then one pass per row with prefetching); its build is not timed.
  (``rows`` runs with `fused=False`: plain torch ops, `coalesce` included.)

The variants run round-robin, one step each, so that load from other processes hits them alike;
each figure is the median over `--steps` timed steps after `--warmup` untimed ones. Batches rotate
through `--pool` pre-drawn (ids, grads) sets. CPU: wall clock (`time.perf_counter`); CUDA: CUDA
events around each step. Ratios are `sparse_adam / variant`. On CPU the process CPU time of each
step is recorded too (`cpu_*`): on a machine shared with other jobs, wall time includes time the
process was descheduled. CPU runs default to one torch thread: with all cores busy, OpenMP's
barrier waits inflated both sides' medians up to 100x here; `--threads 0` keeps torch's default.

    embcache bench optim [--device cpu|cuda] [--rows N] [--dim D] [--batches 512,8192]
                         [--steps S] [--variants a,b] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lightning_embcache.optim import fused, fused_cpu, make_row_optimizer, step_rows
from lightning_embcache.optim.table import CPU_CHUNK_ROWS, empty_hugepage, hugepage_bytes

VARIANTS = ("sparse_adam", "rows", "rows_thp", "rows_packed", "rows_fused", "rows_fused_sort")
CPU_ONLY = ("rows_thp",)
CUDA_ONLY = ("rows_fused_sort",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embcache bench optim", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--rows", type=int, default=None, help="table rows (default 1M on CPU, 10M on CUDA)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batches", default="512,8192", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=200, help="timed steps per variant and batch size")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pool", type=int, default=32, help="pre-drawn batches to rotate through")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: see the module docstring; 0 keeps torch's)")
    p.add_argument("--json", type=Path, default=None, help="write raw results here")
    p.add_argument("--quick", action="store_true", help="100k rows, 30 steps: a smoke run")
    return p


# --------------------------------------------------------------------------------------------
# the variants: each returns a `step(ids, grads, t)` closure over its own tables
# --------------------------------------------------------------------------------------------
def _sparse_adam(rows: int, dim: int, device: torch.device) -> Callable:
    emb = torch.nn.Embedding(rows, dim, sparse=True, device=device)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)

    def step(ids, grads, t):
        # what emb(ids).backward(grads) leaves in .grad: uncoalesced, one row per occurrence
        emb.weight.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grads, (rows, dim),
                                                   check_invariants=False)
        opt.step()
    return step, emb.weight


def _rows(rows: int, dim: int, device: torch.device, *, hugepages: bool, fused: bool = False) -> Callable:
    opt = make_row_optimizer("adam", lr=1e-3)
    if hugepages:
        weight = empty_hugepage((rows, dim))
        state = {k: empty_hugepage((rows, c), dt) for k, (dt, c) in opt.state_fields(dim).items()}
    else:
        weight = torch.zeros(rows, dim, device=device)
        state = opt.init_state(rows, dim, device=device)
    weight.normal_()

    def step(ids, grads, t):
        step_rows(opt, weight, state, ids, grads, step=t, fused=fused)
    return step, weight


def _rows_packed(rows: int, dim: int, device: torch.device, *, hugepages: bool) -> Callable:
    from lightning_embcache.optim import coalesce

    opt = make_row_optimizer("adam", lr=1e-3)
    packed = empty_hugepage((rows, 3 * dim)) if hugepages else torch.zeros(rows, 3 * dim, device=device)
    packed[:, :dim].normal_()

    chunk = None if device.type == "cuda" else CPU_CHUNK_ROWS

    @torch.no_grad()
    def step(ids, grads, t):
        ids, grads = coalesce(ids, grads)
        n = chunk or ids.numel()
        for s in range(0, ids.numel(), n):
            part = ids[s:s + n]
            block = packed.index_select(0, part)
            w, m, v = block[:, :dim], block[:, dim:2 * dim], block[:, 2 * dim:]
            opt.step(w, {"exp_avg": m, "exp_avg_sq": v}, grads[s:s + n], step=t)
            packed.index_copy_(0, part, block)
    return step, packed


def make_variant(name: str, rows: int, dim: int, device: torch.device):
    cpu = device.type == "cpu"
    if name == "sparse_adam":
        return _sparse_adam(rows, dim, device)
    if name == "rows":
        return _rows(rows, dim, device, hugepages=False)
    if name == "rows_thp":
        return _rows(rows, dim, device, hugepages=True)
    if name == "rows_fused":            # CPU: the compiled loop, built here (not timed), huge pages
        if cpu:
            fused_cpu.load()
        return _rows(rows, dim, device, hugepages=cpu, fused=True)
    if name == "rows_fused_sort":       # the sort kernel at every batch size
        step, table = _rows(rows, dim, device, hugepages=False, fused=True)

        def sorted_step(ids, grads, t):
            saved, fused.SCAN_MAX_IDS = fused.SCAN_MAX_IDS, 0
            try:
                step(ids, grads, t)
            finally:
                fused.SCAN_MAX_IDS = saved
        return sorted_step, table
    if name == "rows_packed":
        return _rows_packed(rows, dim, device, hugepages=cpu)
    raise SystemExit(f"embcache bench optim: --variants must name {list(VARIANTS)}; got {name!r}")


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
def _timer(device: torch.device):
    if device.type == "cuda":
        def timed(fn) -> tuple[float, float]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3, float("nan")
    else:
        def timed(fn) -> tuple[float, float]:
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            return time.perf_counter() - t0, time.process_time() - c0
    return timed


def run_batch_size(variants: dict, batch: int, args, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(batch)
    pool = [(torch.randint(0, args.rows, (batch,), generator=gen).to(device),
             torch.randn(batch, args.dim, generator=gen).to(device)) for _ in range(args.pool)]
    timed = _timer(device)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.warmup + args.steps):
        ids, grads = pool[i % len(pool)]
        for name, (step, _) in variants.items():
            seconds, cpu_seconds = timed(lambda: step(ids, grads, i + 1))
            if i >= args.warmup:
                samples[name].append(seconds)
                cpu[name].append(cpu_seconds)
    pipelined = _pipelined(variants, pool, args, device) if device.type == "cuda" else {}
    base = statistics.median(samples["sparse_adam"]) if "sparse_adam" in samples else None
    base_cpu = statistics.median(cpu["sparse_adam"]) if "sparse_adam" in cpu else None
    out = {}
    for name, xs in samples.items():
        xs = sorted(xs)
        med = statistics.median(xs)
        med_cpu = statistics.median(cpu[name])
        out[name] = {"median_ms": med * 1e3, "p10_ms": xs[len(xs) // 10] * 1e3,
                     "p90_ms": xs[(9 * len(xs)) // 10] * 1e3,
                     "speedup_vs_sparse_adam": (base / med) if base else None,
                     "cpu_median_ms": med_cpu * 1e3,
                     "cpu_speedup_vs_sparse_adam": (base_cpu / med_cpu) if base_cpu and med_cpu else None,
                     "pipelined_ms": pipelined.get(name),
                     "pipelined_speedup_vs_sparse_adam": (pipelined["sparse_adam"] / pipelined[name])
                     if pipelined.get("sparse_adam") else None,
                     "samples_ms": [x * 1e3 for x in samples[name]],
                     "cpu_samples_ms": [x * 1e3 for x in cpu[name]]}
    return out


def _pipelined(variants: dict, pool: list, args, device: torch.device, rounds: int = 5) -> dict:
    """CUDA: mean time per step over `--steps` steps queued back to back (one event pair), the
    median over `rounds` rounds. A step that never waits for the GPU overlaps its launch overhead
    with the previous step's kernels here; SparseAdam waits inside every step (its coalesce)."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name, (step, _) in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for i in range(args.steps):
                ids, grads = pool[i % len(pool)]
                step(ids, grads, 1000 + i)
            end.record()
            end.synchronize()
            out[name].append(start.elapsed_time(end) / args.steps)
    return {name: statistics.median(xs) for name, xs in out.items()}


def _environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    try:
        env["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        env["thp_enabled"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        env["loadavg_start"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("embcache bench optim: --device cuda but no CUDA device", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rows is None:
        args.rows = 100_000 if args.quick else (10_000_000 if device.type == "cuda" else 1_000_000)
    if args.quick:
        args.steps, args.warmup = 30, 5
    skip = CPU_ONLY if device.type == "cuda" else CUDA_ONLY
    names = [n for n in args.variants.split(",") if n and n not in skip]
    batches = [int(b) for b in args.batches.split(",")]
    env = _environment(device)
    print(f"embcache bench optim: {args.rows:,} x {args.dim} float32 on {env.get('gpu', device.type)}, "
          f"Adam, {args.steps} timed steps (median)", flush=True)
    variants = {}
    for name in names:
        t0 = time.perf_counter()
        variants[name] = make_variant(name, args.rows, args.dim, device)
        print(f"  built {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    results = {}
    for batch in batches:
        results[str(batch)] = run_batch_size(variants, batch, args, device)
    env["anon_hugepages_bytes"] = hugepage_bytes()
    env["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    if device.type == "cuda":
        env["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)

    second = "pipelined" if device.type == "cuda" else "cpu ms"
    print(f"{'batch':>6} {'variant':<16} {'median ms':>10} {'p10':>8} {'p90':>8} {'x SparseAdam':>13}"
          f" {second:>10} {'x':>7}")
    for batch, per in results.items():
        for name, r in per.items():
            ratio = f"{r['speedup_vs_sparse_adam']:.2f}" if r["speedup_vs_sparse_adam"] else "-"
            if device.type == "cuda":
                other, other_ratio = r["pipelined_ms"], r["pipelined_speedup_vs_sparse_adam"]
            else:
                other, other_ratio = r["cpu_median_ms"], r["cpu_speedup_vs_sparse_adam"]
            other_ratio = f"{other_ratio:.2f}" if other_ratio else "-"
            print(f"{batch:>6} {name:<16} {r['median_ms']:>10.3f} {r['p10_ms']:>8.3f} {r['p90_ms']:>8.3f} "
                  f"{ratio:>13} {other:>10.3f} {other_ratio:>7}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"benchmark": "optim", "command": "embcache bench optim " + " ".join(argv or sys.argv[1:]),
                  "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "device": str(device), "rows": args.rows, "dim": args.dim, "steps": args.steps,
                  "warmup": args.warmup, "pool": args.pool, "environment": env, "results": results}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
