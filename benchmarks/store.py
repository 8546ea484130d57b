"""`embcache bench store`: the EmbeddingStore against the bare bounds and the naive design.

Workloads (ids in batches of ``--batch`` = 512, rows of ``--dim`` = 128 float32):

* ``epoch``: a random permutation of all ids, consumed batch after batch (one training epoch);
* ``zipf``: ids drawn from a bounded Zipf(a = 1.1) over ranks, ranks scattered over the id space.

Table modes:

* ``ram``:  N = 1M rows (512 MiB), the whole table resident (store: ``hot_bytes=None``);
* ``disk``: a table 4x larger than the store's ``hot_bytes + warm_bytes`` budget (default
  192 + 64 MiB budget, 2M rows = 1 GiB table); the page cache of our own files is dropped
  (``posix_fadvise(DONTNEED)``) before each disk-mode process.

Per batch the worker times ``get``, ``update`` and a ``get`` followed by an ``update`` of the rows
it got (the in-place "training step" between them is not timed); the three are interleaved batch
by batch. Flush: after ``--flush-batches`` batches of updates, ``flush()``; bytes written are the
calling thread's ``/proc/thread-self/io`` counters over the update+flush window (max of ``wchar``
and ``write_bytes``: a store's write-back of evicted rows counts, its background compaction does
not; the process-wide figure is reported beside it), divided by the distinct rows dirtied x row
bytes. In disk mode the first repetition ends each process with a full pass (sequential
get+update of every row in batches of --full-pass-rows, default 4,096, then flush) so peak RSS is taken with full tiers.

Every (system, mode) runs in its own subprocess, so peak RSS (``VmHWM``) is per system; the
processes of all systems are interleaved within each repetition (system order rotated per
repetition) and figures are medians over repetitions of per-process medians. Ratios are the median
of per-repetition paired ratios (with their range) against the fastest in-memory baseline (torch /
numpy / torch_thp, by median) of the same mode and workload. Workers
import only ``lightning_embcache.store`` (not the Lightning facade); the facade's import cost is
measured once and reported. Results, the command and the host go to ``docs/benchmarks.md``.

    embcache bench store [--quick] [--json PATH] [--reps R] [--systems a,b] [--modes ram,disk]
"""

from __future__ import annotations

import argparse
import datetime as _dt
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

from .harness import paired_ratios
from .store_systems import ALL_SYSTEMS, IN_MEMORY

