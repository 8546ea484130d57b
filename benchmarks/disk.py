"""`embcache bench disk`: disk mode against numpy.memmap on the same rows.

One table of ``--rows`` x ``--dim`` float32 rows, written once as a compacted store and as a
``.npy`` file. Every (system, phase) runs in its own subprocess (peak RSS is per process), the
systems interleaved within each repetition; figures are medians over repetitions.

* ``warm``: the files in the page cache; epoch order (a random permutation in batches of
  ``--batch``), per batch ``get`` then ``update`` of the rows got (+1), ``flush`` every
  ``--flush-every`` batches. Store: ``hot_bytes`` = table / ``--table-factor`` (4x), with and
  without ``LookaheadSampler``; memmap: fancy index + fancy assignment, ``flush()`` (msync).
* ``cold``: the same loop after dropping the page cache (``/proc/sys/vm/drop_caches`` when
  permitted, else ``posix_fadvise(DONTNEED)`` on every file); stall = time ``get`` waited on reads.
* ``space``: a fresh store, ``--flushes`` flushes that each rewrite ``--flush-frac`` of the rows
  (nothing pinned), other rows each time (``random``) and the same rows each time (``hotset``):
  disk use / table after each, bytes written (flushes and compaction) per byte flushed, the time
  with background compaction, ``close()`` time.
* ``epoch``: the warm loop over a whole epoch (every row once; compaction's steady state):
  rows/s against memmap, and the store's peak RSS over the post-import baseline against the
  memory target, 1.1 x (hot + warm budgets) + 64 MiB.

Every store run works on its own copy of the store as set up (a run's flushes change the layout
the next run would read); memmap's warm runs use the ``.npy`` file as written.

``--order chunkshuffle`` gives every system of the warm, reread, cold and epoch phases the same
`ChunkShuffleSampler` order (window ``--window``) instead of a uniform permutation: the store
against memmap given the order the sampler is for.

``--step-ms`` puts a stand-in for a training step's compute (one-thread matrix products, which
release the GIL) after each batch's store calls: what a lookahead prefetch can overlap.
``--read-iops`` runs the cold phase's processes on a slower disk: a block-I/O cgroup caps their
reads per second; ``--mem-limit-mib`` caps their memory, page cache included, so a table a few
times the limit is read from the disk as one far beyond RAM would be (see `slowdisk`; needs root).

    embcache bench disk [--quick] [--json PATH] [--reps R] [--rows N] [--step-ms MS] [--read-iops N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .results import write_json

MiB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embcache bench disk", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, one repetition")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--reps", type=int, help="repetitions (default 3; quick 1)")
    p.add_argument("--rows", type=int, help="table rows (default 500,000; quick 60,000)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--batches", type=int, help="timed batches per process (default 300; quick 60)")
    p.add_argument("--flush-every", type=int, default=50)
    p.add_argument("--table-factor", type=float, default=4.0, help="table bytes / hot_bytes (default 4)")
    p.add_argument("--lookahead", type=int, default=8,
                   help="batches announced ahead (default 8; 0: LookaheadSampler's own, sized from measured read latency)")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="training compute per batch between the store calls, in ms of one-thread matrix "
                        "products (they release the GIL, as a model's forward and backward do; default 0)")
    p.add_argument("--read-iops", type=int, default=0,
                   help="cap the cold phase's reads at this many per second (a slower disk, through a "
                        "block-I/O cgroup; needs root; default: the disk as it is)")
    p.add_argument("--mem-limit-mib", type=int, default=0,
                   help="cap the cold phase's processes' memory, page cache included, at this many MiB (a "
                        "table far beyond RAM, through a memory cgroup; needs root; default: no cap)")
    p.add_argument("--flushes", type=int, default=40)
    p.add_argument("--flush-frac", type=float, default=0.1)
    p.add_argument("--space-rows", type=int, help="rows of the space test's table (default 200,000; quick 30,000)")
    p.add_argument("--space-hot-frac", type=float, default=0.0,
                   help="space phase: hot tier as a share of the table (default 0: memory mode)")
    p.add_argument("--hogs", type=int, default=0,
                   help="space phase: this many busy-looping processes beside the store (a loaded host)")
    p.add_argument("--get-only", action="store_true",
                   help="the warm, cold and epoch phases only read (evaluation, a frozen table): get, no update")
    p.add_argument("--phases", default="warm,cold,space", help="any of warm,reread,cold,space,epoch,shuffle (reread: warm, timed after one untimed pass "
                        "of the same handle over other rows)")
    p.add_argument("--order", choices=("random", "chunkshuffle"), default="random",
                   help="the ids' order in the warm, reread, cold and epoch phases, the same for every system: "
                        "a uniform permutation (default) or ChunkShuffleSampler's (window --window)")
    p.add_argument("--window", type=int, default=16, help="--order chunkshuffle: chunks shuffled together (default 16)")
    p.add_argument("--store-rev", help="also run the store as committed at this git revision (system "
                   "'store@REV', extracted with git archive; no lookahead), e.g. the one before a change; "
                   "or a folder holding that revision's lightning_embcache/ (where there is no git)")
    p.add_argument("--workdir", help="where the files go (default: a temp dir under /var/tmp, removed after)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def _status_bytes(key: str, pid: int | str = "self") -> int:
    """A byte count of /proc/<pid>/status (VmHWM: peak RSS, VmRSS: RSS now); 0 where unknown.
    (Its own, not the store's: with --store-rev this module runs inside an older package.)"""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _rss_peak() -> int:
    return _status_bytes("VmHWM")


def _children_rss_peak() -> int:
    """Sum of the peak RSS (VmHWM) of this process's children."""
    import psutil

    return sum(_status_bytes("VmHWM", child.pid) for child in psutil.Process().children(recursive=True))


def _rss_now() -> int:
    return _status_bytes("VmRSS")


def drop_cache(paths: list[Path]) -> str:
    """Drop the page cache of ``paths`` (whole cache if permitted); returns the method used."""
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for p in files:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def copy_as_written(src: Path, dst: Path) -> None:
    """Copy a folder with plain reads and large writes, so that its pages sit in the page cache
    as the store's own writes leave them. A ``shutil`` copy (``sendfile``/``copy_file_range``)
    leaves small page-cache folios, and a row read from those costs ~1.5x (1.56-1.88 against
    1.00-1.13 us a row through io_uring on a 2-vCPU EPYC VM); memmap's file is used as written
    for the same reason."""

    def copy(a: str, b: str) -> None:
        with open(a, "rb") as f, open(b, "wb") as g:
            while block := f.read(16 * MiB):
                g.write(block)

    shutil.copytree(src, dst, copy_function=copy)


def warm_cache(paths: list[Path]) -> None:
    for root in paths:
        for p in ([root] if root.is_file() else [q for q in root.rglob("*") if q.is_file()]):
            with open(p, "rb") as f:
                while f.read(16 * MiB):
                    pass


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------
def _setup(cfg: dict) -> dict:
    import numpy as np
    import torch

    from lightning_embcache import EmbeddingStore

    wd = Path(cfg["workdir"])
    n, dim = cfg["rows"], cfg["dim"]
    t0 = time.perf_counter()
    step = 65536
    with EmbeddingStore.create(wd / "store", n, dim) as s:
        for a in range(0, n, step):
            b = min(n, a + step)
            s.update(torch.arange(a, b), torch.from_numpy(_rows(a, b, dim)))
        s.flush()
        s.compact()
        s.flush()
        chunk_rows = s.chunk_rows
    mm = np.lib.format.open_memmap(wd / "table.npy", "w+", np.float32, (n, dim))
    for a in range(0, n, step):
        mm[a : a + step] = _rows(a, min(n, a + step), dim)
    mm.flush()
    del mm
    return {"setup_s": time.perf_counter() - t0, "chunk_rows": chunk_rows}


def _rows(a: int, b: int, dim: int):
    """Rows ``a``..``b`` of the benchmark table: normal floats, as trained rows are (they do not
    compress: a pattern that LZ4 packs would flatter the warm tier and shrink the chunk files)."""
    import numpy as np

    return np.random.default_rng([7, a]).standard_normal((b - a, dim), dtype=np.float32)


def _compute(ms: float):
    """A stand-in for a training step's compute: matrix products for about ``ms`` milliseconds."""
    import torch

    if ms <= 0:
        return lambda: None
    a = torch.randn(256, 256)
    per = float("inf")
    for _ in range(5):  # the fastest of 5 timings of 10 (the first products warm up and run slow)
        t0 = time.perf_counter()
        for _ in range(10):
            a @ a
        per = min(per, (time.perf_counter() - t0) / 10)
    reps = max(1, round(ms / 1e3 / per))

    def run() -> None:
        for _ in range(reps):
            a @ a

    return run


def _loop(cfg: dict) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    wd = Path(cfg["workdir"])
    n, dim, bsz = cfg["rows"], cfg["dim"], cfg["batch"]
    system, phase = cfg["system"], cfg["phase"]
    if cfg.get("order") == "chunkshuffle":  # every system in the same sampler order
        from lightning_embcache.data.chunk_shuffle import ChunkShuffleSampler

        sampler = ChunkShuffleSampler(n, chunk_rows=cfg["chunk_rows"], window=cfg["window"], seed=cfg["seed"])
        perm = np.fromiter(sampler, np.int64, n)
    else:
        perm = np.random.default_rng(cfg["seed"]).permutation(n)
    nb = n // bsz if phase == "epoch" else min(cfg["batches"], n // bsz)
    batches = [perm[i * bsz : (i + 1) * bsz].tolist() for i in range(nb)]
    if system != "memmap":
        import lightning_embcache  # noqa: F401  (the baseline is taken after every import)
    base_rss = _rss_now()
    out: dict = {"system": system, "phase": phase, "load_avg": os.getloadavg()[0]}
    shared = wd
    # Every store run writes its updates; a later run of the shared files would start from
    # another layout (rows in segments rather than chunks, and segments that a compaction must
    # fold first). Each store run gets a copy of the store as set up: cold runs then drop the
    # page cache, warm runs read the copy once. memmap's updates keep its layout: warm runs use
    # the file as written (a copy made with sendfile sits in the page cache in smaller pieces,
    # and memmap ran at half the speed on it: 167K against 336K rows/s).
    if phase == "cold" or system != "memmap":
        wd = shared / f"run-{os.getpid()}"
        wd.mkdir()
        if system == "memmap":
            shutil.copyfile(shared / "table.npy", wd / "table.npy")
        else:
            copy_as_written(shared / "store", wd / "store")
        # The copy's dirty pages go to disk now: left to the timed run, the first sync of the
        # file system there (a compaction round's syncfs) wrote them all (0.16 s of a 2.2 s epoch).
        os.sync()
        if phase == "cold":
            out["drop"] = drop_cache([wd / "store", wd / "table.npy"])
        else:
            warm_cache([wd / "store"])
    get_only = bool(cfg.get("get_only"))
    if system == "memmap":
        mm = np.load(wd / "table.npy", mmap_mode="r" if get_only else "r+")

        def step(ids):
            x = torch.from_numpy(mm[ids])
            if not get_only:
                mm[ids] = (x + 1).numpy()

        flush, stats, close = mm.flush, (lambda: None), (lambda: None)
        order = batches
    else:
        from lightning_embcache import EmbeddingStore

        table = n * dim * 4
        store = EmbeddingStore.open(wd / "store", hot_bytes=int(table / cfg["table_factor"]))

        def step(ids):
            # (the ids as memmap's indexing takes them: one numpy conversion of the list; a
            # torch.tensor of a Python list cost 0.4 us per id, as much as a whole memmap row)
            t = torch.from_numpy(np.asarray(ids))
            x = store.get(t)
            if not get_only:
                store.update(t, x + 1)

        flush, stats, close = store.flush, store.stats, store.close
        if system == "store+lookahead":
            from lightning_embcache import LookaheadSampler

            order = LookaheadSampler(batches, store, lookahead=cfg.get("lookahead_k", cfg["lookahead"]))
        else:
            order = batches
    compute = _compute(cfg.get("step_ms", 0.0))
    if phase == "reread":
        # The handle has read the table once before, untimed (other rows, in another order): a
        # long evaluation, a DataLoader reader's later passes. The store has then opened and
        # verified its chunk files; memmap has mapped its pages.
        again = np.random.default_rng(cfg["seed"] + 1000).permutation(n)
        for i in range(nb):
            step(again[i * bsz : (i + 1) * bsz].tolist())
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    done = 0
    compute_s = 0.0
    stall_at_window = None
    for i, ids in enumerate(order):
        step(ids)
        t1 = time.perf_counter()
        compute()
        compute_s += time.perf_counter() - t1
        done += 1
        if done == cfg["lookahead"] and system != "memmap":  # the window's first fill is behind us
            stall_at_window = getattr(stats(), "stall_seconds", float("nan"))
        if (i + 1) % cfg["flush_every"] == 0:
            flush()
    flush()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    out.update(rows_per_s=done * bsz / wall, wall_s=wall, compute_s=compute_s, cpu_s=cpu, cpu_us_per_row=1e6 * cpu / max(done * bsz, 1),
               batches=done)
    st = stats()
    if st is not None:  # getattr: a --store-rev store may predate some fields
        out.update(stall_ms_per_step=1e3 * getattr(st, "stall_seconds", float("nan")) / max(done, 1),
                   prefetch_hit_rate=getattr(st, "prefetch_hit_rate", float("nan")),
                   bytes_read=st.bytes_read, bytes_written=st.bytes_written,
                   disk_use_ratio=st.disk_bytes / (n * dim * 4))
        if stall_at_window is not None and done > cfg["lookahead"]:
            # steady state: the stall per step after the first `lookahead` batches (at the start
            # the first batch's reads cannot have been made ahead of it)
            out["stall_ms_per_step_steady"] = (1e3 * (getattr(st, "stall_seconds", float("nan")) - stall_at_window)
                                               / (done - cfg["lookahead"]))
    if system != "memmap":
        # the compaction process: its whole peak RSS, and what it held beyond its interpreter
        # (counted against the memory target, as this process's post-import baseline is not)
        out["fold_process_rss_peak_mib"] = _children_rss_peak() / MiB
        if st is not None:
            out["fold_process_rss_over_start_mib"] = getattr(st, "compaction_process_rss_bytes", 0) / MiB
    if system != "memmap":
        # the chunk files' maps (page cache pages, which the kernel reclaims as any cached file
        # page; docs/store.md, "Memory"): in RSS, as memmap's whole table is, but not the store's
        reader = getattr(getattr(store, "_versions", None), "chunkrows", None)
        mapped = getattr(reader, "mapped_resident_bytes", None)
        out["mapped_mib_end"] = mapped() / MiB if mapped is not None else 0.0
    t1 = time.perf_counter()
    close()
    out["close_s"] = time.perf_counter() - t1
    if wd != shared:
        shutil.rmtree(wd, ignore_errors=True)
    out["rss_peak_over_start_mib"] = (_rss_peak() - base_rss) / MiB
    if system != "memmap":
        out["budget_mib"] = n * dim * 4 / cfg["table_factor"] / MiB  # hot; warm is 0 here
        out["rss_allowance_mib"] = 1.1 * out["budget_mib"] + 64  # the target: 1.1 x budgets + 64 MiB
        # with what the compaction process held beyond its interpreter on top
        out["rss_peak_with_process_mib"] = (out["rss_peak_over_start_mib"] - out["mapped_mib_end"]
                                            + out.get("fold_process_rss_over_start_mib", 0.0))
        out["rss_within_target"] = out["rss_peak_with_process_mib"] <= out["rss_allowance_mib"]
    return out


def _space(cfg: dict) -> dict:
    import numpy as np
    import torch

    from lightning_embcache import EmbeddingStore

    wd = Path(cfg["workdir"]) / "space"
    shutil.rmtree(wd, ignore_errors=True)
    n, dim = cfg["space_rows"], cfg["dim"]
    rng = np.random.default_rng(cfg["seed"])
    ratios, flush_s = [], []
    hot = int(cfg.get("space_hot_frac", 0.0) * n * dim * 4) or None
    s = EmbeddingStore.create(wd, n, dim, hot_bytes=hot)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cfg.get("hogs", 0))]
    try:
        gen = torch.Generator().manual_seed(cfg["seed"])
        s.update(torch.arange(n), torch.randn(n, dim, generator=gen))  # as trained rows: they do not compress
        s.flush()
        k = int(n * cfg["flush_frac"])
        # "random": each flush rewrites other rows; "hotset": the same rows every time (a hot set)
        fixed = torch.from_numpy(np.sort(rng.choice(n, k, replace=False))) if cfg.get("pattern") == "hotset" else None
        st0 = s.stats()
        written0 = st0.bytes_written
        # (getattr: --store-rev runs this module inside older packages, which count neither)
        pass0 = getattr(st0, "compaction_bytes_written", 0), getattr(st0, "compaction_folded_bytes", 0)
        t_all = time.perf_counter()
        for i in range(cfg["flushes"]):
            ids = fixed if fixed is not None else torch.from_numpy(np.sort(rng.choice(n, k, replace=False)))
            s.update(ids, torch.randn(k, dim, generator=gen))
            t0 = time.perf_counter()
            s.flush()
            flush_s.append(time.perf_counter() - t0)
            ratios.append(s.stats().disk_use_ratio)
        s._wait_bg()  # background compaction's bytes and time belong to these flushes
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    st = s.stats()
    all_s = time.perf_counter() - t_all
    t0 = time.perf_counter()
    s.close()
    close_s = time.perf_counter() - t0
    table = n * dim * 4
    # bytes on disk: holes punched in segment files excluded (inline: --store-rev runs this module
    # inside older packages)
    disk = sum(min(fs.st_size, fs.st_blocks * 512) for p in wd.rglob("*") if p.is_file() and (fs := p.stat()))
    flushed = cfg["flushes"] * k * dim * 4
    folded = getattr(st, "compaction_folded_bytes", 0) - pass0[1]
    # compaction's own writes (chunk files, chunk maps, manifests) over the bytes of the rows it folded
    per_folded = (getattr(st, "compaction_bytes_written", 0) - pass0[0]) / folded if folded else float("nan")
    return {"phase": "space", "system": "store", "pattern": cfg.get("pattern", "random"),
            "compaction_written_per_folded": per_folded,
            "chunks_folded_in_place": getattr(st, "chunks_folded_in_place", 0),
            "ratio_after_each_flush": ratios, "max_ratio": max(ratios),
            "final_ratio_after_close": disk / table, "close_s": close_s, "flush_s_median": statistics.median(flush_s),
            "flush_s_max": max(flush_s), "written_per_flushed": (st.bytes_written - written0) / flushed,
            "seconds_with_background_work": all_s, "compactions": st.compactions,
            "superseded_segments": getattr(st, "superseded_segments", 0)}


