"""`embcache` (also `python -m lightning_embcache`): the demo, the benchmarks, and tools for a store on disk.

    embcache --version
    embcache demo [--root runs/demo] [--samples N] ...   train the demo auto-decoder, print a report
    embcache bench NAME [--out FILE] [...]                 a benchmark (from a source checkout; NAME below)
    embcache inspect PATH [--json]                       rows, dtype, fields, versions, bytes on disk
    embcache verify PATH [--latest] [--json]             every checksum and the manifest chain
    embcache compact PATH                                fold segments into chunks, reclaim versions
    embcache export PATH OUT.npy [--field F] [--version V]  rows in id order into a .npy file
    embcache reshard --checkpoint CKPT --world-size N    a checkpoint's stores for another process count

Every verb has `--help`. Verbs that delegate (demo, bench) pass their other options to the module
that implements them, so those modules stay importable and testable on their own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

# benchmark -> module with main(argv)
BENCHMARKS: dict[str, str] = {
    "store": "benchmarks.store",
    "disk": "benchmarks.disk",
    "optim": "benchmarks.optim",
    "profiler": "benchmarks.profiler",
    "sync": "benchmarks.sync",
    "tuning": "benchmarks.tuning",
    "train": "benchmarks.train",
    "distributed": "benchmarks.distributed",
    "flush": "benchmarks.flush",
    "shuffle": "benchmarks.shuffle",
    "first-touch": "benchmarks.first_touch",
    "rows16": "benchmarks.rows16",
}
# the module's own name for its output file flag, where it is not --out
OUTPUT_FLAG = {"store": "--json", "disk": "--json", "optim": "--json", "sync": "--json", "shuffle": "--json"}
BENCHMARK_HELP = {
    "store": "store get/update/flush against in-RAM and on-disk baselines",
    "disk": "disk mode (miss path, lookahead, disk use) against numpy.memmap",
    "optim": "sparse row-wise optimizers against torch.optim.SparseAdam",
    "profiler": "StepProfiler's overhead against Lightning's profilers",
    "sync": "DeferredSync against flushing on every step",
    "tuning": "hot_bytes, chunk_rows and warm_bytes/LZ4 settings on one table",
    "train": "end-to-end training throughput",
    "first-touch": "how soon a memory-mode table trains, against nn.Embedding + SparseAdam",
    "distributed": "auto-decoder with row-sharded trainable rows at 1, 2, 4 processes",
    "flush": "a large flush against a sequential write of the same bytes",
    "shuffle": "the randomness ChunkShuffleSampler trades, on data stored class by class",
    "rows16": "auto-decoder loss, speed and bytes with bf16 rows (stochastic rounding on/off) vs float32",
}

EXIT_DAMAGED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _version() -> str:
    from lightning_embcache import __version__

    return __version__


def _docs_location() -> str:
    """The user docs: the source tree's docs/ when run from a clone, else where pip installed them."""
    from pathlib import Path

    source = Path(__file__).resolve().parents[1] / "docs" / "getting-started.md"
    installed = Path(sys.prefix) / "share" / "doc" / "lightning_embcache" / "docs" / "getting-started.md"
    for page in (source, installed):
        if page.is_file():
            return str(page)
    return "docs/getting-started.md in the source distribution"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embcache",
        description="Trainable per-sample embedding rows for PyTorch Lightning: demo, "
        "benchmarks and tools for a store on disk.",
        epilog=f"Documentation: {_docs_location()}",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", title="verbs")

    # delegating verbs: their own options (and --help) belong to the module that runs them
    verbs.add_parser(
        "demo",
        add_help=False,
        help="train the demo auto-decoder and print a report (embcache demo --help for its options)",
    )

    verbs.add_parser(
        "reshard",
        add_help=False,
        help="rewrite a checkpoint's stores for another number of processes (embcache reshard --help for its options)",
    )

    bench = verbs.add_parser(
        "bench",
        help="run a benchmark (embcache bench NAME --help for its options)",
        description="Run a benchmark. Results are printed; a JSON file is written only with --out FILE.",
    )
    names = bench.add_subparsers(dest="benchmark", metavar="NAME", title="benchmarks")
    for name in BENCHMARKS:
        sub = names.add_parser(name, add_help=False, help=BENCHMARK_HELP[name])
        sub.add_argument("--out", metavar="FILE", default=None, help="write the JSON results to FILE")

    inspect = verbs.add_parser(
        "inspect",
        help="describe a store on disk",
        description="Rows, dim, dtype, per-row fields, versions and pins, bytes per "
        "tier on disk, compression ratio and the time of the last flush.",
    )
    inspect.add_argument("path", metavar="PATH", help="store directory")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")

    verify = verbs.add_parser(
        "verify",
        help="check every checksum and the manifest chain",
        description="Read every row of every retained version (checking the checksum of "
        "every file and record read) and the manifest chain. Exit status 1 if anything is "
        "damaged, naming the file.",
    )
    verify.add_argument("path", metavar="PATH", help="store directory")
    verify.add_argument("--latest", action="store_true", help="check only the newest version")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")

    compact = verbs.add_parser(
        "compact",
        help="fold delta segments into chunks and reclaim unpinned versions",
        description="Fold the store's delta segments into base chunks, publish the "
        "result as a new version holding the same rows, and reclaim versions that are "
        "neither among the newest nor pinned by a checkpoint. Needs the writer lock (no "
        "training may have the store open). Safe to interrupt: the store stays at its "
        "last published version.",
    )
    compact.add_argument("path", metavar="PATH", help="store directory")
    compact.add_argument("--json", action="store_true", help="print JSON instead of text")

    export = verbs.add_parser(
        "export",
        help="write a field of every row, in id order, to a .npy file",
        description="Stream a field of every row (a row-sharded table: in global id "
        "order, from its shard folders) into a .npy file with bounded memory; read it with "
        "numpy.load(OUT, mmap_mode='r'). Opens the store read-only, so training may be "
        "running. bfloat16 rows are written as float32.",
    )
    export.add_argument("path", metavar="PATH", help="store directory (or a sharded table's directory)")
    export.add_argument("out", metavar="OUT.npy", help="the file to write (its folder must exist)")
    export.add_argument("--field", default="weight", help="the per-row field (default: weight)")
    export.add_argument("--version", type=int, default=None, help="a retained version (default: the latest)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    export.add_argument(
        "--init",
        choices=["normal"],
        default=None,
        help="a sharded table created with init='normal' (its shards record it as a callable)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(args_list)
    if args.verb is None:
        parser.print_help()
        return EXIT_USAGE if args_list else 0
    if args.verb == "demo":
        return _run_module("lightning_embcache.demo", rest)
    if args.verb == "bench":
        return _bench(args, rest, parser)
    if args.verb == "reshard":
        return _run_module("lightning_embcache.distributed.reshard", rest)
    if rest:
        parser.error(f"unrecognized arguments for {args.verb}: {' '.join(rest)}")
    try:
        return {"inspect": _inspect, "verify": _verify, "compact": _compact, "export": _export}[args.verb](args)
    except KeyboardInterrupt:
        print(f"\nembcache {args.verb}: interrupted; the store is at its last published version", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a store error is the user's answer, not a traceback
        from lightning_embcache.store import StoreError

        if not isinstance(exc, (StoreError, OSError)):
            raise
        print(f"embcache {args.verb}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_DAMAGED if args.verb == "verify" else EXIT_USAGE


def _run_module(module: str, argv: list[str]) -> int:
    """A benchmark's exit status: its ``main``'s int, else 0 (some return their results)."""
    got = importlib.import_module(module).main(argv)
    return got if isinstance(got, int) and not isinstance(got, bool) else 0


def _benchmarks_checkout() -> str | None:
    """The source checkout whose ``benchmarks/`` folder holds the benchmarks, or None.

    The benchmarks are not installed with the package (they start processes, use cgroups and
    ``git archive``); they run from a clone installed with ``pip install -e .``."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return str(root) if (root / "benchmarks" / "__init__.py").is_file() else None


def _bench(args: argparse.Namespace, rest: list[str], parser: argparse.ArgumentParser) -> int:
    if args.benchmark is None:
        parser.parse_args(["bench", "--help"])  # prints the benchmarks and exits
    module, out_flag = BENCHMARKS[args.benchmark], OUTPUT_FLAG.get(args.benchmark, "--out")
    root = _benchmarks_checkout()
    if root is None:
        print(
            f"embcache bench {args.benchmark}: the benchmarks are not part of an installed package; run them "
            "from a source checkout of lightning_embcache (git clone, then `pip install -e .` and "
            f"`embcache bench {args.benchmark}` there; the code is in its benchmarks/ folder)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        print(
            f"embcache bench {args.benchmark}: this checkout has no {module} "
            f"(the '{args.benchmark}' benchmark is not part of version {_version()})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.out is not None:
        rest = [*rest, out_flag, args.out]
    return _run_module(module, rest)


def _progress(what: str, done: int, total: int) -> None:
    """One line on stderr, redrawn in place on a terminal."""
    if not sys.stderr.isatty():
        if done == total:
            print(f"  {what}: {done:,}/{total:,}", file=sys.stderr)
        return
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    print(
        f"\r  {what:<28} [{'#' * filled}{'.' * (width - filled)}] {done:,}/{total:,}",
        end=end,
        file=sys.stderr,
        flush=True,
    )


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def _inspect(args: argparse.Namespace) -> int:
    from lightning_embcache import tools

    summary = tools.inspect_store(args.path)
    _print_json(summary) if args.json else print(tools.format_inspection(summary))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from lightning_embcache import tools

    report = tools.verify_store(args.path, latest_only=args.latest, progress=_progress)
    _print_json(report.as_dict()) if args.json else print(tools.format_verification(report))
    return 0 if report.ok else EXIT_DAMAGED


def _compact(args: argparse.Namespace) -> int:
    from lightning_embcache import tools

    result = tools.compact_store(args.path, progress=_progress)
    if args.json:
        _print_json(result)
    else:
        print(
            f"{result['path']}: version {result['version']}, versions {result['versions_before']} -> "
            f"{result['versions']} (pinned {result['pinned'] or 'none'}), on disk "
            f"{tools.human_bytes(result['bytes_before'])} -> {tools.human_bytes(result['bytes_after'])} "
            f"in {result['seconds']:.1f} s"
        )
    return 0


def _export(args: argparse.Namespace) -> int:
    import time

    import numpy as np

    from lightning_embcache.store.export import export_path

    t0 = time.perf_counter()
    out = export_path(
        args.path, args.out, field=args.field, version=args.version, overwrite=args.overwrite, init=args.init
    )
    arr = np.load(out, mmap_mode="r")
    print(f"{out}: {arr.shape[0]:,} x {arr.shape[1]} {arr.dtype} ({args.field}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