MiB = 1 << 20
KiB = 1 << 10
WORKLOADS = ("epoch", "zipf")
MODES = ("ram", "disk")
PHASES = ("get", "update", "get_update")
DISK_SYSTEMS = ("memmap", "naive", "store")
REPO_ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embcache bench store", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, one repetition (< ~1 minute)")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--reps", type=int, help="repetitions (default 3; quick 1)")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma list of {','.join(ALL_SYSTEMS)}")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of ram,disk")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of epoch,zipf")
    p.add_argument("--ram-rows", type=int, help="rows of the in-RAM table (default 1M; quick 32K)")
    p.add_argument("--hot-mib", type=float, help="disk mode hot_bytes budget (default 192; quick 3)")
    p.add_argument("--warm-mib", type=float, help="disk mode warm_bytes budget (default 64; quick 1)")
    p.add_argument("--disk-factor", type=float, default=4.0, help="disk table size / budget (default 4)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--chunk-rows", type=int, default=1024)
    p.add_argument("--zipf-a", type=float, default=1.1)
    p.add_argument("--batches", type=int, help="timed batches per phase per process (default 300; quick 20)")
    p.add_argument("--warmup", type=int, help="untimed warm-up batches (default 50; quick 5)")
    p.add_argument("--time-cap", type=float, help="seconds per workload loop before stopping early "
                   "(slow systems; default 6; quick 1)")
    p.add_argument("--naive-time-cap", type=float, help="time cap for the naive design's loop (default 3 s; "
                   "it runs its warm-up batch and at least 2 timed batches regardless)")
    p.add_argument("--naive-reps", type=int, help="repetitions that include the naive design (default 1: its "
                   "batches take seconds and it is 1000x away, so one process measures it)")
    p.add_argument("--full-pass-reps", type=int, help="repetitions whose disk-mode processes end with a "
                   "sequential get+update pass over the whole table and a flush (default 1; 0 = none)")
    p.add_argument("--full-pass-rows", type=int, default=4096, help="rows per batch of the full pass "
                   "(default 4,096: 2 MiB batches; at 65,536 the caller's own two 32 MiB tensors add 64 MiB "
                   "to the peak RSS)")
    p.add_argument("--full-pass-cap", type=float, help="seconds before a full pass stops early (default 90; "
                   "quick 10); the rows done are reported")
    p.add_argument("--flush-rounds", type=int, help="flush measurements per workload (default 3; quick 2)")
    p.add_argument("--flush-batches", type=int, help="update batches before each measured flush (default 8; quick 2)")
    p.add_argument("--workdir", help="where the data files go (default: a fresh temp dir, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the workdir")
    p.add_argument("--reuse-setup", action="store_true", help="with --workdir: reuse data files a previous "
                   "run left there with the same sizes (they carry that run's updates)")
    p.add_argument("--no-drop-cache", action="store_true", help="do not fadvise(DONTNEED) disk-mode files")
    p.add_argument("--profile", action="store_true", help="cProfile the timed loop of the store (distorts its timings)")
    p.add_argument("--jobs", type=int, help="worker processes at once (default 1; quick 2 -- quick "
                   "timings are for smoke only)")
    p.add_argument("--no-isolate", action="store_true", help="run all systems of a mode in one process "
                   "(default with --quick; peak RSS is then not per system)")
    p.add_argument("--isolate", action="store_true", help="one process per system (the default without --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in the workers (default 1: "
                   "one training thread; the store's background threads get the other core)")
    p.add_argument("--store-rev", help="benchmark the package as committed at this git revision (extracted "
                   "with git archive into the workdir) instead of the working tree, e.g. HEAD")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-timeout", type=float, help="seconds per subprocess (default 400; quick 120)")
    return p


def resolve(args: argparse.Namespace) -> dict:
    q = args.quick
    d = lambda v, full, quick: v if v is not None else (quick if q else full)  # noqa: E731
    hot = int(d(args.hot_mib, 192, 3) * MiB)
    warm = int(d(args.warm_mib, 64, 1) * MiB)
    row_bytes = args.dim * 4
    disk_rows = int(args.disk_factor * (hot + warm)) // row_bytes
    cfg = {
        "quick": q,
        "reps": d(args.reps, 3, 1),
        "systems": [s for s in args.systems.split(",") if s],
        "modes": [m for m in args.modes.split(",") if m],
        "workloads": [w for w in args.workloads.split(",") if w],
        "ram_rows": d(args.ram_rows, 1 << 20, 1 << 15),
        "disk_rows": disk_rows,
        "hot_bytes": hot,
        "warm_bytes": warm,
        "disk_factor": args.disk_factor,
        "dim": args.dim,
        "batch": args.batch,
        "chunk_rows": args.chunk_rows,
        "zipf_a": args.zipf_a,
        "batches": d(args.batches, 300, 20),
        "warmup_batches": d(args.warmup, 50, 5),
        "time_cap_s": d(args.time_cap, 6.0, 1.0),
        "min_batches": 3,
        "naive_time_cap_s": d(args.naive_time_cap, 3.0, 0.5),
        "naive_reps": d(args.naive_reps, 1, 1),
        "full_pass_reps": d(args.full_pass_reps, 1, 1),
        "full_pass_cap_s": d(args.full_pass_cap, 90.0, 10.0),
        "full_pass_rows": args.full_pass_rows,
        "flush_rounds": d(args.flush_rounds, 3, 2),
        "flush_batches": d(args.flush_batches, 8, 2),
        "drop_cache": not args.no_drop_cache,
        "profile": args.profile,
        "seed": args.seed,
        "jobs": d(args.jobs, 1, 2),
        "store_rev": args.store_rev,
        "pkg_dir": None,
        "isolate": args.isolate or (not args.no_isolate and not q),
        "threads": args.threads,
        "worker_timeout_s": d(args.worker_timeout, 400, 120),
    }
    for s in cfg["systems"]:
        if s not in ALL_SYSTEMS:
            raise SystemExit(f"embcache bench store: unknown system {s!r}; choose from {ALL_SYSTEMS}")
    for m in cfg["modes"]:
        if m not in MODES:
            raise SystemExit(f"embcache bench store: unknown mode {m!r}; choose from {MODES}")
    for w in cfg["workloads"]:
        if w not in WORKLOADS:
            raise SystemExit(f"embcache bench store: unknown workload {w!r}; choose from {WORKLOADS}")
    return cfg


