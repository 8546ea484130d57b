"""Writer processes of the crash tests: random updates and flushes until they are killed.

    python _crash_writer.py      # a zygote: imports torch once, then forks one writer per request

The zygote reads requests "PATH SEED MODE LOG" on stdin (MODE: "flush", "compact" to call
``compact()`` after every flush, or "recycle": a memory-mode store, half the table updated each
step, background compaction awaited after each flush, so each flush overwrites the segment file
the previous one's compaction dropped, segpool.py) and answers each with the pid of a forked writer process, which
the test kills with a real SIGKILL. Forking from a zygote keeps each trial from paying torch's
import time. A writer appends to LOG, one write() per line: "ready" once the store is open,
"ack STEP VERSION" after each flush returns (the test rebuilds the rows of STEP with
``expected_rows``), "compacted STEP" after each compaction and, in mode "recycle", "reused N"
(segment files overwritten so far) before each flush. A line is written only after the
call it reports has returned, so the log holds exactly what the writer had acknowledged when
it died.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import numpy as np

N, DIM, CHUNK = 3000, 8, 128
ROW_BYTES = DIM * 4
HOT_BYTES = 200 * (ROW_BYTES + 11)  # 200 of 3000 rows: evictions write dirty rows back mid-step
WARM_BYTES = 4 * CHUNK * ROW_BYTES


def step_batches(seed: int, step: int, mode: str = "flush"):
    """The update calls of ``step``: a few batches of random ids (with duplicates) and rows; in
    mode "recycle", half the table's rows (sorted) in one batch."""
    rng = np.random.default_rng([seed, step])
    if mode == "recycle":
        yield np.sort(rng.choice(N, N // 2, replace=False)), rng.standard_normal((N // 2, DIM)).astype(np.float32)
        return
    for _ in range(int(rng.integers(1, 5))):
        n = int(rng.integers(1, 300))
        ids = rng.integers(0, N, n)
        if rng.random() < 0.5:  # sometimes a run of neighbours, to touch whole chunks
            lo = int(rng.integers(0, N - n))
            ids = np.arange(lo, lo + n)
        yield ids, rng.standard_normal((n, DIM)).astype(np.float32)


def expected_rows(seed: int, step: int, mode: str = "flush") -> np.ndarray:
    """The table after the updates of steps 1..step, from a zero table; duplicates: last wins."""
    table = np.zeros((N, DIM), np.float32)
    for s in range(1, step + 1):
        for ids, values in step_batches(seed, s, mode):
            for i, row in enumerate(ids.tolist()):
                table[row] = values[i]
    return table


def write_loop(path: str, seed: int, mode: str, log: str) -> None:
    import torch

    from lightning_embcache import EmbeddingStore

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        if mode == "recycle":
            os.environ["EMBCACHE_COMPACTION_PROCESS"] = "never"  # rounds in this process: more flushes a second
            store = EmbeddingStore.open(path)
        else:
            store = EmbeddingStore.open(path, hot_bytes=HOT_BYTES, warm_bytes=WARM_BYTES)
        os.write(fd, b"ready\n")
        step = 0
        while True:
            step += 1
            for ids, values in step_batches(seed, step, mode):
                store.update(torch.from_numpy(ids), torch.from_numpy(values))
            if mode == "recycle":
                os.write(fd, f"reused {store._versions.disk.segment_pool.reused}\n".encode())
            version = store.flush()
            os.write(fd, f"ack {step} {version}\n".encode())
            if mode == "recycle":
                store._wait_bg()  # the segment is folded and dropped into the pool
            if mode == "compact":
                store.compact()
                os.write(fd, f"compacted {step}\n".encode())
    except BaseException:
        os.write(fd, ("error\n" + traceback.format_exc()).encode())
        raise


def serve() -> None:
    import torch

    torch.set_num_threads(1)  # no intra-op pool in the zygote: children fork from a clean process
    import lightning_embcache  # noqa: F401 - imported once here, inherited by every writer

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed writers
    print("zygote ready", flush=True)
    for line in sys.stdin:
        path, seed, mode, log = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                write_loop(path, int(seed), mode, log)
            finally:
                os._exit(1)
        print(pid, flush=True)


if __name__ == "__main__":
    serve()
