"""One system, one table mode, in its own process (so peak RSS is that system's alone).

    python benchmarks/store_worker.py run CONFIG.json OUT.json
    python benchmarks/store_worker.py setup CONFIG.json OUT.json

Run as a script, it registers a bare ``lightning_embcache`` package (no ``__init__``), so a
worker imports only what it measures: torch/numpy, and for the store only
``lightning_embcache.store`` (the engine), not the Lightning layer that the package facade
imports. The facade's own import cost is measured separately (``import-cost``).

``setup`` creates the on-disk files a system needs (memmap file, naive chunk files, a populated
store); ``run`` opens the system, runs every workload in ``config["workloads"]`` order and writes
per-batch medians, flush figures, I/O counters and RSS to OUT.json. The orchestrator is
:mod:`benchmarks.store`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

MiB = 1 << 20
_PKG_DIR = Path(__file__).resolve().parents[1] / "lightning_embcache"


def _bare_package(pkg_dir: Path = _PKG_DIR) -> None:
    """Make ``lightning_embcache.<sub>`` importable without running the package ``__init__``.

    ``pkg_dir`` may be another copy of the package (``--store-rev``: a ``git archive`` of a commit)."""
    if "lightning_embcache" in sys.modules:
        return
    import types

    pkg = types.ModuleType("lightning_embcache")
    pkg.__path__ = [str(pkg_dir)]
    pkg.__file__ = str(pkg_dir / "__init__.py")
    pkg.__package__ = "lightning_embcache"
    sys.modules["lightning_embcache"] = pkg


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_peak() -> int:
    """Peak RSS of this process image: VmHWM (per mm, reset by exec). Not ru_maxrss: Linux carries
    the forking parent's high-water mark into it across fork+exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def _mem() -> dict:
    """RSS split (anon / file), high-water mark and huge pages now, in MiB."""
    out = {k: _status_kib(k) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    out["AnonHugePages"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def _io(which: str = "self") -> dict:
    """/proc/<self|thread-self>/io counters. ``thread-self``: this (the calling) thread only, so a
    store's background compaction does not count against its flush."""
    out = {}
    try:
        with open(f"/proc/{which}/io") as f:
            for line in f:
                k, v = line.split(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def _io_delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in ("wchar", "write_bytes", "rchar", "read_bytes")}


def _summary(times_ns: list[int], rows_per_batch: float) -> dict:
    if not times_ns:
        return {"n": 0}
    ms = sorted(t / 1e6 for t in times_ns)
    med = statistics.median(ms)
    q = lambda p: ms[min(len(ms) - 1, int(p * (len(ms) - 1) + 0.5))]  # noqa: E731
    return {
        "n": len(ms),
        "median_ms": med,
        "p10_ms": q(0.10),
        "p90_ms": q(0.90),
        "mean_ms": statistics.fmean(ms),
        "rows_per_s": rows_per_batch / (med / 1e3) if med > 0 else math.inf,
    }


# --------------------------------------------------------------------------------------------
# id sources
# --------------------------------------------------------------------------------------------
class EpochIds:
    """A random permutation of all ids, consumed in consecutive batches (a new one at wrap)."""

    def __init__(self, num_rows: int, batch: int, seed: int):
        import torch

        self.torch = torch
        self.n, self.batch = num_rows, batch
        self.g = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(num_rows, generator=self.g, dtype=torch.int32)
        self.pos = 0
        self.wraps = 0

    def next(self):
        from benchmarks.store_systems import Batch

        if self.pos + self.batch > self.n:
            self.perm = self.torch.randperm(self.n, generator=self.g, dtype=self.torch.int32)
            self.pos = 0
            self.wraps += 1
        ids = self.perm[self.pos : self.pos + self.batch]
        self.pos += self.batch
        return Batch.of(ids)


class ZipfIds:
    """Bounded Zipf(a) over ranks 1..N (exact inverse-CDF sampling), ranks scattered over the
    id space by an affine bijection so hot ids are not neighbours."""

    def __init__(self, num_rows: int, batch: int, seed: int, a: float):
        import numpy as np

        self.np = np
        self.n, self.batch = num_rows, batch
        w = np.arange(1, num_rows + 1, dtype=np.float64)
        np.power(w, -a, out=w)
        np.cumsum(w, out=w)
        w /= w[-1]
        self.cdf = w
        self.rng = np.random.default_rng(seed)
        mult = 2654435761 % num_rows or 1
        while math.gcd(mult, num_rows) != 1:
            mult += 1
        self.mult, self.off = mult, (seed * 7919) % num_rows

    def next(self):
        import torch

        from benchmarks.store_systems import Batch

        ranks = self.np.searchsorted(self.cdf, self.rng.random(self.batch), side="right")
        ranks = self.np.minimum(ranks, self.n - 1).astype(self.np.int64)
        ids = (ranks * self.mult + self.off) % self.n
        return Batch.of(torch.from_numpy(ids))


def make_ids(workload: str, num_rows: int, batch: int, seed: int, zipf_a: float):
    if workload == "epoch":
        return EpochIds(num_rows, batch, seed)
    if workload == "zipf":
        return ZipfIds(num_rows, batch, seed, zipf_a)
    raise ValueError(f"unknown workload {workload!r}")


# --------------------------------------------------------------------------------------------
# setup
# --------------------------------------------------------------------------------------------
def setup(cfg: dict) -> dict:
    """Create the data files of every item in ``cfg["items"]`` (one failure does not stop the rest).

    With ``cfg["import_cost"]`` first measure the import cost (this process is still fresh)."""
    cost = None
    if cfg.get("import_cost"):
        try:
            cost = import_cost(cfg)
        except Exception as exc:
            cost = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out = {}
    for item in cfg["items"]:
        key = f"{item['mode']}/{item['system']}"
        try:
            out[key] = _setup_one(item)
        except Exception as exc:
            out[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    return {"ok": True, "items": out, "import_cost": cost}


def _setup_one(cfg: dict) -> dict:
    from benchmarks import store_systems as S

    system, n, dim = cfg["system"], cfg["num_rows"], cfg["dim"]
    block = S.random_block(dim, cfg["data_seed"])
    path = Path(cfg["path"])
    t0 = time.perf_counter()
    extra = {}
    if system == "memmap":
        path.parent.mkdir(parents=True, exist_ok=True)
        S.create_memmap_file(path, n, dim, block)
    elif system == "naive":
        S.create_naive_files(path, n, dim, cfg["chunk_rows"], block)
    elif system == "store":
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = S.create_store(path, n, dim, cfg["chunk_rows"], cfg["hot_bytes"], cfg["warm_bytes"], block)
    else:
        raise ValueError(system)
    return {"ok": True, "seconds": time.perf_counter() - t0, **extra}


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------
def _open(cfg: dict, block):
    from benchmarks import store_systems as S

    system, n, dim = cfg["system"], cfg["num_rows"], cfg["dim"]
    if system == "torch":
        return S.TorchTable(n, dim, block)
    if system == "numpy":
        return S.NumpyTable(n, dim, block)
    if system == "torch_thp":
        return S.THPTable(n, dim, block)
    if system == "memmap":
        return S.MemmapTable(Path(cfg["path"]), n, dim)
    if system == "naive":
        return S.NaiveChunkStore(Path(cfg["path"]), n, dim, cfg["chunk_rows"], preload=cfg["mode"] == "ram")
    if system == "store":
        return S.StoreSystem(Path(cfg["path"]), cfg["hot_bytes"], cfg["warm_bytes"])
    raise ValueError(system)


def _warm_pass(sys_obj, cfg: dict) -> float:
    """In-RAM mode only: touch the whole table once (memmap pages, store hot tier)."""
    import numpy as np

    t0 = time.perf_counter()
    n = cfg["num_rows"]
    if cfg["system"] == "memmap":
        step = 1 << 16
        for s in range(0, n, step):
            np.add.reduce(sys_obj.table[s : s + step], axis=None)
    elif cfg["system"] == "store":
        sys_obj.prefetch_all(n)
    return time.perf_counter() - t0


def _flush(sys_obj, errors: list) -> bool:
    """flush(); on an exception record it and retry (up to 3 tries). Returns whether it retried.

    A failed store flush leaves its rows dirty, so a retry is a correct continuation; the errors
    are reported in the results (``flush_errors``), never hidden."""
    for attempt in range(3):
        try:
            sys_obj.flush()
            return attempt > 0
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            if attempt == 2:
                raise
            time.sleep(0.05)
    return True


def _run_workload(sys_obj, cfg: dict, workload: str, vals_t, vals_np) -> dict:
    import torch

    batch, row_bytes = cfg["batch"], cfg["dim"] * 4
    src = make_ids(workload, cfg["num_rows"], batch, cfg["seed"], cfg["zipf_a"])
    is_np = cfg["system"] in ("numpy", "memmap")
    vals = vals_np if is_np else vals_t
    out: dict = {}
    flush_errors: list = []
    out["flush_errors"] = flush_errors
    clock = time.perf_counter_ns

    # warm-up: the same get+update steps, untimed
    t_w = time.perf_counter()
    for _ in range(cfg["warmup_batches"]):
        b = src.next()
        r = sys_obj.get(b)
        r += 0.001
        sys_obj.update(b, r)
        if time.perf_counter() - t_w > cfg["time_cap_s"] / 3:
            break
    out["warmup_s"] = time.perf_counter() - t_w
    if sys_obj.durable and cfg["system"] != "naive":
        t0 = time.perf_counter()
        _flush(sys_obj, flush_errors)
        out["flush_after_warmup_s"] = time.perf_counter() - t0

    profiler = None
    if cfg.get("profile"):
        import cProfile

        profiler = cProfile.Profile()

    t_get, t_upd, t_gu = [], [], []
    rows_updated = 0
    io0 = _io()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    for i in range(cfg["batches"]):
        b = src.next()
        t0 = clock()
        r = sys_obj.get(b)
        t_get.append(clock() - t0)

        b = src.next()
        t0 = clock()
        sys_obj.update(b, vals)
        t_upd.append(clock() - t0)

        b = src.next()
        t0 = clock()
        r = sys_obj.get(b)
        t1 = clock()
        r += 0.001  # the "training step", untimed
        t2 = clock()
        sys_obj.update(b, r)
        t3 = clock()
        t_gu.append((t1 - t0) + (t3 - t2))
        rows_updated += 2 * batch
        if i + 1 >= cfg["min_batches"] and time.perf_counter() - start > cfg["time_cap_s"]:
            break
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start
    # page faults in the timed loop: allocator churn (a freed block returned to the kernel and
    # faulted in again) shows up here, not in the loop's Python profile
    out["minor_faults_per_batch"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / max(1, len(t_gu))
    io1 = _io()
    out["phases"] = {
        "get": _summary(t_get, batch),
        "update": _summary(t_upd, batch),
        "get_update": _summary(t_gu, batch),
    }
    out["timed_loop_s"] = elapsed
    upd_io = _io_delta(io0, io1)
    upd_io["rows_updated"] = rows_updated
    upd_io["wchar_per_updated_byte"] = upd_io["wchar"] / (rows_updated * row_bytes)
    out["update_io"] = upd_io
    if profiler:
        import io as _io_mod
        import pstats

        s = _io_mod.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(cfg.get("profile_top", 30))
        out["profile_tottime"] = s.getvalue()
        s = _io_mod.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("cumulative").print_stats(cfg.get("profile_top", 30))
        out["profile_cumulative"] = s.getvalue()

    # flush: k dirty rows -> bytes written and seconds
    rounds = cfg["flush_rounds"] if (sys_obj.durable and cfg["system"] != "naive") else 0
    out["mem_before_flush"] = _mem()
    if sys_obj.durable and cfg["system"] != "naive":
        before = sys_obj.stats().get("dirty_rows") if cfg["system"] == "store" else None
        io_a = _io()
        t0 = time.perf_counter()
        _flush(sys_obj, flush_errors)
        out["flush_after_loop"] = {
            "seconds": time.perf_counter() - t0,
            "dirty_rows_before": before,
            **_io_delta(io_a, _io()),
        }
        out["mem_after_flush"] = _mem()
    flushes = []
    for _ in range(rounds):
        st0 = sys_obj.stats() if cfg["system"] == "store" else {}
        io_a, tio_a = _io(), _io("thread-self")
        touched = []
        for _ in range(cfg["flush_batches"]):
            b = src.next()
            sys_obj.update(b, vals)
            touched.append(b.ids)
        dirty_rows = int(torch.unique(torch.cat(touched)).numel())
        tio_b = _io("thread-self")
        t0 = time.perf_counter()
        retried = _flush(sys_obj, flush_errors)
        secs = time.perf_counter() - t0
        io_c, tio_c = _io(), _io("thread-self")
        st1 = sys_obj.stats() if cfg["system"] == "store" else {}
        # The window is updates + flush, in the calling thread: memmap pages are accounted when
        # dirtied, and a store's write-back of evicted dirty rows happens during updates.
        win = _io_delta(tio_a, tio_c)
        proc = _io_delta(io_a, io_c)
        rec = {
            "seconds": secs,
            "dirty_rows": dirty_rows,
            "dirty_bytes": dirty_rows * row_bytes,
            "wchar": win["wchar"],
            "write_bytes": win["write_bytes"],
            "flush_only_wchar": _io_delta(tio_b, tio_c)["wchar"],
            "process_wchar": proc["wchar"],  # all threads: includes background compaction
            "process_write_bytes": proc["write_bytes"],
            "retried_after_error": retried,
        }
        if cfg["system"] == "store" and "bytes_written" in st0 and "bytes_written" in st1:
            rec["store_bytes_written"] = st1["bytes_written"] - st0["bytes_written"]  # all threads
        rec["bytes_written"] = max(rec["wchar"], rec["write_bytes"])
        rec["written_per_dirty"] = rec["bytes_written"] / rec["dirty_bytes"]
        rec["process_written_per_dirty"] = max(proc["wchar"], proc["write_bytes"]) / rec["dirty_bytes"]
        rec["dirty_mb_per_s"] = rec["dirty_bytes"] / MiB / secs if secs > 0 else None
        flushes.append(rec)
    if flushes:
        out["flush"] = {
            "rounds": flushes,
            "median_seconds": statistics.median(f["seconds"] for f in flushes),
            "median_written_per_dirty": statistics.median(f["written_per_dirty"] for f in flushes),
            "max_bytes_written": max(f["bytes_written"] for f in flushes),
            "median_dirty_bytes": statistics.median(f["dirty_bytes"] for f in flushes),
            "worst_excess_bytes": max(f["bytes_written"] - 2 * f["dirty_bytes"] for f in flushes),
        }
    out["mem_end"] = _mem()
    out["rss_end_mib"] = _rss_now() / MiB
    out["peak_rss_so_far_mib"] = _rss_peak() / MiB
    if cfg["system"] == "store":
        out["store_stats"] = sys_obj.stats()
    return out


def _full_pass(sys_obj, cfg: dict) -> dict:
    """One sequential epoch over the whole table in large batches: get, nudge, update every row,
    then flush. In disk mode this cycles the whole 4x-budget table through the tiers with every
    row dirty, so the peak RSS reflects full tiers plus write-back and flush (the RSS target)."""
    import torch

    step, n = cfg.get("full_pass_rows", 4096), cfg["num_rows"]
    mem0 = _mem()
    t0 = time.perf_counter()
    done = 0
    errors: list = []
    from benchmarks.store_systems import Batch

    for start in range(0, n, step):
        b = Batch.of(torch.arange(start, min(n, start + step)))
        r = sys_obj.get(b)
        r += 0.001
        sys_obj.update(b, r)
        done += len(b.ids)
        if time.perf_counter() - t0 > cfg.get("full_pass_cap_s", 90):
            break
    t_loop = time.perf_counter() - t0
    mem_before_flush = _mem()
    t1 = time.perf_counter()
    if sys_obj.durable and cfg["system"] != "naive":
        _flush(sys_obj, errors)
    t_flush = time.perf_counter() - t1
    return {
        "rows": done,
        "complete": done == n,
        "loop_s": t_loop,
        "rows_per_s": done / t_loop if t_loop > 0 else None,
        "flush_s": t_flush,
        "mem_before": mem0,
        "mem_before_flush": mem_before_flush,
        "mem_after": _mem(),
        "flush_errors": errors,
        "store_stats": sys_obj.stats() if cfg["system"] == "store" else None,
    }


def run(cfg: dict) -> dict:
    import numpy as np
    import torch

    from benchmarks import store_systems as S

    res: dict = {"system": cfg["system"], "mode": cfg["mode"], "workloads": {}, "rss_isolated": True}
    res["rss_after_import_mib"] = _rss_now() / MiB
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    res["torch_threads"] = torch.get_num_threads()
    block = S.random_block(cfg["dim"], cfg["data_seed"])
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    vals_t = torch.randn(cfg["batch"], cfg["dim"], generator=g)
    vals_np = vals_t.numpy()
    if cfg["system"] in ("memmap", "naive", "store") and cfg["mode"] == "disk" and cfg.get("drop_cache"):
        res["cache_dropped_files"] = S.drop_file_cache(Path(cfg["path"]).parent if cfg["system"] == "memmap" else Path(cfg["path"]))
    res["rss_before_open_mib"] = _rss_now() / MiB
    t0 = time.perf_counter()
    sys_obj = _open(cfg, block)
    del block
    res["open_s"] = time.perf_counter() - t0
    res["rss_after_open_mib"] = _rss_now() / MiB
    if cfg["mode"] == "ram":
        res["warm_pass_s"] = _warm_pass(sys_obj, cfg)
    try:
        for k, workload in enumerate(cfg["workloads"]):
            if k > 0 and cfg["system"] == "store" and cfg["mode"] == "disk":
                # fresh cache state per workload: close and reopen (in-RAM mode keeps the resident table)
                sys_obj.close()
                sys_obj = _open(cfg, None)
                if cfg["mode"] == "ram":
                    _warm_pass(sys_obj, cfg)
            res["workloads"][workload] = _run_workload(sys_obj, cfg, workload, vals_t, vals_np)
        if cfg.get("full_pass"):
            res["full_pass"] = _full_pass(sys_obj, cfg)
        res["info"] = sys_obj.info()
        res["peak_rss_mib"] = _rss_peak() / MiB
        if cfg["system"] == "store":
            # untimed, after the peak is read: leave the store at rest (segments folded into base
            # chunks and published), so that the next repetition does not start by compacting
            # this one's flushes in the background of its timed loop
            t0 = time.perf_counter()
            sys_obj.store.compact()
            sys_obj.store.flush()
            res["rest_s"] = time.perf_counter() - t0
    finally:
        sys_obj.close()
    res.setdefault("peak_rss_mib", _rss_peak() / MiB)
    res["anon_huge_kib_end"] = S.smaps_anon_huge_kb()
    res["ru_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res["ok"] = True
    del np
    return res


def run_many(cfg: dict) -> dict:
    """Several systems one after another in this one process (``--quick``: fewer interpreter
    start-ups; peak RSS is then not per system)."""
    out = {}
    made = setup({"items": cfg.get("setup_items", [])})["items"] if cfg.get("setup_items") else {}
    for item in cfg["items"]:
        key = f"{item['mode']}/{item['system']}"
        if key in made and not made[key].get("ok"):
            out[item["system"]] = {"ok": False, "error": "setup failed: " + str(made[key].get("error"))}
            continue
        try:
            out[item["system"]] = run(item)
        except Exception as exc:
            out[item["system"]] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                   "traceback": traceback.format_exc()}
        out[item["system"]]["rss_isolated"] = False
    return {"ok": True, "items": out, "setup": made}


def import_cost(cfg: dict) -> dict:
    """RSS and seconds of ``import torch`` and then of the full ``import lightning_embcache``."""
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    rss_torch = _rss_now()
    sys.modules.pop("lightning_embcache", None)  # drop the bare package: import the real facade
    import lightning_embcache  # noqa: F401

    t2 = time.perf_counter()
    return {"ok": True, "torch_s": t1 - t0, "torch_rss_mib": rss_torch / MiB,
            "facade_extra_s": t2 - t1, "facade_rss_mib": _rss_now() / MiB,
            "heavy_modules": sorted(m for m in ("lightning", "pytorch_lightning", "torchmetrics")
                                    if m in sys.modules)}


def main(argv: list[str]) -> int:
    cmd, cfg_path, out_path = argv
    cfg = json.loads(Path(cfg_path).read_text())
    try:
        res = {"setup": setup, "run": run, "run-many": run_many, "import-cost": import_cost}[cmd](cfg)
    except BaseException as exc:  # report, never hang the orchestrator
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        res["peak_rss_mib"] = _rss_peak() / MiB
    Path(out_path).write_text(json.dumps(res, default=repr))
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    _cfg = json.loads(Path(sys.argv[2]).read_text()) if len(sys.argv) > 2 else {}
    _pkg = Path(_cfg.get("pkg_dir") or _PKG_DIR)
    sys.path[0] = str(_pkg.parent)  # the package's root, not this folder
    _bare_package(_pkg)
    sys.exit(main(sys.argv[1:]))