def machine_info() -> dict:
    def read(p):
        try:
            return Path(p).read_text().strip()
        except OSError:
            return None

    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import numpy
        import torch

        versions = {"torch": torch.__version__, "numpy": numpy.__version__}
    except Exception:  # pragma: no cover
        versions = {}
    try:
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        commit = None
    mem = None
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except Exception:  # pragma: no cover
        pass
    try:
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "lightning_embcache/store"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        dirty = None
    return {
        "store_uncommitted_changes": dirty,
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "mem_total_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "git_commit": commit,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **versions,
    }


# --------------------------------------------------------------------------------------------
# subprocesses
# --------------------------------------------------------------------------------------------
def _worker(cmd: str, wcfg: dict, tmp: Path, timeout: float) -> dict:
    tag = f"{cmd}-{wcfg['system']}-{wcfg['mode']}-{wcfg.get('rep', 0)}"
    cfg_path, out_path = tmp / f"{tag}.cfg.json", tmp / f"{tag}.out.json"
    cfg_path.write_text(json.dumps(wcfg))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("store_worker.py")), cmd, str(cfg_path), str(out_path)],
            capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO_ROOT),
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    try:
        res = json.loads(out_path.read_text())
    except (OSError, ValueError):
        res = {"ok": False, "error": f"worker exited {proc.returncode} without a result",
               "stderr_tail": proc.stderr[-3000:]}
    res["wall_s"] = wall
    if not res.get("ok") and proc.stderr:
        res.setdefault("stderr_tail", proc.stderr[-3000:])
    return res


def _paths(workdir: Path, system: str, mode: str) -> str | None:
    if system == "memmap":
        return str(workdir / mode / "memmap" / "table.f32")
    if system == "naive":
        return str(workdir / mode / "naive")
    if system == "store":
        return str(workdir / mode / "store")
    return None


def _wcfg(cfg: dict, system: str, mode: str, workdir: Path) -> dict:
    slow = system == "naive"  # ~1-4 s per batch: a few batches measure it well enough
    return {
        "system": system,
        "mode": mode,
        "num_rows": cfg["ram_rows"] if mode == "ram" else cfg["disk_rows"],
        "dim": cfg["dim"],
        "batch": cfg["batch"],
        "chunk_rows": cfg["chunk_rows"],
        "hot_bytes": None if mode == "ram" else cfg["hot_bytes"],
        "warm_bytes": 0 if mode == "ram" else cfg["warm_bytes"],
        "zipf_a": cfg["zipf_a"],
        "batches": cfg["batches"],
        "warmup_batches": min(cfg["warmup_batches"], 1) if slow else cfg["warmup_batches"],
        "time_cap_s": min(cfg["time_cap_s"], cfg["naive_time_cap_s"]) if slow else cfg["time_cap_s"],
        "min_batches": 2 if slow else cfg["min_batches"],
        "flush_rounds": cfg["flush_rounds"],
        "flush_batches": cfg["flush_batches"],
        "drop_cache": cfg["drop_cache"],
        "profile": cfg["profile"] and system == "store",
        "threads": cfg["threads"],
        "pkg_dir": cfg["pkg_dir"],
        "data_seed": cfg["seed"],
        "path": _paths(workdir, system, mode),
    }


