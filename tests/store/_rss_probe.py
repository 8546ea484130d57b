"""Memory probe of the budget test: random get/update over a disk store 4x its budget.

    python _rss_probe.py PATH HOT_BYTES WARM_BYTES NUM_ROWS DIM SECONDS [ORDER]

ORDER ``random`` (the default), or ``chunk``: the table is written whole and compacted first,
then trained two epochs in `ChunkShuffleSampler` order with `LookaheadSampler` (chunks read
ahead whole into the warm tier, within its budget); the peak is that of the epochs.

Prints one JSON line: the RSS before the store was created, the peak RSS while it ran (sampled
after every batch and from VmHWM), less the pages of the store's maps of its chunk files (page
cache, reclaimed by the kernel as any cached file page: docs/store.md, "Memory"), and what the
store says about its tiers.
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


def _mapped(store) -> int:
    """Bytes of the store's maps of its chunk files in RSS: page cache pages (the kernel reclaims
    them as any cached file page), not memory the store holds, so not counted against its budget."""
    reader = store._versions.chunkrows
    return reader.mapped_resident_bytes() if reader is not None else 0


def main() -> None:
    import numpy as np
    import psutil
    import torch

    torch.set_num_threads(1)
    from lightning_embcache import EmbeddingStore

    path, hot, warm, n, dim, seconds = sys.argv[1], *map(int, sys.argv[2:6]), float(sys.argv[6])
    order = sys.argv[7] if len(sys.argv) > 7 else "random"
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
        if order == "chunk":
            from torch.utils.data import BatchSampler

            from lightning_embcache import ChunkShuffleSampler, LookaheadSampler

            for a in range(0, n, batch):  # every chunk gets a base file to read ahead
                s.update(torch.arange(a, min(n, a + batch)), torch.randn(min(n, a + batch) - a, dim))
                peak = max(peak, proc.memory_info().rss)
            s.flush()
            s.compact()
            s.flush()
            # the peak of the epochs from here on (the writes above are the random order's case);
            # "5" resets this process's VmHWM to its RSS now
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            peak = proc.memory_info().rss
            sampler = ChunkShuffleSampler(n, chunk_rows=1024, window=16, seed=0)
            batches = LookaheadSampler(BatchSampler(sampler, batch, drop_last=False), s, lookahead=8)
            work = (torch.as_tensor(b) for epoch in range(2) for b in batches)
        else:
            work = None
        while (time.monotonic() - t0 < seconds or touched.mean() < 0.9) if work is None else True:
            if work is None:
                ids = torch.from_numpy(rng.integers(0, n, batch))
            else:
                ids = next(work, None)
                if ids is None:
                    break
            rows = s.get(ids)
            s.update(ids, rows + 1.0)
            touched[ids.numpy()] = True
            steps += 1
            if steps % 25 == 0:
                s.flush()
            peak = max(peak, proc.memory_info().rss - _mapped(s))
        st = s.stats()
        mapped_end = _mapped(s)
        # the compaction process's memory beyond its own interpreter's (it holds no rows of the
        # budget, only a round's buffers): counted on top of this process's
        fp = s._versions.compaction.fold_proc
        process_grew = fp.peak_rss() - fp.base_rss if fp is not None and fp.base_rss else 0
    maxrss = _vm_hwm()
    print(json.dumps({"base": base, "peak": max(peak, maxrss - mapped_end) + process_grew, "peak_sampled": peak,
                      "mapped_end": mapped_end,
                      "compaction_process_grew": process_grew, "steps": steps,
                      "touched": float(touched.mean()), "hot_bytes": st.hot_bytes, "warm_bytes": st.warm_bytes,
                      "cold_reads": st.cold_reads, "chunks_read_ahead": st.chunks_read_ahead}))


if __name__ == "__main__":
    main()
