"""Disk use of a store that keeps versions: pinned versions (what Lightning's checkpoints do) and
a read-only handle holding an old version.

Every row is written and compacted first, so the table lives in base chunk files. Then, for each
kept version, a share of the rows spread over every chunk is updated in a few flushes, the
version is pinned and compaction runs to completion. Pinned versions share the chunk files:
the store holds about the table plus the rows changed since the oldest pin, not a table per
pinned version. With ``--reader`` an early version is instead held by a read-only handle
through the flushes: compaction folds everything newer, and disk use stays within about 1.5x
the table plus what that version alone reads. Each kept version is checked to read its rows
bit for bit at the end.

    python examples/kept_versions_disk_use.py [--rows 200000] [--dim 64] [--versions 8] [--share 0.05] [--reader]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from pathlib import Path

import numpy as np
import torch

from lightning_embcache import EmbeddingStore


def disk_bytes(path: Path) -> int:
    """The sum of the sizes of the files in the store's folder."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def digest(store: EmbeddingStore) -> str:
    """A digest of every row of the version ``store`` reads (whole tables are not kept in memory)."""
    h = hashlib.sha256()
    for lo in range(0, store.num_rows, 65536):
        h.update(store.get(torch.arange(lo, min(lo + 65536, store.num_rows))).numpy().tobytes())
    return h.hexdigest()


def scatter(store: EmbeddingStore, rng: np.random.Generator, rows: int) -> int:
    ids = torch.from_numpy(rng.choice(store.num_rows, rows, replace=False))
    store.update(ids, torch.from_numpy(rng.standard_normal((rows, store.dim)).astype(np.float32)))
    return store.flush()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--versions", type=int, default=8, help="versions kept (pinned), or flushes x 10 with --reader")
    ap.add_argument("--share", type=float, default=0.05, help="share of the rows changed before each version")
    ap.add_argument("--flushes", type=int, default=3, help="flushes per kept version")
    ap.add_argument("--reader", action="store_true", help="hold an early version with a read-only handle instead")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        store = EmbeddingStore.create(path, args.rows, args.dim, hot_bytes=args.rows // 4 * (args.dim * 4 + 11))
        table = store.stats().table_bytes
        store.update(torch.arange(args.rows), torch.randn(args.rows, args.dim))
        store.flush()
        store.compact()
        per_flush = int(args.share * args.rows / args.flushes)
        kept: dict[int, str] = {}
        peak, reader = 0, None
        for _ in range(args.versions):
            for _ in range(args.flushes):
                v = scatter(store, rng, per_flush)
                if reader is not None:
                    peak = max(peak, disk_bytes(path))
            if args.reader:
                if reader is None:
                    reader = EmbeddingStore.open(path, version=v, readonly=True)
                    kept[v] = digest(reader)
                continue
            store.pin(v)
            kept[v] = digest(store)
            store.compact()
        store.compact()
        store.close()
        held = disk_bytes(path)
        for v, want in kept.items():
            with EmbeddingStore.open(path, version=v, readonly=True) as r:
                assert digest(r) == want, f"version {v} does not read its rows"
        if reader is not None:
            reader.close()
    changed = args.versions * args.flushes * per_flush * args.dim * 4
    result = {"table_mib": table / 2**20, "kept": len(kept), "changed_tables": changed / table,
              "disk_tables": held / table, "peak_tables": peak / table}
    what = "beside a reader" if args.reader else f"with {len(kept)} pinned versions"
    print(f"{what}: {held / table:.2f} x the table on disk once closed ({table / 2**20:.1f} MiB table, "
          f"{changed / table:.2f} tables of rows changed{f', peak {peak / table:.2f}' if args.reader else ''}); "
          f"every kept version reads its rows bit for bit")
    return result


if __name__ == "__main__":
    main()