def _log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------
def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(cfg: dict, runs: dict) -> dict:
    """runs[mode][system] = [worker result per rep] -> results[mode][workload][system]."""
    out: dict = {}
    for mode in cfg["modes"]:
        out[mode] = {}
        for wl in cfg["workloads"]:
            cell = {}
            for system in cfg["systems"]:
                reps = runs.get(mode, {}).get(system, [])
                good = [r for r in reps if r.get("ok") and wl in r.get("workloads", {})]
                entry: dict = {"reps_ok": len(good), "reps": len(reps)}
                if not good:
                    errs = [r.get("error") for r in reps if not r.get("ok")]
                    entry["error"] = errs[0] if errs else "not run"
                    cell[system] = entry
                    continue
                wls = [r["workloads"][wl] for r in good]
                for ph in PHASES:
                    med = _med([w["phases"][ph].get("median_ms") for w in wls])
                    entry[ph] = {
                        "median_ms": med,
                        "rows_per_s": cfg["batch"] / (med / 1e3) if med else None,
                        "rep_medians_ms": [w["phases"][ph].get("median_ms") for w in wls],
                        # repetition -> this process's median (runs[mode][system] is in repetition order)
                        "by_rep_ms": {i: r["workloads"][wl]["phases"][ph].get("median_ms")
                                      for i, r in enumerate(reps) if r.get("ok") and wl in r.get("workloads", {})},
                        "p90_ms": _med([w["phases"][ph].get("p90_ms") for w in wls]),
                        "batches": sum(w["phases"][ph].get("n", 0) for w in wls),
                    }
                fl = [w["flush"] for w in wls if "flush" in w]
                if fl:
                    rounds = [x for f in fl for x in f["rounds"]]
                    entry["flush"] = {
                        "median_seconds": _med([x["seconds"] for x in rounds]),
                        "median_dirty_bytes": _med([x["dirty_bytes"] for x in rounds]),
                        "median_bytes_written": _med([x["bytes_written"] for x in rounds]),
                        "median_written_per_dirty": _med([x["written_per_dirty"] for x in rounds]),
                        "max_written_per_dirty": max(x["written_per_dirty"] for x in rounds),
                        "worst_excess_bytes": max(x["bytes_written"] - 2 * x["dirty_bytes"] for x in rounds),
                        "median_dirty_mb_per_s": _med([x["dirty_mb_per_s"] for x in rounds]),
                        "median_process_written_per_dirty": _med([x.get("process_written_per_dirty") for x in rounds]),
                        "max_process_written_per_dirty": max(x.get("process_written_per_dirty", 0) for x in rounds),
                        "rounds": len(rounds),
                    }
                    entry["flush"]["pass_bound"] = all(
                        x["bytes_written"] <= 2 * x["dirty_bytes"] + 64 * KiB for x in rounds)
                else:
                    entry["flush"] = None
                entry["update_wchar_per_updated_byte"] = _med([w["update_io"]["wchar_per_updated_byte"] for w in wls])
                entry["flush_errors"] = [e for w in wls for e in w.get("flush_errors", [])]
                fps = [r["full_pass"] for r in good if r.get("full_pass")]
                if fps:
                    entry["full_pass"] = {
                        "rows_per_s": _med([f["rows_per_s"] for f in fps]),
                        "loop_s": _med([f["loop_s"] for f in fps]),
                        "flush_s": _med([f["flush_s"] for f in fps]),
                        "complete": all(f["complete"] for f in fps),
                        "rows": min(f["rows"] for f in fps),
                        "hwm_mib": max(f["mem_after"]["VmHWM"] for f in fps),
                    }
                entry["rss_isolated"] = all(r.get("rss_isolated", True) for r in good)
                entry["peak_rss_mib"] = _med([r["peak_rss_mib"] for r in good])
                entry["peak_rss_mib_max"] = max(r["peak_rss_mib"] for r in good)
                entry["rss_before_open_mib"] = _med([r.get("rss_before_open_mib") for r in good])
                entry["anon_huge_kib_end"] = _med([r.get("anon_huge_kib_end") for r in good])
                info = good[-1].get("info") or {}
                if system == "torch_thp":
                    entry["thp"] = {k: info.get(k) for k in ("madvise_hugepage", "thp_granted_kib", "table_kib",
                                                             "thp_granted_fraction", "madvise_error")}
                if system == "store":
                    entry["store_stats_end"] = wls[-1].get("store_stats")
                    entry["mem"] = {k: wls[-1].get(k) for k in ("mem_before_flush", "mem_after_flush", "mem_end")}
                    if any("profile_tottime" in w for w in wls):
                        entry["profile_tottime"] = wls[-1].get("profile_tottime")
                        entry["profile_cumulative"] = wls[-1].get("profile_cumulative")
                cell[system] = entry
            # ratios vs the fastest in-memory baseline of this cell
            for ph in PHASES:
                base = [(cell[s][ph]["median_ms"], s) for s in IN_MEMORY
                        if s in cell and ph in cell[s] and cell[s][ph]["median_ms"]]
                if not base:
                    continue
                ref_ms, ref_sys = min(base)
                ref_by_rep = cell[ref_sys][ph]["by_rep_ms"]
                for s, e in cell.items():
                    if ph not in e or not e[ph]["median_ms"]:
                        continue
                    e[ph]["fastest_in_memory"] = ref_sys
                    # the median of per-repetition paired ratios (the same repetition's runs), never a
                    # ratio of two medians; a system run in one repetition only (naive) gets one pair
                    reps_both = [i for i, v in e[ph]["by_rep_ms"].items() if v and ref_by_rep.get(i)]
                    if reps_both:
                        pr = paired_ratios({"s": [e[ph]["by_rep_ms"][i] for i in reps_both],
                                            "ref": [ref_by_rep[i] for i in reps_both]}, "s", "ref")
                        e[ph]["ratio_vs_fastest_in_memory"] = pr.median
                        e[ph]["paired_vs_fastest_in_memory"] = pr.as_dict()
            out[mode][wl] = cell
    return out


