"""`embcache bench flush`: how fast a large flush reaches the disk, against a sequential write.

A store of ``--rows`` x ``--dim`` float32 rows on disk (memory mode, so the flush itself writes
every dirty row: no background write-back ran before it), fully written and compacted. Each
repetition updates ``--frac`` of the rows (random, sorted ids) and times ``flush()`` until it
returns (segment written, fsynced and published). Beside it, in the same repetition and folder:
what a user would run instead, a ``numpy.memmap`` of the same table given the same rows (fancy
assignment, untimed like the store's ``update``) and timed over ``flush()`` (``msync``), the two
flushes in a rotating order, each system's rows written just before its own flush; and the same number of bytes written sequentially in 1 MiB blocks
with one ``fsync``: what the disk gives a plain file. Background compaction started by a flush is
waited for before the next repetition, so each flush is timed alone.

Figures: per repetition, ``msync``'s time over the flush's (> 1: the store's flush is faster) and
the flush's throughput as a share of the sequential write's; medians and ranges over
repetitions (this machine is shared: single repetitions vary). As a diagnosis, the CPU time
this process spent in each (user + system, every thread): where CPU is short (other work on
the machine), a flush that needs more of it than ``msync`` does waits for it.

    embcache bench flush [--rows 500000] [--dim 128] [--frac 0.5] [--reps 5] [--dir DIR] [--out PATH]
                         [--compare-new-files]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from .results import write_json

MiB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embcache bench flush", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--frac", type=float, default=0.5, help="share of the rows each flush writes (default 0.5)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", help="where the files go (default: a temp dir under /var/tmp, removed after)")
    p.add_argument("--out", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="60,000 rows, 2 repetitions")
    p.add_argument("--compare-new-files", action="store_true",
                   help="also time, in the same rotation, a second store that keeps no dropped segment file for "
                        "reuse (each flush creates its file): a diagnosis of what reuse gives")
    return p


def _sequential(path: Path, nbytes: int) -> float:
    block = os.urandom(MiB)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(MiB, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    took = time.perf_counter() - t0
    os.unlink(path)
    return took


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    c0 = _cpu()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, _cpu() - c0


def run(rows: int, dim: int, frac: float, reps: int, where: Path, compare_new_files: bool = False) -> dict:
    import numpy as np
    import torch

    from lightning_embcache import EmbeddingStore

    store_dir = where / "store"
    s = EmbeddingStore.create(store_dir, rows, dim)
    stores = {"flush": s}
    if compare_new_files:
        stores["new_files"] = EmbeddingStore.create(where / "store-new-files", rows, dim)
        stores["new_files"]._versions.disk.segment_pool.limit = 0  # each flush creates its segment file
    first = torch.randn(rows, dim)
    mm = np.lib.format.open_memmap(where / "table.npy", mode="w+", dtype=np.float32, shape=(rows, dim))
    try:
        for st in stores.values():
            st.update(torch.arange(rows), first)
            st.flush()
            st.compact()
        mm[:] = first.numpy()
        mm.flush()
        rng = np.random.default_rng(0)
        k = int(rows * frac)
        runs = []
        for rep in range(reps):
            ids = np.sort(rng.choice(rows, k, replace=False))
            values = torch.randn(k, dim)
            for st in stores.values():
                st._wait_bg()  # a compaction the previous flush started: not part of this one
            took, cpu = {}, {}
            # Rotating order; each system's rows are written just before its own flush, so that
            # neither sync finds the other's dirty pages (a sync of the file system, or a journal
            # commit that orders data, would write and time them too).
            names = [*stores, "msync"]
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                if name in stores:
                    stores[name].update(torch.from_numpy(ids), values)
                    took[name], cpu[name] = _timed(stores[name].flush)
                else:
                    mm[ids] = values.numpy()
                    took[name], cpu[name] = _timed(mm.flush)
                for st in stores.values():
                    st._wait_bg()
            flush_s, msync_s = took["flush"], took["msync"]
            nbytes = k * dim * 4
            seq_s = _sequential(where / "sequential", nbytes)
            runs.append({"rep": rep, "bytes": nbytes, "flush_s": flush_s, "msync_s": msync_s, "sequential_s": seq_s,
                         "flush_mib_s": nbytes / flush_s / MiB, "sequential_mib_s": nbytes / seq_s / MiB,
                         "ratio": seq_s / flush_s, "vs_msync": msync_s / flush_s,
                         "flush_cpu_s": cpu["flush"], "msync_cpu_s": cpu["msync"]})
            if compare_new_files:
                runs[-1].update(new_files_s=took["new_files"], new_files_cpu_s=cpu["new_files"],
                                vs_new_files=took["new_files"] / flush_s)
            print(f"  rep {rep}: flush {nbytes / MiB:.0f} MiB in {flush_s:.3f} s ({nbytes / flush_s / MiB:.0f} MiB/s); "
                  f"memmap msync {msync_s:.3f} s: {msync_s / flush_s:.2f}x; sequential write + fsync {seq_s:.3f} s "
                  f"({nbytes / seq_s / MiB:.0f} MiB/s): {seq_s / flush_s:.2f}x its throughput; CPU flush "
                  f"{cpu['flush']:.3f} s, msync {cpu['msync']:.3f} s", flush=True)
    finally:
        for st in stores.values():
            st.close()
        del mm
    vs = [r["vs_msync"] for r in runs]
    return {"runs": runs, "median_ratio": statistics.median(r["ratio"] for r in runs),
            "median_vs_msync": statistics.median(vs), "range_vs_msync": [min(vs), max(vs)],
            "median_flush_mib_s": statistics.median(r["flush_mib_s"] for r in runs),
            "median_sequential_mib_s": statistics.median(r["sequential_mib_s"] for r in runs),
            "median_flush_cpu_s": statistics.median(r["flush_cpu_s"] for r in runs),
            "median_msync_cpu_s": statistics.median(r["msync_cpu_s"] for r in runs),
            **_vs_new_files(runs)}


def _vs_new_files(runs: list[dict]) -> dict:
    """Median and range of the paired ratio new-file flush time / flush time (> 1: reuse is faster)."""
    vs = [r["vs_new_files"] for r in runs if "vs_new_files" in r]
    return {"median_vs_new_files": statistics.median(vs), "range_vs_new_files": [min(vs), max(vs)]} if vs else {}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows, reps = (60_000, 2) if args.quick else (args.rows, args.reps)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="embcache-bench-flush-", dir="/var/tmp"
                                                                  if os.path.isdir("/var/tmp") else None))
    base.mkdir(parents=True, exist_ok=True)
    print(f"flush of {args.frac:.0%} of {rows:,} x {args.dim} float32 rows in {base}", flush=True)
    try:
        res = run(rows, args.dim, args.frac, reps, base, args.compare_new_files)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    res["config"] = {"rows": rows, "dim": args.dim, "frac": args.frac, "reps": reps,
                     "cpus": os.cpu_count(), "load_avg": list(os.getloadavg())}
    lo, hi = res["range_vs_msync"]
    print(f"median: flush {res['median_flush_mib_s']:.0f} MiB/s = {res['median_ratio']:.2f}x the sequential "
          f"write's {res['median_sequential_mib_s']:.0f} MiB/s; {res['median_vs_msync']:.2f}x ({lo:.2f}-{hi:.2f}) "
          f"the speed of memmap's msync of the same rows; CPU: flush {res['median_flush_cpu_s']:.3f} s, msync "
          f"{res['median_msync_cpu_s']:.3f} s")
    if "median_vs_new_files" in res:
        lo, hi = res["range_vs_new_files"]
        print(f"a flush into a reused segment file against one creating its file: {res['median_vs_new_files']:.2f}x "
              f"({lo:.2f}-{hi:.2f}) its speed")
    if args.out:
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
