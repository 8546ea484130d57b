"""The compaction process loads the store's file modules the way foldproc's boot code does (and
what `foldproc.serve` imports), and never torch: a child that imported it would take seconds to
start and hundreds of MiB of RSS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning_embcache.store.foldproc as foldproc


def test_the_compaction_process_imports_no_torch():
    probe = foldproc._BOOT.replace("from _embcache_fold.foldproc import serve\nserve(cfg, int(sys.argv[2]))\n",
                                   "import _embcache_fold.foldproc, _embcache_fold.disk, _embcache_fold.fold\n"
                                   "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n")
    assert probe != foldproc._BOOT, "foldproc's boot code changed: update this probe"
    cfg = {"sys_path": list(sys.path), "package": str(Path(foldproc.__file__).resolve().parent)}
    out = subprocess.run([sys.executable, "-c", probe, json.dumps(cfg), "0"], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
