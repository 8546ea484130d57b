"""`embcache bench tuning`: what `hot_bytes`, `chunk_rows` and `warm_bytes`/LZ4 do to a training step.

One table of `--rows` x `--dim` float32 rows on disk, every row written once and flushed, then for
each setting a fresh `open` and `--steps` steps of {get of `--batch` ids, update of the same ids}
with ids in random order (an epoch of a shuffled DataLoader) or Zipf-distributed (a few hot ids),
and one flush at the end, each run on its own copy of the table. Figures are medians per step in
this process; the page cache is not dropped, so disk reads are served from the OS cache as on a
machine with spare RAM.

    embcache bench tuning                   # ~2 minutes on 2 cores
    embcache bench tuning --rows 200000 --steps 100 --out tuning.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_embcache.store import EmbeddingStore

MiB = 1 << 20


def _ids(kind: str, rows: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    if kind == "epoch":
        perm = rng.permutation(rows)
        return [torch.from_numpy(perm[(i * batch) % rows:][:batch].copy()) for i in range(steps)]
    ranks = np.minimum(rng.zipf(1.1, size=(steps, batch)) - 1, rows - 1)
    scattered = (ranks * 2_654_435_761 + 12345) % rows  # hot ids are not neighbours
    return [torch.from_numpy(np.unique(r).astype(np.int64)) for r in scattered]


def _build(path: Path, rows: int, dim: int, chunk_rows: int, compression: str | None, init: str) -> None:
    with EmbeddingStore.create(path, num_rows=rows, dim=dim, chunk_rows=chunk_rows, hot_bytes=64 * MiB,
                               compression=compression, init=init, seed=0) as store:
        g = torch.Generator().manual_seed(0)
        for lo in range(0, rows, 65_536):
            ids = torch.arange(lo, min(rows, lo + 65_536))
            if init == "zeros":  # sparse codes: a quarter of each row set, the rest zero (compresses)
                values = torch.zeros(len(ids), dim)
                values[:, : dim // 4] = torch.randn(len(ids), dim // 4, generator=g)
            else:
                values = torch.randn(len(ids), dim, generator=g)
            store.update(ids, values)
        store.flush()
        store.compact()
        store.flush()


def _run(path: Path, hot: int | None, warm: int, batches: list[torch.Tensor]) -> dict[str, float]:
    with EmbeddingStore.open(path, hot_bytes=hot, warm_bytes=warm) as store:
        times = []
        for ids in batches:
            t0 = time.perf_counter()
            rows = store.get(ids)
            store.update(ids, rows * 0.999)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        store.flush()
        flush_s = time.perf_counter() - t0
        s = store.stats()
    warm_steps = times[len(times) // 5:]  # after the first fifth
    return {"step_ms": 1e3 * statistics.median(warm_steps), "first_steps_ms": 1e3 * statistics.median(times[:10]),
            "flush_ms": 1e3 * flush_s, "hot_hit_rate": s.hot_hit_rate, "cold_reads": s.cold_reads,
            "bytes_read_per_step": s.bytes_read / len(times)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embcache bench tuning", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=None, help="write the JSON results here (default: print only)")
    args = p.parse_args(list(argv) if argv is not None else None)
    table = args.rows * args.dim * 4
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        def measure(label: str, chunk_rows: int, hot: int | None, warm: int = 0, compression: str | None = None,
                    init: str = "normal", workloads: Sequence[str] = ("epoch", "zipf")) -> None:
            template = Path(tmp) / f"c{chunk_rows}-{compression}-{init}"
            if not template.exists():
                _build(template, args.rows, args.dim, chunk_rows, compression, init)
            for kind in workloads:
                # each run on its own copy: none starts with another's flushed segments or compaction
                path = Path(tmp) / "run"
                shutil.rmtree(path, ignore_errors=True)
                shutil.copytree(template, path)
                r = _run(path, hot, warm, _ids(kind, args.rows, args.batch, args.steps, seed=1))
                r.update(setting=label, workload=kind, chunk_rows=chunk_rows, hot_mib=None if hot is None else hot / MiB,
                         warm_mib=warm / MiB, compression=compression, rows=init)
                results.append(r)
                print(f"{label:<40} {kind:<6} {r['step_ms']:8.2f} ms/step  hit {r['hot_hit_rate']:.0%}  "
                      f"read {r['bytes_read_per_step'] / 1024:8.1f} KiB/step  flush {r['flush_ms']:.0f} ms", flush=True)

        quarter = table // 4
        measure("memory mode (hot_bytes=None)", 1024, None)
        for chunk_rows in (64, 256, 1024):
            measure(f"hot = 1/4 table, chunk_rows={chunk_rows}", chunk_rows, quarter)
        measure("hot = 1/2 table, chunk_rows=256", 256, table // 2)
        measure("hot = 1/16 table, chunk_rows=256", 256, table // 16)
        measure("sparse rows, hot 1/8, no warm", 256, table // 8, 0, "lz4", "zeros", ("zipf",))
        measure("sparse rows, hot 1/8, warm 1/8 lz4", 256, table // 8, table // 8, "lz4", "zeros", ("zipf",))
        measure("random rows, hot 1/8, warm 1/8 lz4", 256, table // 8, table // 8, "lz4", "normal", ("zipf",))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": "tuning", "config": vars(args), "table_mib": table / MiB,
                                   "results": results}, indent=1))
        print(f"wrote {out}")
    return 0