def _shuffle(cfg: dict) -> dict:
    """Cold reads in `ChunkShuffleSampler` order against the disk's sequential read bandwidth.

    In one process, each part on its own copy of the store as set up with the page cache dropped
    first, between two sequential reads (the chunk files read whole in chunk order, 1 MiB reads;
    each part is compared with the mean of the two around it); ``--batches`` batches of
    ``get`` alone in the sampler's order (window 16): the read path the order is for; the same
    with the configuration docs/store.md advises for the sampler (a warm tier of two windows of
    chunks, `LookaheadSampler` ``--lookahead`` batches ahead); the same batches of get + update
    with flushes as in the other phases: a training loop, whose writes (flushes, write-back,
    compaction) the order does not change; and that training loop with the advised
    configuration (``tuned_train``). Figures: bytes of rows got per second over the sequential
    read's bytes per second.
    """
    import numpy as np
    import torch
    from torch.utils.data import BatchSampler

    from lightning_embcache import ChunkShuffleSampler, EmbeddingStore, LookaheadSampler

    torch.set_num_threads(1)
    shared = Path(cfg["workdir"])
    n, dim, bsz = cfg["rows"], cfg["dim"], cfg["batch"]
    out: dict = {"system": "store+chunkshuffle", "phase": "shuffle"}

    def fresh(name: str) -> Path:
        wd = shared / f"shuffle-{os.getpid()}-{name}"
        shutil.copytree(shared / "store", wd)
        out["drop"] = drop_cache([wd])
        return wd

    def sequential() -> tuple[float, int]:
        """The chunk files read whole in chunk order, 1 MiB reads: (bytes/s, bytes)."""
        wd = fresh("seq")
        t0 = time.perf_counter()
        nbytes = 0
        for path in sorted((wd / "chunks").iterdir()):
            with open(path, "rb", buffering=0) as f:
                while block := f.read(MiB):
                    nbytes += len(block)
        seq_s = time.perf_counter() - t0
        shutil.rmtree(wd)
        return nbytes / seq_s, nbytes

    # The disk is shared (other processes' reads move its bandwidth by 2x within a minute): each
    # part is compared with the sequential reads just before and just after it.
    seq = [sequential()]
    out.update(sequential_bytes=seq[0][1])
    table = n * dim * 4
    nb = min(cfg["batches"], n // bsz)
    window = 16
    for part, write, tuned in (("get", False, False), ("tuned_get", False, True), ("", True, False), ("tuned_train", True, True)):
        wd = fresh(part or "train")
        # tuned: what docs/store.md advises with this sampler, a warm tier of two windows of
        # chunks and `LookaheadSampler`, through the public API
        store = EmbeddingStore.open(wd, hot_bytes=int(table / cfg["table_factor"]))
        if tuned:
            store.set_budget(warm_bytes=2 * window * store.chunk_rows * store.row_bytes)
        sampler = ChunkShuffleSampler(n, chunk_rows=store.chunk_rows, window=window, seed=cfg["seed"])
        batches = BatchSampler(sampler, bsz, drop_last=True)
        if tuned:
            batches = LookaheadSampler(batches, store, lookahead=cfg.get("lookahead_k", cfg["lookahead"]))
        t0 = time.perf_counter()
        cpu0 = time.process_time()  # this process's CPU, all threads: what a busy host leaves wall time
        for i, batch in enumerate(batches):
            if i == nb:
                break
            # a batch's ids as a tensor the way a collate would build it cheaply (numpy: 6 us for
            # 512 ids; torch.as_tensor of a list of ints: 48 us, a fifth of a tuned get)
            ids = torch.from_numpy(np.asarray(batch, dtype=np.int64))
            x = store.get(ids)
            if write:
                store.update(ids, x + 1)
                if (i + 1) % cfg["flush_every"] == 0:
                    store.flush()
        store.flush()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        st = store.stats()
        store.close()
        shutil.rmtree(wd)
        seq.append(sequential())
        seq_bps = (seq[-2][0] + seq[-1][0]) / 2
        rows = nb * bsz
        key = f"{part}_" if part else ""
        out.update({f"{key}rows_per_s": rows / wall, f"{key}wall_s": wall, f"{key}store_mib_s": rows * dim * 4 / wall / MiB,
                    f"{key}vs_sequential": (rows * dim * 4 / wall) / seq_bps,
                    f"{key}sequential_mib_s": seq_bps / MiB,
                    f"{key}cpu_us_per_row": 1e6 * cpu / rows,
                    # time gets waited for reads below the hot tier, and chunks read ahead whole
                    f"{key}stall_s": st.stall_seconds,
                    f"{key}chunks_read_ahead": getattr(st, "chunks_read_ahead", 0)})
    out["sequential_mib_s_each"] = [b / MiB for b, _ in seq]
    out["sequential_mib_s"] = statistics.median(out["sequential_mib_s_each"])
    return out


def _run_worker(cfg: dict) -> dict:
    fn = {"setup": _setup, "space": _space, "shuffle": _shuffle}.get(cfg["phase"], _loop)
    return fn(cfg)


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def _spawn(cfg: dict, tree: Path | None = None, cgroups: tuple[Path, ...] = ()) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree is not None:  # the package of another revision, with this benchmark module in it
        # first on the path; other entries stay (where dependencies were installed with --target),
        # except the one holding this package (the revision under test would be shadowed)
        here = Path(__file__).resolve().parents[1]
        keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != here]
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *keep])
    enter = None
    if cgroups:
        from .slowdisk import enter as enter_cgroups

        def enter() -> None:
            enter_cgroups(*cgroups)
    r = subprocess.run([sys.executable, "-m", "benchmarks.disk", "--worker", json.dumps(cfg)],
                       capture_output=True, text=True, env=env, timeout=900, cwd=str(tree) if tree else None,
                       preexec_fn=enter)
    if r.returncode != 0:
        raise RuntimeError(f"worker {cfg.get('system')}/{cfg['phase']} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(_run_worker(json.loads(args.worker))))
        return 0
    q = args.quick
    cfg = {
        "rows": args.rows or (60_000 if q else 500_000), "dim": args.dim, "batch": args.batch,
        "batches": args.batches or (60 if q else 300), "flush_every": args.flush_every,
        "table_factor": args.table_factor, "lookahead": args.lookahead or 8, "lookahead_k": args.lookahead or None,
        "flushes": args.flushes,
        "step_ms": args.step_ms, "get_only": args.get_only, "read_iops": args.read_iops, "mem_limit_mib": args.mem_limit_mib,
        "flush_frac": args.flush_frac, "space_rows": args.space_rows or (30_000 if q else 200_000), "seed": 0,
        "space_hot_frac": args.space_hot_frac, "hogs": args.hogs, "order": args.order, "window": args.window,
    }
    reps = args.reps or (1 if q else 3)
    phases = args.phases.split(",")
    own = args.workdir is None
    wd = Path(args.workdir or tempfile.mkdtemp(prefix="embcache-bench-disk-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    wd.mkdir(parents=True, exist_ok=True)
    cfg["workdir"] = str(wd)
    slow: tuple[Path, ...] = ()
    if args.read_iops:
        from .slowdisk import throttled_cgroup

        slow += (throttled_cgroup(wd, args.read_iops),)
    if args.mem_limit_mib:
        from .slowdisk import memory_cgroup

        slow += (memory_cgroup(args.mem_limit_mib * MiB),)
    runs: list[dict] = []
    try:
        print(f"setup: {cfg['rows']} x {cfg['dim']} rows ({cfg['rows'] * cfg['dim'] * 4 / MiB:.0f} MiB) in {wd}", flush=True)
        cfg["chunk_rows"] = _spawn(dict(cfg, phase="setup"))["chunk_rows"]
        systems = ["memmap", "store", "store+lookahead"]
        trees: dict[str, Path] = {}
        if args.store_rev:
            given = Path(args.store_rev)
            if (given / "lightning_embcache").is_dir():  # an extracted tree (a machine without git)
                rev = given.resolve().name
                tree = wd / f"rev-{rev}"
                shutil.copytree(given / "lightning_embcache", tree / "lightning_embcache", dirs_exist_ok=True)
            else:
                rev = subprocess.run(["git", "rev-parse", "--short", args.store_rev], capture_output=True, text=True,
                                     check=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
                tree = wd / f"rev-{rev}"
                tree.mkdir(exist_ok=True)
                archive = subprocess.run(["git", "archive", rev, "lightning_embcache"], capture_output=True, check=True,
                                         cwd=Path(__file__).resolve().parents[1]).stdout
                subprocess.run(["tar", "x", "-C", str(tree)], input=archive, check=True)
            # this benchmark's code, whatever that revision had
            shutil.copytree(Path(__file__).parent, tree / "benchmarks", dirs_exist_ok=True)
            trees[f"store@{rev}"] = tree
            systems.append(f"store@{rev}")
            # that revision writes (and reads) its own format: its own copy of the table
            (tree / "data").mkdir(exist_ok=True)
            _spawn(dict(cfg, phase="setup", workdir=str(tree / "data")), tree)
        for rep in range(reps):
            for phase in ("warm", "reread", "cold", "epoch"):
                if phase not in phases:
                    continue
                order = systems
                for k in range(len(order)):
                    system = order[(k + rep) % len(order)]
                    if phase in ("warm", "reread", "epoch"):
                        warm_cache([wd / "store", wd / "table.npy"] + [t / "data" / "store" for t in trees.values()])
                    tree = trees.get(system)
                    res = _spawn(dict(cfg, phase=phase, system=system.split("@")[0], seed=rep + 1,
                                      workdir=str(tree / "data") if tree else cfg["workdir"]), tree,
                                 slow if phase == "cold" else ())
                    res["system"] = system
                    res["rep"] = rep
                    runs.append(res)
                    print(f"  rep {rep} {phase:5s} {system:16s} {res['rows_per_s']:10.0f} rows/s  "
                          f"CPU {res['cpu_us_per_row']:.2f} us/row  "
                          f"stall {res.get('stall_ms_per_step', 0):.2f} ms/step "
                          f"(after {cfg['lookahead']}: {res.get('stall_ms_per_step_steady', 0):.2f})  close {res['close_s']:.2f} s  "
                          f"RSS +{res['rss_peak_over_start_mib']:.0f} MiB"
                          + (f" (maps {res['mapped_mib_end']:.0f})" if res.get("mapped_mib_end") else ""), flush=True)
        for rep in range(reps if "shuffle" in phases else 0):
            # with --store-rev, that revision's store runs the same parts in the same repetition,
            # the two alternating which goes first
            order = ["store"] + list(trees)
            for k in range(len(order)):
                system = order[(k + rep) % len(order)]
                tree = trees.get(system)
                res = _spawn(dict(cfg, phase="shuffle", seed=rep + 1,
                                  workdir=str(tree / "data") if tree else cfg["workdir"]), tree)
                res["rep"] = rep
                res["system"] = "store+chunkshuffle" + (system[len("store"):] if tree else "")
                runs.append(res)
                print(f"  rep {rep} shuffle {res['system']}: sequential read {res['sequential_mib_s']:.0f} MiB/s "
                      f"(around the tuned get {res['tuned_get_sequential_mib_s']:.0f}); store in "
                  f"ChunkShuffleSampler order: get {res['get_store_mib_s']:.0f} MiB/s ({res['get_rows_per_s']:.0f} "
                  f"rows/s) = {res['get_vs_sequential']:.2f}x; get with a warm tier and lookahead "
                  f"{res['tuned_get_store_mib_s']:.0f} MiB/s ({res['tuned_get_rows_per_s']:.0f} rows/s) = "
                      f"{res['tuned_get_vs_sequential']:.2f}x; get + update {res['store_mib_s']:.0f} MiB/s "
                      f"({res['rows_per_s']:.0f} rows/s) = {res['vs_sequential']:.2f}x; get + update with a "
                      f"warm tier and lookahead {res.get('tuned_train_store_mib_s', float('nan')):.0f} MiB/s = "
                      f"{res.get('tuned_train_vs_sequential', float('nan')):.2f}x; CPU us/row "
                      f"{res['get_cpu_us_per_row']:.2f} / {res['tuned_get_cpu_us_per_row']:.2f} / "
                      f"{res['cpu_us_per_row']:.2f} / {res.get('tuned_train_cpu_us_per_row', float('nan')):.2f}; "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
        for rep in range(reps if "space" in phases else 0):
            # a fresh store per run (with --store-rev, that revision's too), flushes of other rows
            # each time and of the same rows each time
            for pattern in ("random", "hotset"):
                for system in ["store"] + list(trees):
                    tree = trees.get(system)
                    res = _spawn(dict(cfg, phase="space", pattern=pattern,
                                      workdir=str(tree / "data") if tree else cfg["workdir"]), tree)
                    res.update(system=system, rep=rep)
                    runs.append(res)
                    print(f"  rep {rep} space {pattern:6s} {system:14s}: max disk/table {res['max_ratio']:.2f}x over "
                          f"{cfg['flushes']} flushes of {cfg['flush_frac']:.0%}; after close "
                          f"{res['final_ratio_after_close']:.2f}x; close {res['close_s']:.2f} s; written "
                          f"{res.get('written_per_flushed', float('nan')):.2f}x the flushed bytes (compaction "
                          f"{res.get('compaction_written_per_folded', float('nan')):.2f}x the rows it folded) in "
                          f"{res.get('seconds_with_background_work', float('nan')):.2f} s", flush=True)
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)
    summary: dict = {}
    for phase in ("warm", "reread", "cold", "epoch"):
        for system in ["memmap", "store", "store+lookahead"] + [s for s in {r.get("system") for r in runs}
                                                                  if s and "@" in s]:
            rs = [r for r in runs if r.get("phase") == phase and r.get("system") == system]
            if rs:
                summary[f"{phase}/{system}"] = {k: statistics.median([r[k] for r in rs if k in r])
                                                for k in ("rows_per_s", "cpu_us_per_row", "stall_ms_per_step",
                                                          "stall_ms_per_step_steady",
                                                          "prefetch_hit_rate", "close_s", "rss_peak_over_start_mib",
                                                          "fold_process_rss_peak_mib", "fold_process_rss_over_start_mib",
                                                          "rss_peak_with_process_mib",
                                                          "rss_allowance_mib") if any(k in r for r in rs)}
                rss = [r.get("rss_peak_with_process_mib", r["rss_peak_over_start_mib"]) for r in rs if "rss_allowance_mib" in r]
                if rss:  # the memory target holds for the worst repetition, not the median
                    summary[f"{phase}/{system}"]["rss_peak_max_mib"] = max(rss)
        mm = summary.get(f"{phase}/memmap", {}).get("rows_per_s")
        for system in [k.split("/", 1)[1] for k in summary if k.startswith(phase + "/store")]:
            key = f"{phase}/{system}"
            if mm and key in summary:
                summary[key]["vs_memmap"] = summary[key]["rows_per_s"] / mm
            # the same ratios within each repetition (neighbouring runs share the host's load)
            for ref, name in (("memmap", "vs_memmap_per_rep"), ("store", "vs_store_per_rep")):
                if system == ref:
                    continue
                pairs = [(r["rows_per_s"], q["rows_per_s"]) for r in runs for q in runs
                         if r.get("phase") == phase == q.get("phase") and r.get("rep") == q.get("rep")
                         and r.get("system") == system and q.get("system") == ref]
                if pairs:
                    ratios = [a / b for a, b in pairs]
                    summary[key][name] = statistics.median(ratios)
                    summary[key][name + "_all"] = ratios
    shuffled = [r for r in runs if r.get("phase") == "shuffle"]
    for system in sorted({r["system"] for r in shuffled}):
        rs = [r for r in shuffled if r["system"] == system]
        keys = ("sequential_mib_s", "get_vs_sequential", "tuned_get_vs_sequential", "vs_sequential",
                "get_store_mib_s", "tuned_get_store_mib_s", "store_mib_s", "get_cpu_us_per_row",
                "tuned_get_cpu_us_per_row", "cpu_us_per_row", "tuned_get_sequential_mib_s",
                "tuned_train_vs_sequential", "tuned_train_store_mib_s", "tuned_train_cpu_us_per_row")
        keys = tuple(k for k in keys if all(k in r for r in rs))  # a --store-rev run may predate some
        summary[f"shuffle/{system}"] = {k: statistics.median([r[k] for r in rs]) for k in keys}
        summary[f"shuffle/{system}"].update({f"{k}_all": [r[k] for r in rs] for k in keys})
        if system != "store+chunkshuffle":  # the current store against this revision, per repetition
            for k in ("get_rows_per_s", "tuned_get_rows_per_s", "rows_per_s", "tuned_train_rows_per_s"):
                ratios = [q[k] / r[k] for r in rs for q in shuffled
                          if q["system"] == "store+chunkshuffle" and q["rep"] == r["rep"] and k in q and k in r]
                summary[f"shuffle/{system}"][f"current_vs_this_{k}_all"] = ratios
    for r in runs:
        if r.get("phase") == "space":
            key = f"space-{r['pattern']}/{r['system']}"
            keys = ("max_ratio", "final_ratio_after_close", "close_s", "written_per_flushed",
                    "compaction_written_per_folded", "seconds_with_background_work", "flush_s_median",
                    "flush_s_max")
            rs = [q for q in runs if q.get("phase") == "space" and f"space-{q['pattern']}/{q['system']}" == key]
            keys = tuple(k for k in keys if all(k in q for q in rs))  # a --store-rev run may predate some
            summary[key] = {k: statistics.median([q[k] for q in rs]) for k in keys}
            summary[key].update({f"{k}_all": [q[k] for q in rs] for k in ("max_ratio", "written_per_flushed",
                                                                          "compaction_written_per_folded",
                                                                          "seconds_with_background_work")
                                 if k in keys})
    print(json.dumps(summary, indent=1))
    result = {"command": "embcache bench disk " + " ".join(argv if argv is not None else sys.argv[1:]),
              "config": cfg, "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                      "load_avg": os.getloadavg()},
              "summary": summary, "runs": runs, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