def check_targets(cfg: dict, results: dict) -> list[dict]:
    t: list[dict] = []

    def add(name, status, detail):
        t.append({"target": name, "status": status, "detail": detail})

    # 1. in-RAM epoch get+update within 1.5x of the fastest bare gather/scatter
    cell = results.get("ram", {}).get("epoch", {})
    st = cell.get("store", {})
    if "get_update" in st and "ratio_vs_fastest_in_memory" in st["get_update"]:
        r = st["get_update"]["ratio_vs_fastest_in_memory"]
        ref = st["get_update"]["fastest_in_memory"]
        add("ram/epoch get+update <= 1.5x fastest in-memory", "PASS" if r <= 1.5 else "FAIL",
            f"store {st['get_update']['median_ms']:.3f} ms vs {ref} "
            f"{cell[ref]['get_update']['median_ms']:.3f} ms = {r:.2f}x")
    else:
        add("ram/epoch get+update <= 1.5x fastest in-memory", "N/A", st.get("error", "store or baselines not run"))

    # 2. updates >= 1000x faster than the naive design with sync per update
    parts, ok, any_ = [], True, False
    for mode in cfg["modes"]:
        for wl in cfg["workloads"]:
            c = results.get(mode, {}).get(wl, {})
            s, n = c.get("store", {}), c.get("naive", {})
            if "update" in s and "update" in n and s["update"]["median_ms"] and n["update"]["median_ms"]:
                any_ = True
                r = n["update"]["median_ms"] / s["update"]["median_ms"]
                ok &= r >= 1000
                parts.append(f"{mode}/{wl} {r:.0f}x")
    add("update >= 1000x faster than naive (sync per update)", ("PASS" if ok else "FAIL") if any_ else "N/A",
        ", ".join(parts) or "store or naive not run")

    # 3. flush bytes written <= 2 x dirty + 64 KiB (every measured round)
    parts, ok, any_ = [], True, False
    for mode in cfg["modes"]:
        for wl in cfg["workloads"]:
            f = results.get(mode, {}).get(wl, {}).get("store", {}).get("flush")
            if f:
                any_ = True
                ok &= f["pass_bound"]
                parts.append(f"{mode}/{wl} {f['max_written_per_dirty']:.2f}x of "
                             f"{f['median_dirty_bytes'] / KiB:.0f} KiB")
    add("flush bytes written <= 2 x dirty + 64 KiB", ("PASS" if ok else "FAIL") if any_ else "N/A",
        ", ".join(parts) or "store flush not measured")

    # 4. peak RSS with a 4x-budget table <= budget * 1.1 + 300 MiB
    budget = cfg["hot_bytes"] + cfg["warm_bytes"]
    limit = budget * 1.1 / MiB + 300
    parts, ok, any_ = [], True, False
    for wl in cfg["workloads"]:
        e = results.get("disk", {}).get(wl, {}).get("store", {})
        if e.get("peak_rss_mib") is not None and not e.get("rss_isolated", True):
            parts.append("not measured: systems shared a process (--quick / --no-isolate)")
            break
        if e.get("peak_rss_mib") is not None:
            any_ = True
            ok &= e["peak_rss_mib_max"] <= limit
            parts.append(f"{wl} {e['peak_rss_mib_max']:.0f} MiB")
            break  # one process runs both workloads: same peak
    add(f"disk peak RSS <= {budget / MiB:.0f} MiB x 1.1 + 300 = {limit:.0f} MiB",
        ("PASS" if ok else "FAIL") if any_ else "N/A", ", ".join(parts) or "store disk mode not run")
    return t


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def _paired(phase: dict) -> str:
    pr = phase.get("paired_vs_fastest_in_memory")
    if not pr:
        return "n/a"
    return f"{pr['median']:.2f}x ({pr['low']:.2f}-{pr['high']:.2f}, {pr['reps']} reps)"


