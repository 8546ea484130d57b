"""An owner's host work for its device tier's misses, on the CPU: store reads and write-backs.

Each step an owner of a row-sharded table with a device tier smaller than its shard reads the
records of its missing rows into a pinned buffer (`EmbeddingStore.read_records`) and writes the
evicted dirty ones back (`write_records`), in two background threads, while the training and id
exchange threads run Python. This runs the same store calls at the same sizes in one background
thread, alone and beside ``--busy`` threads that run Python (they hold the GIL as those threads
do), and compares the tier's trusted copies (one call per row set that releases the GIL once, the
write-back's NaN/Inf sum included) with the checked calls split as the tier split them before
(`device_tier.store_spans`), one checked call per row set, and 1,024-row slices::

    python -m benchmarks.owner_host --rows 2500000 --dim 64 --miss-rows 4100 --busy 0 1 2

``--busy-writes N ...`` also times the calls beside N threads that write other records into the
same store in the tier's spans without pause (the write-back thread at its busiest: they take the
store's lock and the GIL as it does); ``--threads-only`` skips the Python-busy runs.

Reported per store call set: the median wall time in the background thread and its own CPU time.
No GPU is needed: the records go to and from ordinary host buffers.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def _layouts(k: int) -> dict[str, list[tuple[int, int]]]:
    from lightning_embcache.device_tier import store_spans

    return {"one call": [(0, k)], "1,024-row slices": [(a, min(k, a + 1024)) for a in range(0, k, 1024)],
            "tier (store_spans)": store_spans(k)}


def run(rows: int, dim: int, miss_rows: int, busy: list[int], reps: int, threads: int,
        busy_writes: list[int] | None = None) -> list[dict[str, Any]]:
    from lightning_embcache import EmbeddingStore, make_row_optimizer, trainable_fields
    from lightning_embcache.device_tier import finite_weights, store_spans

    torch.set_num_threads(threads)
    store = EmbeddingStore.create(None, rows, dim, fields=trainable_fields(make_row_optimizer("adam", lr=1e-3), dim,
                                                                         torch.float32))
    rb = store.row_bytes
    for a in range(0, rows, 1 << 16):  # every record in the hot pool, as a trained shard's are
        ids = torch.arange(a, min(rows, a + (1 << 16)))
        store.write_records(ids, store.read_records(ids))
    rng = np.random.default_rng(0)
    sets = [torch.from_numpy(np.sort(rng.choice(rows, miss_rows, replace=False))) for _ in range(8)]
    recs = [store.read_records(s) for s in sets]
    buf = torch.empty((miss_rows, rb), dtype=torch.uint8)

    def reads(spans: list[tuple[int, int]]) -> Callable[[int], None]:
        def f(i: int) -> None:
            for a, b in spans:
                store.read_records(sets[i][a:b], out=buf[a:b])
        return f

    def writes(spans: list[tuple[int, int]]) -> Callable[[int], None]:
        def f(i: int) -> None:
            for a, b in spans:
                store.write_records(sets[i][a:b], recs[i][a:b])
        return f

    def trusted_reads(i: int) -> None:  # the device tier's call: one copy, no id pass
        store._read_records_trusted(sets[i], buf)

    def trusted_writes(i: int) -> None:  # the write-back's: the NaN/Inf sum, then one copy
        finite_weights(store, recs[i])
        store._write_records_trusted(sets[i], recs[i])

    stop = threading.Event()

    def python_work() -> None:
        while not stop.is_set():
            s = 0
            for j in range(200):
                s += j

    other = torch.from_numpy(np.sort(rng.choice(rows, miss_rows, replace=False)))
    other_recs = store.read_records(other)

    def write_work() -> None:  # the write-back thread at its busiest, on rows the timed calls do not touch
        while not stop.is_set():
            for a, b in store_spans(miss_rows):
                store.write_records(other[a:b], other_recs[a:b])

    results = []
    runs = [(n, "python", python_work) for n in busy] + [(n, "store writes", write_work) for n in busy_writes or []]
    for nbusy, kind, work in runs:
        stop.clear()
        workers = [threading.Thread(target=work, daemon=True) for _ in range(nbusy)]
        for w in workers:
            w.start()
        try:
            for op, make, trusted in (("read_records", reads, trusted_reads), ("write_records", writes, trusted_writes)):
                for layout, spans in [*_layouts(miss_rows).items(), ("trusted (one copy)", None)]:
                    fn = trusted if spans is None else make(spans)
                    spans = spans or [(0, miss_rows)]
                    times: list[tuple[float, float]] = []

                    def body() -> None:
                        fn(0)
                        for i in range(reps):
                            t0, c0 = time.perf_counter(), time.thread_time()
                            fn(i % len(sets))
                            times.append((time.perf_counter() - t0, time.thread_time() - c0))

                    t = threading.Thread(target=body)
                    t.start()
                    t.join()
                    wall = sorted(x[0] for x in times)
                    cpu = sorted(x[1] for x in times)
                    results.append({"busy_threads": nbusy, "busy_kind": kind, "op": op, "layout": layout,
                                    "calls": len(spans),
                                    "wall_ms_median": 1e3 * wall[reps // 2], "wall_ms_mean": 1e3 * sum(wall) / reps,
                                    "thread_cpu_ms_median": 1e3 * cpu[reps // 2]})
                    r = results[-1]
                    print(f"busy={nbusy} ({kind}) {op:13s} {layout:19s} calls={len(spans)} wall median "
                          f"{r['wall_ms_median']:7.2f} ms  mean {r['wall_ms_mean']:7.2f}  own cpu "
                          f"{r['thread_cpu_ms_median']:.2f}", flush=True)
        finally:
            stop.set()
            for w in workers:
                w.join()
    store.close()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_500_000, help="rows of the owner's shard (host store)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--miss-rows", type=int, default=4100, help="rows read and written back per step")
    p.add_argument("--busy", type=int, nargs="*", default=[0, 1, 2], help="threads running Python beside it")
    p.add_argument("--busy-writes", type=int, nargs="*", default=[],
                   help="threads writing other records into the store beside it (store lock and GIL)")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--threads", type=int, default=4, help="torch threads")
    p.add_argument("--json", type=str, default=None, help="write the results here")
    a = p.parse_args(argv)
    res = run(a.rows, a.dim, a.miss_rows, a.busy, a.reps, a.threads, a.busy_writes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "torch": torch.__version__, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
