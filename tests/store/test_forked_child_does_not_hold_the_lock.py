"""A process forked from a writer (a DataLoader worker) does not keep the store's writer lock once
the writer is killed: a resume can open the store at once, while the child still runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from lightning_embcache import EmbeddingStore

SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from lightning_embcache import EmbeddingStore
    s = EmbeddingStore.create(sys.argv[1], 100, 4)
    s.update(torch.arange(10), torch.ones(10, 4))
    s.flush()
    child = os.fork()
    if child == 0:
        time.sleep(60)   # a worker that outlives its trainer
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
""")


def test_a_killed_writers_forked_child_does_not_keep_the_lock(tmp_path):
    path = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(path)], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the trainer dies; its forked child lives on
        proc.wait()
        os.kill(child, 0)  # still running
        with EmbeddingStore.open(path) as s:  # no StoreLockedError
            assert s.version == 1
    finally:
        for pid in (child, proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
