"""`embcache` command line: `embcache demo`, `embcache bench <name>`.

Each subcommand lives in its own module with a `main(argv) -> int`; this file only dispatches,
so the store engine, the Lightning layer and the benchmarks stay importable on their own.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

# subcommand -> module with main(argv)
COMMANDS = {
    "demo": "lightning_embcache.demo",
}
BENCHMARKS = {
    "store": "lightning_embcache.bench.store",
    "profiler": "lightning_embcache.bench.profiler",
    "optim": "lightning_embcache.bench.optim",
    "sync": "lightning_embcache.bench.sync",
}

USAGE = """usage: embcache demo [options]          train a small model with a per-sample latent table
       embcache bench {%s} [options]
""" % ",".join(BENCHMARKS)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(USAGE, end="")
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"embcache bench: choose one of {sorted(BENCHMARKS)}", file=sys.stderr)
            return 2
        module = BENCHMARKS[rest[0]]
        rest = rest[1:]
    elif cmd in COMMANDS:
        module = COMMANDS[cmd]
    else:
        print(USAGE, end="", file=sys.stderr)
        return 2
    return int(importlib.import_module(module).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
