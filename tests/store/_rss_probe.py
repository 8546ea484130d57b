"""Memory probe of the budget test: random get/update over a disk store 4x its budget.

    python _rss_probe.py PATH HOT_BYTES WARM_BYTES NUM_ROWS DIM SECONDS

Prints one JSON line: the RSS before the store was created, the peak RSS while it ran (sampled
after every batch and from getrusage), and what the store says about its tiers.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def _vm_hwm() -> int:
    """Peak RSS of this process image (VmHWM). Not ru_maxrss: Linux carries the forking parent's
    high-water mark into it across fork+exec, so a big pytest parent would count as ours."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    import numpy as np
    import psutil
    import torch

    torch.set_num_threads(1)
    from lightning_embcache import EmbeddingStore

    path, hot, warm, n, dim, seconds = sys.argv[1], *map(int, sys.argv[2:6]), float(sys.argv[6])
    proc = psutil.Process()
    rng = np.random.default_rng(0)
    batch = 4096
    # warm up the allocator and torch with the same temporaries the loop makes
    for _ in range(3):
        ids = torch.from_numpy(rng.integers(0, n, batch))
        (torch.randn(batch, dim) + torch.zeros(batch, dim)).sum()
    base = proc.memory_info().rss
    peak = base
    with EmbeddingStore.create(path, n, dim, chunk_rows=1024, hot_bytes=hot, warm_bytes=warm) as s:
        t0 = time.monotonic()
        steps = 0
        touched = np.zeros(n, bool)
        while time.monotonic() - t0 < seconds or touched.mean() < 0.9:
            ids = torch.from_numpy(rng.integers(0, n, batch))
            rows = s.get(ids)
            s.update(ids, rows + 1.0)
            touched[ids.numpy()] = True
            steps += 1
            if steps % 25 == 0:
                s.flush()
            peak = max(peak, proc.memory_info().rss)
        st = s.stats()
        # the compaction process's memory beyond its own interpreter's (it holds no rows of the
        # budget, only a round's buffers): counted on top of this process's
        fp = s._fold_proc
        process_grew = fp.peak_rss() - fp.base_rss if fp is not None and fp.base_rss else 0
    maxrss = _vm_hwm()
    print(json.dumps({"base": base, "peak": max(peak, maxrss) + process_grew, "peak_sampled": peak,
                      "compaction_process_grew": process_grew, "steps": steps,
                      "touched": float(touched.mean()), "hot_bytes": st.hot_bytes, "warm_bytes": st.warm_bytes,
                      "cold_reads": st.cold_reads}))


if __name__ == "__main__":
    main()