def table_lines(cfg: dict, results: dict) -> list[str]:
    lines = []
    for mode in cfg["modes"]:
        for wl in cfg["workloads"]:
            cell = results.get(mode, {}).get(wl, {})
            n = cfg["ram_rows"] if mode == "ram" else cfg["disk_rows"]
            head = f"{mode} / {wl}: {n:,} rows x {cfg['dim']} f32 ({n * cfg['dim'] * 4 / MiB:.0f} MiB)"
            if mode == "disk":
                head += (f", store budget hot {cfg['hot_bytes'] / MiB:.0f} + warm {cfg['warm_bytes'] / MiB:.0f} MiB")
            lines.append(head)
            lines.append("| system | get ms | update ms | get+upd ms | get+upd rows/s | get+upd vs best | "
                         "update vs best | flush s | flush written/dirty (worst) | full pass rows/s | peak RSS MiB |")
            lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for s in cfg["systems"]:
                e = cell.get(s, {})
                if "get" not in e:
                    lines.append(f"| {s} | error: {str(e.get('error', 'n/a'))[:80]} ||||||||||")
                    continue
                fl = e.get("flush")
                if s == "naive":
                    fs, fw = "per update", _f(e.get("update_wchar_per_updated_byte"), "{:.0f}x (per update)")
                elif fl:
                    fs = _f(fl["median_seconds"], "{:.4f}")
                    fw = _f(fl["max_written_per_dirty"], "{:.2f}x")
                    if fl.get("max_process_written_per_dirty", 0) > fl["max_written_per_dirty"] * 1.05:
                        fw += f" ({fl['max_process_written_per_dirty']:.2f}x all threads)"
                else:
                    fs, fw = "n/a", "n/a"
                fpd = e.get("full_pass")
                fp = "-" if not fpd else (f"{fpd['rows_per_s']:,.0f}" + ("" if fpd["complete"] else
                                                                         f" ({fpd['rows']:,} rows, capped)"))
                lines.append(
                    f"| {s} | {_f(e['get']['median_ms'])} | {_f(e['update']['median_ms'])} | "
                    f"{_f(e['get_update']['median_ms'])} | {_f(e['get_update']['rows_per_s'], '{:,.0f}')} | "
                    f"{_paired(e['get_update'])} | "
                    f"{_paired(e['update'])} | {fs} | {fw} | {fp} | "
                    f"{_f(e.get('peak_rss_mib_max'), '{:.0f}')} |")
            ferr = cell.get("store", {}).get("flush_errors")
            if ferr:
                lines.append(f"store: {len(ferr)} flush() call(s) raised and were retried; first: {ferr[0][:200]}")
            thp = cell.get("torch_thp", {}).get("thp")
            if thp:
                lines.append(f"torch_thp: madvise ok={thp.get('madvise_hugepage')}, AnonHugePages "
                             f"{thp.get('thp_granted_kib')} KiB of {thp.get('table_kib')} KiB "
                             f"({_f(thp.get('thp_granted_fraction'), '{:.0%}')})")
            lines.append("")
    return lines


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = resolve(args)
    t_start = time.perf_counter()
    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="embcache-bench-store-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = workdir / "ipc"
    tmp.mkdir(exist_ok=True)
    machine = machine_info()
    if cfg["store_rev"]:
        src = workdir / "src"
        src.mkdir(exist_ok=True)
        rev = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", cfg["store_rev"]], capture_output=True,
                             text=True, check=True).stdout.strip()
        arch = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", rev, "lightning_embcache"],
                              capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=arch, check=True)
        cfg["pkg_dir"] = str(src / "lightning_embcache")
        machine["package_source"] = f"git archive {rev}"
    else:
        machine["package_source"] = "working tree"
    _log(f"embcache bench store: {machine['cpus']} cpus, THP {machine['thp_enabled']}, "
         f"torch {machine.get('torch')}, workdir {workdir}")
    _log(f"  ram: {cfg['ram_rows']:,} rows; disk: {cfg['disk_rows']:,} rows vs budget "
         f"{(cfg['hot_bytes'] + cfg['warm_bytes']) / MiB:.0f} MiB; {cfg['reps']} reps; systems {cfg['systems']}")

    setups: dict = {}
    import_cost: dict = {}
    runs: dict = {m: {s: [] for s in cfg["systems"]} for m in cfg["modes"]}
    try:
        # one-time data files, all in one process (their creation is not timed against anyone)
        items = [_wcfg(cfg, s, mode, workdir) for mode in cfg["modes"] for s in cfg["systems"] if s in DISK_SYSTEMS]

        def marker(i):
            return Path(i["path"] + ".ready"), json.dumps({k: i[k] for k in ("num_rows", "dim", "chunk_rows",
                                                                                "hot_bytes", "warm_bytes", "data_seed")})

        if args.reuse_setup:  # a kept --workdir: reuse data files made with the same sizes
            for i in list(items):
                mpath, want = marker(i)
                if mpath.exists() and mpath.read_text() == want:
                    setups[f"{i['mode']}/{i['system']}"] = {"ok": True, "reused": True, "seconds": 0.0}
                    items.remove(i)
        for i in items:  # about to be (re)created
            mpath, _ = marker(i)
            mpath.unlink(missing_ok=True)
            if Path(i["path"]).exists():
                shutil.rmtree(i["path"]) if Path(i["path"]).is_dir() else os.unlink(i["path"])
        deferred_setup = [] if cfg["isolate"] else items  # --no-isolate: each mode's process makes its own
        if items and cfg["isolate"]:
            res = _worker("setup", {"system": "all", "mode": "all", "items": items,
                                    "import_cost": "store" in cfg["systems"]}, tmp, cfg["worker_timeout_s"] * 2)
            import_cost = res.get("import_cost") or {}
            setups = res.get("items") or {f"{i['mode']}/{i['system']}": res for i in items}
            for i in items:
                if setups.get(f"{i['mode']}/{i['system']}", {}).get("ok"):
                    mpath, want = marker(i)
                    mpath.write_text(want)
            for key, r in setups.items():
                _log(f"  setup {key}: " + (f"{r.get('seconds', 0):.1f} s" if r.get("ok") else f"FAILED {r.get('error')}"))
        if "store" in cfg["systems"] and cfg["isolate"] and not import_cost:
            import_cost = _worker("import-cost", {"system": "import", "mode": "cost"}, tmp, 300)
        if import_cost.get("ok"):
            _log(f"  import torch: {import_cost['torch_rss_mib']:.0f} MiB RSS; import lightning_embcache "
                 f"(facade): {import_cost['facade_rss_mib']:.0f} MiB RSS, +{import_cost['facade_extra_s']:.1f} s")
        jobs = []
        for rep in range(cfg["reps"]):
            k = rep % len(cfg["systems"])
            order = cfg["systems"][k:] + cfg["systems"][:k]
            wls = cfg["workloads"] if rep % 2 == 0 else cfg["workloads"][::-1]
            rep_systems = [s for s in order if s != "naive" or rep < cfg["naive_reps"]]
            for mode in cfg["modes"]:
                if cfg["isolate"]:
                    jobs.extend((rep, mode, [s], wls) for s in rep_systems)
                else:
                    jobs.append((rep, mode, rep_systems, wls))

        def one(job):
            rep, mode, systems, wls = job
            out, items = {}, []
            mode_setup = [i for i in deferred_setup if i["mode"] == mode] if rep == 0 else []
            for s in systems:
                if mode_setup or not cfg["isolate"]:
                    pass  # made (or already made) by the run-many process itself
                elif s in DISK_SYSTEMS and not setups.get(f"{mode}/{s}", {}).get("ok"):
                    out[s] = {"ok": False, "error": "setup failed: " + str(setups.get(f"{mode}/{s}", {}).get("error"))}
                    continue
                w = _wcfg(cfg, s, mode, workdir)
                w.update(rep=rep, seed=cfg["seed"] * 1000 + rep, workloads=wls,
                         full_pass=mode == "disk" and rep < cfg["full_pass_reps"],
                         full_pass_cap_s=cfg["full_pass_cap_s"], full_pass_rows=cfg["full_pass_rows"])
                items.append(w)
            if len(items) == 1:
                out[items[0]["system"]] = _worker("run", items[0], tmp, cfg["worker_timeout_s"])
            elif items:
                res = _worker("run-many", {"system": "many", "mode": mode, "rep": rep, "items": items,
                                           "setup_items": mode_setup}, tmp, cfg["worker_timeout_s"] * len(items))
                for w in items:
                    out[w["system"]] = (res.get("items") or {}).get(w["system"], res)
                for key, r in (res.get("setup") or {}).items():
                    setups[key] = r
                    _log(f"  setup {key}: " + (f"{r.get('seconds', 0):.1f} s" if r.get("ok")
                                               else f"FAILED {r.get('error')}"))
                    if r.get("ok"):
                        i = next(i for i in mode_setup if f"{i['mode']}/{i['system']}" == key)
                        mpath, want = marker(i)
                        mpath.write_text(want)
            for s in systems:
                res = out[s]
                if res.get("ok"):
                    gu = "  ".join(f"{wl} g+u {res['workloads'][wl]['phases']['get_update']['median_ms']:.3f} ms"
                                   for wl in wls)
                    _log(f"  rep {rep} {mode:4s} {s:9s} {gu}  peak {res['peak_rss_mib']:.0f} MiB"
                         + (f" ({res['wall_s']:.1f} s)" if "wall_s" in res else ""))
                else:
                    _log(f"  rep {rep} {mode:4s} {s:9s} FAILED: {res.get('error')}")
            return out

        if cfg["jobs"] > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(cfg["jobs"]) as pool:
                done = list(pool.map(one, jobs))
        else:
            done = [one(j) for j in jobs]
        for (rep, mode, systems, _w), out in zip(jobs, done):
            for s in systems:
                runs[mode][s].append(out[s])
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    results = aggregate(cfg, runs)
    targets = check_targets(cfg, results)
    lines = table_lines(cfg, results)
    print()
    print("\n".join(lines))
    print("Targets:")
    for t in targets:
        print(f"  {t['status']:4s}  {t['target']}: {t['detail']}")
    total = time.perf_counter() - t_start
    print(f"total {total:.0f} s")
    if args.json:
        doc = {
            "benchmark": "store",
            "command": "embcache bench store " + " ".join(list(sys.argv[1:] if argv is None else argv)),
            "machine": machine,
            "config": cfg,
            "systems": cfg["systems"],
            "modes": cfg["modes"],
            "workloads": cfg["workloads"],
            "results": results,
            "targets": targets,
            "table_markdown": lines,
            "setup": setups,
            "import_cost": import_cost,
            "runs": runs,
            "total_seconds": total,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=repr))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
