"""Scaling of an auto-decoder whose per-sample codes are trainable rows of a row-sharded store.

    python -m benchmarks.distributed --world-sizes 1 2 4 --rows 10000000 --dim 64 \\
        --batch 8192 --steps 100 --device-fraction 0.5 --threads 4 --repeat 5 --out bench-results/distributed-scaling.json

Each world size runs in fresh processes (one per GPU; NCCL for the decoder's DDP). Per step and
rank: `lookup` of `--batch` random ids (rows fetched from their owners), a 3-layer MLP decoder
under DDP, backward, the rows' gradients sent to their owners and applied by Adam there, the
decoder's Adam step. Weak scaling: the per-rank batch is fixed, so samples/s should grow with the
world size.

``--rows-on gpu`` (default): every owner keeps ``--device-fraction`` of its shard (rows + Adam
state) in a `DeviceTier` on its GPU, the rest in host memory; ids travel over Gloo, rows and
gradient rows GPU to GPU over NCCL (`ShardedDeviceRows`). World size 1 is one process with a
`DeviceTier` of the same fraction of the whole table. Before timing, each tier is filled with
rows marked dirty, so evictions write rows back as in a long run (an empty tier would take
hundreds of steps to fill). ``--rows-on host``: the owners' rows in host memory, exchanged over
Gloo. Every run announces coming batches' ids (``prefetch``; ``--no-prefetch`` turns it off): with
several processes ``--ahead`` batches (default 2), so that the id exchange of the batch after
next (one thread) and the owners' uploads of missing rows for the next (another) overlap the
step; one process prefetches the next batch into its tier. The host time of the background
threads' stages and of the owners' misses by part (any thread) is reported beside the training
thread's phases. ``--switch-interval S`` sets Python's thread switch interval in every process.

``--variants`` times several configurations one after another in the same processes of each
world size (one setup, one filled tier), ``--repeat`` times, interleaved, so that settings are
compared on the same machine state: ``default``, ``si=SECONDS`` (switch interval),
``uploads=lookup`` (no upload thread: the lookup brings the misses up; one process: no tier
prefetch), ``finite=off`` (the store's NaN/Inf check of written-back rows off),
``store=checked`` (the tier's store calls as checked public calls in slices) and
``prepare=lookup`` (the batch positions computed in the lookup), joined with ``+``:
``store=checked+prepare=lookup`` is the owner path before its trusted store calls. Each
result's ``speedup_vs_first`` compares it with the median of the same variant at the first world
size; runs of a few hundred ms vary by 10-20% (and now and then 2x), so compare medians over
repeats.

Every process uses ``--threads`` torch threads (default: 4, or fewer when cores / largest world
size is smaller), the same at every world size: on 4 x H100 with 64 cores, 16 threads per process
made 4 processes 3x slower than 4 threads did (oversubscribed cores: each process also runs
Gloo, NCCL, prefetch and write-back threads). ``--host-threads T ...`` also times one process
with host rows at each T (the host path's sensitivity to the thread count). ``--device-tier-baseline``: one process
with the whole table in its device tier. ``--dense``: DDP + a dense ``nn.Embedding`` + Adam.

Reported per run: samples/s (steady, after `--warmup` steps), ms per step, the bytes each rank sent
for the store per step (ids, split sizes, rows, gradient rows), and the bytes DDP would all-reduce
per rank per step for the same table as a dense ``nn.Embedding`` (ring all-reduce:
2 (W-1)/W x rows x dim x 4).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OUT_DIM = 32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _decoder(dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(dim, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, OUT_DIM))


def _targets(ids: torch.Tensor) -> torch.Tensor:
    f = torch.arange(1, OUT_DIM + 1, device=ids.device, dtype=torch.float32)
    return torch.sin(ids[:, None].float() * 1e-4 * f)


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], queue: Any) -> None:
    from lightning_embcache import EmbeddingStore, TrainableRows, make_row_optimizer, trainable_fields
    from lightning_embcache.device_tier import SLOT_OVERHEAD, DeviceTier
    from lightning_embcache.distributed import ShardedStore

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    n, dim = cfg["rows"], cfg["dim"]
    opt = make_row_optimizer("adam", lr=1e-3)
    fields = trainable_fields(opt, dim, torch.float32)
    on_gpu = cuda and cfg["mode"] in ("gpu", "resident")
    tier = None
    if world == 1:
        store: Any = EmbeddingStore.create(None, n, dim, fields=fields)
        local = store
        if on_gpu:
            frac = 1.1 if cfg["mode"] == "resident" else cfg["fraction"]
            tier = DeviceTier(store, device, int(frac * n * (store.row_bytes + SLOT_OVERHEAD)))
        rows: Any = TrainableRows(store, opt, device_tier=tier)
    else:
        store = ShardedStore.open_or_create(None, n, dim, fields=fields)
        local = store.local
        budget = int(cfg["fraction"] * local.num_rows * (local.row_bytes + SLOT_OVERHEAD)) if on_gpu else 0
        rows = store.trainable_rows(opt, device=device if on_gpu else None, device_bytes=budget)
        tier = getattr(rows, "tier", None)
    if tier is not None and not tier.resident:
        _fill(tier)
    decoder = _decoder(dim).to(device)
    model = torch.nn.parallel.DistributedDataParallel(decoder, device_ids=[rank] if cuda else None)
    dense_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # host seconds per phase (the host waits in them for its peers and for old copies, never for
    # the current step's GPU work): where a step's time goes
    phases = dict.fromkeys(("route", "tier", "lookup", "forward_backward", "apply", "dense_step"), 0.0)
    timing = [False]

    def timed(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if timing[0]:
                    phases[name] += time.perf_counter() - t
        return call

    if hasattr(store, "route"):
        store.route = timed("route", store.route)
    if tier is not None:
        tier.positions = timed("tier", tier.positions)
        if not tier.resident:  # where an owner's misses go (any thread: serve, lookup, write-back)
            phases.update(miss_evict=0.0, miss_upload=0.0, store_read=0.0, store_write=0.0)
            tier._evict, tier._upload = timed("miss_evict", tier._evict), timed("miss_upload", tier._upload)
            local.read_records = timed("store_read", local.read_records)
            local.write_records = timed("store_write", local.write_records)
            local._read_records_trusted = timed("store_read", local._read_records_trusted)
            local._write_records_trusted = timed("store_write", local._write_records_trusted)
    lookup, apply = timed("lookup", rows.lookup), timed("apply", rows.apply)
    ahead = getattr(store, "ahead", None)
    if ahead is not None:  # the background threads' stages (they overlap the training thread's)
        phases.update(ahead_exchange=0.0, ahead_serve=0.0)
        ahead.exchange = timed("ahead_exchange", ahead.exchange)
        if ahead.serve is not None:
            ahead.serve = timed("ahead_serve", ahead.serve)
    gen = torch.Generator().manual_seed(1000 + rank)
    switch0 = sys.getswitchinterval()
    check0 = getattr(local, "_check_finite", True)
    prepare0 = getattr(ahead, "prepare", None)
    results = []
    for name in cfg["variants"]:
        v = parse_variant(name)
        # a variant's settings, switched between timed runs in the same processes (see `parse_variant`)
        sys.setswitchinterval(v.get("si", cfg.get("switch_interval") or switch0))
        uploads = v.get("uploads", "background")
        if ahead is not None:
            ahead.serve_ahead = uploads == "background"
        local._check_finite = check0 if v.get("finite", "on") == "on" else False
        if tier is not None:
            tier.trusted_store_calls = v.get("store", "trusted") == "trusted"
        if ahead is not None:
            ahead.prepare = prepare0 if v.get("prepare", "ahead") == "ahead" else None
        prefetch = None
        if cfg["prefetch"] and not (world == 1 and uploads == "lookup"):
            # rows on GPUs: `ShardedDeviceRows.prefetch`; host rows: announced to the store; one
            # process with uploads=lookup: no tier prefetch (the lookup brings the misses up)
            prefetch = getattr(rows, "prefetch", None) or (store.prefetch if world > 1 else None)
        # batches announced ahead: the id exchange of the batch after next overlaps the owners'
        # uploads for the next one (one process has no exchange: its tier prefetches the next batch)
        depth = (cfg["ahead"] if world > 1 else 1) if prefetch is not None else 0
        for k in phases:
            phases[k] = 0.0
        out = _timed_steps(cfg, rank, world, store, rows, tier, model, dense_opt, gen, lookup, apply, prefetch,
                           depth, phases, timing, device, cuda)
        out["variant"] = name
        results.append(out)
    sys.setswitchinterval(switch0)
    local._check_finite = check0
    if cfg.get("dense") and world > 1 and cuda:
        results[0]["dense"] = _dense(rank, world, cfg, device)
    queue.put({"rank": rank, "runs": results})
    dist.barrier()
    dist.destroy_process_group()


def parse_variant(name: str) -> dict[str, Any]:
    """``--variants`` names: ``default`` or ``+``-joined settings: ``si=SECONDS`` (thread switch
    interval), ``uploads=background|lookup`` (the owners' uploads of announced lookups in a thread
    of their own, or at the lookup; one process: tier prefetch or none), ``finite=on|off`` (the
    store's NaN/Inf check of rows written back from the GPU), ``store=trusted|checked`` (the
    device tier's store reads and write-backs as one trusted copy per row set, or as the checked
    public calls in slices, as before), ``prepare=ahead|lookup`` (a lookup's batch positions
    computed by the exchange thread, or by the lookup in the training thread, as before)."""
    out: dict[str, Any] = {}
    if name == "default":
        return out
    for part in name.split("+"):
        key, _, val = part.partition("=")
        if key == "si":
            out["si"] = float(val)
        elif key == "uploads" and val in ("background", "lookup"):
            out["uploads"] = val
        elif key == "finite" and val in ("on", "off"):
            out["finite"] = val
        elif key == "store" and val in ("trusted", "checked"):
            out["store"] = val
        elif key == "prepare" and val in ("ahead", "lookup"):
            out["prepare"] = val
        else:
            raise SystemExit(f"--variants: unknown setting {part!r} in {name!r}; see parse_variant")
    return out


def _timed_steps(cfg: dict[str, Any], rank: int, world: int, store: Any, rows: Any, tier: Any, model: Any,
                 dense_opt: Any, gen: torch.Generator, lookup: Any, apply: Any, prefetch: Any, depth: int,
                 phases: dict[str, float], timing: list[bool], device: torch.device, cuda: bool) -> dict[str, Any]:
    """``--warmup`` + ``--steps`` training steps; figures of the timed ones."""
    n, batch = cfg["rows"], cfg["batch"]
    local = getattr(store, "local", store)
    sent0 = t0 = io0 = 0.0
    ev0 = hits0 = 0
    coming: list[torch.Tensor] = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            sent0 = getattr(store, "exchanged_bytes", 0)
            io0 = _store_seconds(store, tier)
            ev0 = tier.evicted_rows if tier is not None else 0
            hits0 = _hits(store)
            timing[0] = True
        ids = coming.pop(0) if coming else torch.randint(0, n, (batch,), generator=gen)
        z = lookup(ids, device)
        while len(coming) < depth:  # the coming batches' rows move while this step computes
            coming.append(torch.randint(0, n, (batch,), generator=gen))
            prefetch(coming[-1])
        t = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(z), _targets(ids.to(device, non_blocking=True)))
        loss.backward()
        rows.collect()
        t1 = time.perf_counter()
        apply(step + 1)
        t2 = time.perf_counter()
        dense_opt.step()
        dense_opt.zero_grad(set_to_none=True)
        if timing[0]:
            phases["forward_backward"] += t1 - t
            phases["dense_step"] += time.perf_counter() - t2
    timing[0] = False
    hits = _hits(store) - hits0
    for ids in coming:  # the batches announced for the steps after the last
        lookup(ids, device)
        rows.discard()
    rows.settle()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    steps = cfg["steps"]
    sent = (getattr(store, "exchanged_bytes", 0) - sent0) / steps
    io = _store_seconds(store, tier) - io0
    return {"rank": rank, "elapsed_s": elapsed, "store_bytes_per_step": sent, "loss": float(loss.detach()),
            "store_ms_per_step": 1e3 * io / steps,
            "evicted_rows_per_step": ((tier.evicted_rows - ev0) / steps) if tier is not None else 0.0,
            "device_capacity_rows": tier.capacity if tier is not None else 0, "shard_rows": local.num_rows,
            "lookups_exchanged_ahead": hits, "prefetch": prefetch is not None, "ahead": depth,
            "phase_ms": {k: 1e3 * v / steps for k, v in phases.items()}}


def _hits(store: Any) -> int:
    """Lookups that found their id exchange done ahead (sharded stores)."""
    ahead = getattr(store, "ahead", None)
    return ahead.hits if ahead is not None else 0


def _store_seconds(store: Any, tier: Any) -> float:
    """Seconds the training thread spent in the store: exchanges and the owner's tier work
    (sharded), the tier's entry points (one process with a tier), or the host store's calls."""
    clock = getattr(store, "_clock", None)
    if clock is not None:
        return clock.seconds
    return tier.io_seconds if tier is not None else store.io_wait_seconds


def _fill(tier: Any) -> None:
    """Fill a tier with rows marked dirty (the steady state of a long run) before timing."""
    import numpy as np

    n = min(tier.capacity, tier.store.num_rows)
    for a in range(0, n, 262_144):
        ids = np.arange(a, min(n, a + 262_144), dtype=np.int64)
        with tier.step_lock:
            tier.mark_dirty(tier.slots(ids))
    torch.cuda.synchronize()


def _dense(rank: int, world: int, cfg: dict[str, Any], device: torch.device) -> dict[str, float]:
    """DDP + a dense nn.Embedding of the same table + Adam: what rows as parameters cost."""
    n, dim, batch = cfg["rows"], cfg["dim"], cfg["batch"]

    class Dense(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.codes = torch.nn.Embedding(n, dim)
            self.decoder = _decoder(dim)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.decoder(self.codes(ids))

    model = torch.nn.parallel.DistributedDataParallel(Dense().to(device), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(2000 + rank)
    steps, warm = max(5, cfg["steps"] // 5), 3
    for step in range(warm + steps):
        if step == warm:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        ids = torch.randint(0, n, (batch,), generator=gen).to(device)
        torch.nn.functional.mse_loss(model(ids), _targets(ids)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    del model, opt
    torch.cuda.empty_cache()
    return {"ms_per_step": ms, "samples_per_s": world * batch / (ms / 1e3)}


def run(world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One world size in fresh processes: one result per ``cfg["variants"]`` entry, in order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, queue)) for r in range(world)]
    for p in procs:
        p.start()
    ranks = [queue.get(timeout=cfg.get("timeout", 600)) for _ in range(world)]
    for p in procs:
        p.join(60)
    return [_summary(world, cfg, [r["runs"][i] for r in ranks]) for i in range(len(cfg["variants"]))]


def _summary(world: int, cfg: dict[str, Any], got: list[dict[str, Any]]) -> dict[str, Any]:
    elapsed = max(g["elapsed_s"] for g in got)
    res = {"world_size": world, "variant": got[0]["variant"], "steps": cfg["steps"], "rows_on": cfg["mode"],
           "threads": cfg["threads"], "prefetch": got[0]["prefetch"], "ahead": got[0]["ahead"],
           "lookups_exchanged_ahead_min_rank": min(g["lookups_exchanged_ahead"] for g in got),
           "samples_per_s": world * cfg["batch"] * cfg["steps"] / elapsed,
           "ms_per_step": 1e3 * elapsed / cfg["steps"],
           "store_bytes_per_step_per_rank": sum(g["store_bytes_per_step"] for g in got) / world,
           "dense_allreduce_bytes_per_step_per_rank": 2 * (world - 1) / world * cfg["rows"] * cfg["dim"] * 4,
           "store_ms_per_step_max_rank": max(g["store_ms_per_step"] for g in got),
           "device_capacity_rows_per_rank": max(g["device_capacity_rows"] for g in got),
           "shard_rows": max(g["shard_rows"] for g in got),
           "evicted_rows_per_step_per_rank": sum(g["evicted_rows_per_step"] for g in got) / world,
           "final_loss_rank0": sorted(got, key=lambda g: g["rank"])[0]["loss"],
           "host_phase_ms_max_rank": {k: max(g["phase_ms"].get(k, 0.0) for g in got) for k in got[-1]["phase_ms"]}}
    dense = [g["dense"] for g in got if "dense" in g]
    if dense:
        res["dense_embedding_ddp"] = {"ms_per_step": max(d["ms_per_step"] for d in dense),
                                      "samples_per_s": min(d["samples_per_s"] for d in dense)}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096, help="ids per rank per step")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rows-on", choices=["gpu", "host"], default="gpu",
                   help="gpu: each owner's hot rows in a device tier (CUDA); host: in host memory")
    p.add_argument("--device-fraction", type=float, default=0.5,
                   help="each rank's device budget as a fraction of its shard (rows + Adam state + bookkeeping)")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="no prefetch of the next batch's rows (by default every run prefetches them)")
    p.add_argument("--ahead", type=int, default=2,
                   help="batches announced ahead with prefetch at several processes (default 2: the id exchange "
                        "of the batch after next overlaps the owners' uploads for the next)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval in every process (seconds; Python's default is 0.005)")
    p.add_argument("--variants", nargs="+", default=["default"],
                   help="configurations timed one after another in the same processes of each world size, "
                        "e.g. default si=0.0005 uploads=lookup uploads=lookup+si=0.0005 finite=off "
                        "(see parse_variant); each is compared with the same variant at the first world size")
    p.add_argument("--repeat", type=int, default=1, help="time the list of variants this many times, interleaved")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (default: min(4, cores / largest world size))")
    p.add_argument("--host-threads", type=int, nargs="*", default=[],
                   help="also time 1 process with host rows at each of these thread counts")
    p.add_argument("--dense", action="store_true", help="also time DDP + a dense nn.Embedding (CUDA only)")
    p.add_argument("--device-tier-baseline", action="store_true",
                   help="also run 1 process with the whole table in a GPU device tier (CUDA only)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    threads = args.threads or max(1, min(4, (os.cpu_count() or 2) // max(args.world_sizes)))
    mode = args.rows_on if cuda else "host"
    cfg = dict(rows=args.rows, dim=args.dim, batch=args.batch, steps=args.steps, warmup=args.warmup, dense=args.dense,
               threads=threads, mode=mode, fraction=args.device_fraction, prefetch=args.prefetch,
               ahead=args.ahead, switch_interval=args.switch_interval, variants=list(args.variants) * args.repeat)
    for v in args.variants:
        parse_variant(v)
    results = []
    for w in args.world_sizes:
        for r in run(w, cfg):
            results.append(r)
            print(json.dumps(r), flush=True)
    extra = []
    if args.device_tier_baseline and cuda:
        extra.append(({**cfg, "mode": "resident", "dense": False}, "1 (whole table in the device tier)"))
    for t in args.host_threads:
        extra.append(({**cfg, "mode": "host", "threads": t, "dense": False}, f"1 (host rows, {t} threads)"))
    for c, label in extra:
        r = run(1, {**c, "variants": ["default"]})[0]
        r["world_size"] = label
        print(json.dumps(r), flush=True)
        results.append(r)
    # each variant against the same variant at the first world size (median over --repeat)
    first = args.world_sizes[0]
    for r in results:
        same = [b["samples_per_s"] for b in results if b["world_size"] == first and b["variant"] == r["variant"]]
        r["speedup_vs_first"] = r["samples_per_s"] / (sorted(same)[len(same) // 2] if same else results[0]["samples_per_s"])
    report = {"config": cfg,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "gpus": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"world {r['world_size']} {r['variant']} [{r['rows_on']}, {r['threads']} thr{', ahead ' + str(r['ahead']) if r['prefetch'] else ''}]: {r['samples_per_s']:,.0f} samples/s "
              f"({r['speedup_vs_first']:.2f}x), {r['ms_per_step']:.1f} ms/step "
              f"(store {r['store_ms_per_step_max_rank']:.1f}), sent {r['store_bytes_per_step_per_rank'] / 1e6:.2f} MB/step/rank, "
              f"device rows {r['device_capacity_rows_per_rank']:,}/{r['shard_rows']:,}, "
              f"evicted {r['evicted_rows_per_step_per_rank']:,.0f}/step, "
              f"exchanged ahead {r['lookups_exchanged_ahead_min_rank']}/{r.get('steps', '')}"
              + (f", dense DDP {r['dense_embedding_ddp']['ms_per_step']:.1f} ms/step" if "dense_embedding_ddp" in r else "")
              + "\n    host ms/step: " + ", ".join(f"{k} {v:.2f}" for k, v in r["host_phase_ms_max_rank"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
