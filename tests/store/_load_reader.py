"""Reader process of tests/store/test_race_load.py: open read-only at the newest version, read
every row, print ``version digest`` lines until the time is up.

    python _load_reader.py PATH SECONDS NUM_ROWS DIM
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from lightning_embcache import EmbeddingStore, VersionNotFoundError


def main() -> None:
    path, seconds, n, dim = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    weights = torch.from_numpy(np.random.default_rng(99).standard_normal((n, dim)))
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        try:
            with EmbeddingStore.open(path, readonly=True, hot_bytes=1024 * (dim * 4 + 11)) as r:
                v = r.version
                time.sleep(0.01)  # let the writer flush and compact past this version meanwhile
                rows = r.get(torch.arange(n))
        except VersionNotFoundError:
            continue  # reclaimed between listing and locking: the open retries, never a wrong read
        print(v, f"{float((rows.double() * weights).sum()):.6e}", flush=True)


if __name__ == "__main__":
    main()
