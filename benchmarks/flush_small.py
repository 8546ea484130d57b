"""A small flush of a large table: `flush()` of 100 dirty rows in a 20M-row memory-mode table,
the store as it runs (its rows found from the log of rows marked dirty) against the same store
made to read every row's dirty mark (the log switched off before each such flush), paired in
alternating order over 9 repetitions after 3 untimed pairs. A diagnosis of what a frequent flush
(`DeferredSync` every few steps) pays for the table's size.

    python -m benchmarks.flush_small OUT.json
"""
import json
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from lightning_embcache import EmbeddingStore

ROWS = 20_000_000


def main(out_path: str) -> None:
    rows = ROWS
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        s = EmbeddingStore.create(tmp + "/s", rows, 4, chunk_rows=4096)
        g = np.random.default_rng(0)
        s.update(torch.arange(0, rows, 4096), torch.ones(len(range(0, rows, 4096)), 4))
        s.flush()
        res = {"log": [], "scan": []}
        def one(mode):
            ids = torch.from_numpy(np.unique(g.integers(0, rows, 100)))
            s.update(ids, torch.randn(len(ids), 4))
            if mode == "scan":
                s._tiers.hot._dirty_log = None
            t = time.perf_counter()
            s.flush()
            return time.perf_counter() - t
        for _ in range(3):
            one("log")
            one("scan")
        for rep in range(9):
            for mode in (("log", "scan") if rep % 2 == 0 else ("scan", "log")):
                res[mode].append(one(mode))
        s.close()
    ratios = [b / a for a, b in zip(res["log"], res["scan"])]
    out = {"rows": rows, "dirty_rows": 100, "reps": 9, "flush_ms_log": [1e3 * x for x in res["log"]],
           "flush_ms_scan": [1e3 * x for x in res["scan"]], "scan_over_log": ratios}
    print(f"flush of 100 rows, 20M-row table: log {1e3*statistics.median(res['log']):.1f} ms, scan {1e3*statistics.median(res['scan']):.1f} ms; "
          f"scan/log paired median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
