"""Shared helpers of the store tests: bitwise comparison, snapshots, inline background work."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers, so comparisons are bit-for-bit (-0.0 != 0.0, NaN == same NaN)."""
    t = t.contiguous()
    if t.dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
        return t
    return t.view(_BITS[t.element_size()])


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, what: str = "rows") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    g, w = bits(got), bits(want)
    if not torch.equal(g, w):
        bad = (g != w).reshape(len(g), -1).any(dim=1).nonzero().flatten()[:5].tolist() if len(g) else []
        raise AssertionError(f"{what} differ at positions {bad}: got {got[bad].tolist()}, expected {want[bad].tolist()}")


def snapshot(store) -> dict[str, torch.Tensor]:
    """Every field of every row, read through the public API."""
    ids = torch.arange(store.num_rows)
    return {k: v.clone() for k, v in store.get_fields(ids, store.field_names).items()}


def assert_snapshot_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str = "store") -> None:
    assert set(got) == set(want), f"{what}: fields {sorted(got)}, expected {sorted(want)}"
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"{what} field {name!r}")


class InlineExecutor:
    """A ThreadPoolExecutor stand-in that runs each task when it is submitted.

    The state machines use it so a failing sequence replays exactly (hypothesis needs that to
    shrink); the real background threads are exercised by the concurrency and crash tests.
    """

    def __init__(self, *args, **kwargs) -> None:
        pass

    def submit(self, fn, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True, **kwargs) -> None:
        pass


def compacted_store(path, n: int, dim: int, chunk_rows: int, seed: int = 0,
                    table: torch.Tensor | None = None) -> torch.Tensor:
    """Create a store at ``path`` whose ``n`` rows (random, or ``table``) all live in base chunk
    files (no delta segment left); return the rows."""
    from lightning_embcache import EmbeddingStore

    if table is None:
        table = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    with EmbeddingStore.create(path, n, dim, chunk_rows=chunk_rows) as s:
        s.update(torch.arange(n), table)
        s.flush()
        s.compact()
        s.flush()
    return table


def in_forked_child(fn) -> None:
    """Run ``fn()`` in a forked child (as a DataLoader worker would) and wait for it to exit."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def alive(pid: int, zombie_is_gone: bool = False) -> bool:
    """Whether process ``pid`` runs. ``zombie_is_gone``: an exited process nobody reaped yet counts
    as gone; only for single-threaded processes (a killed multi-threaded one shows its main thread
    as a zombie while its other threads still hold its descriptors and locks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    if not zombie_is_gone:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False  # gone between the two calls


def wait_for(pred, timeout: float, what: str) -> None:
    """Poll ``pred`` until it holds, failing the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def model_step(s, table: torch.Tensor, op: str, idx: torch.Tensor, k: int) -> bool:
    """One operation of a sequence checked against a tensor model, on store ``s`` and on ``table``
    (the model, changed in place): ``get``, ``records`` and ``fields`` assert that the store reads
    the model's rows exactly; ``update`` writes new random rows (seeded by ``k``) to both; ``flush``,
    ``compact`` (after a flush) and ``evict`` (everything) act on the store alone. Returns whether
    the store flushed, so a caller can keep what a reopened store must return."""
    if op == "get":
        assert torch.equal(s.get(idx), table[idx])
    elif op == "records":
        assert torch.equal(s.read_records(idx).view(torch.float32), table[idx])
    elif op == "fields":
        assert torch.equal(s.get_fields(idx)["weight"], table[idx])
    elif op == "update":
        u = torch.unique(idx)
        table[u] = torch.randn(len(u), table.shape[1], generator=torch.Generator().manual_seed(k))
        s.update(u, table[u])
    elif op in ("flush", "compact"):
        s.flush()
        if op == "compact":
            s.compact()
        return True
    elif op == "evict":
        s.evict(1 << 30)
    else:
        raise ValueError(f"unknown operation {op!r}")
    return False



@contextlib.contextmanager
def looping(fns, pause: float = 0.0):
    """Call each of ``fns`` over and over, each in its own thread, while the block runs (the race
    tests' background work); yields the list that gets each thread's first exception, which also
    ends that thread's loop. The threads are stopped and joined when the block exits."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop(fn) -> None:
        while not stop.is_set():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                return
            if pause:
                time.sleep(pause)

    threads = [threading.Thread(target=loop, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    try:
        yield errors
    finally:
        stop.set()
        for t in threads:
            t.join()
