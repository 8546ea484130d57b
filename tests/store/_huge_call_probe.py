"""One huge call in a fresh process; prints its peak RSS growth over the RSS just before it.

argv: folder, mode (memory|disk), op (update|get|read_records), n_ids, rows, dim. The ids and
values are the caller's and made before the baseline; a result (get/read_records) is counted
in the growth, so the caller subtracts its size. The peak is the larger of a sampling thread's
and the kernel's high-water mark (the latter only once it passes its level before the call).
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import threading
import time

import numpy as np
import psutil
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.store import fill, tiers

# The call's own temporaries, on a table left partly made: the background fill would make the
# rest meanwhile (its pages are the table's, not the call's) and end the partly made state.
fill.BACKGROUND_FILL = False
tiers.ROWS_ON_FIRST_TOUCH = True  # a partly made table: the call's temporaries, not the table's pages

folder, mode, op = sys.argv[1], sys.argv[2], sys.argv[3]
n_ids, rows, dim = (int(a) for a in sys.argv[4:7])
hot = None if mode == "memory" else rows * dim * 4 // 4
s = EmbeddingStore.create(folder, num_rows=rows, dim=dim, hot_bytes=hot, init="zeros")
ids = torch.from_numpy(np.random.default_rng(0).integers(0, rows, n_ids))
vals = torch.ones(n_ids, dim) if op == "update" else None
s.get(ids[:1000])  # partly touched: memory mode is not in its all-loaded steady state
s.update(ids[:100], torch.ones(100, dim))
gc.collect()
proc = psutil.Process()
base = proc.memory_info().rss
kernel_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
peak, stop = base, False


def sample() -> None:
    global peak
    while not stop:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.001)


t = threading.Thread(target=sample)
t.start()
if op == "update":
    s.update(ids, vals)
elif op == "get":
    out = s.get(ids)
else:
    out = s.read_records(ids)
stop = True
t.join()
kernel = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if kernel > kernel_before:
    peak = max(peak, kernel)
print(json.dumps({"grew": peak - base, "row_bytes": s.row_bytes, "all_loaded": s._tiers.hot.all_loaded}))
s.close()
