"""The fixed workload of the I/O fault-injection suite, and the fault points it is run under.

`run_workload` drives a small disk-mode store through creates, updates (with write-back of
evicted rows), flushes, an explicit compaction, pin/unpin and reopens, checking every read against
a tensor model. Every write, fsync, rename, link, unlink and open of a store file passes
``fileio.FAULTS``; `FailAt` makes call *i* fail with an errno, `KillAfter` kills the process right
after call *i* (run in a forked child). The checks compare the reopened store with the state of
the last acknowledged flush (or, for a flush that raised after its manifest was renamed, the state
it was writing: durability of such a flush is unknown, the caller was told it failed).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import torch

from lightning_embcache import EmbeddingStore, StoreError
from lightning_embcache.store import fileio

N, DIM, CHUNK = 512, 8, 32
HOT = 96 * (DIM * 4 + 11)  # a sixth of the table: updates evict and write back
MODES = {"disk": HOT, "memory": None}  # memory mode: the whole table resident, chunks loaded on touch
_mode = "disk"


def set_mode(name: str) -> None:
    """Run the workload in disk mode (hot tier of a sixth of the table) or memory mode."""
    global _mode
    _mode = name


def _hot():
    return MODES[_mode]
OPS = ("write", "fsync", "rename", "link", "unlink", "open", "truncate")


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def before(self, op: str, name) -> None:
        self.calls += 1

    def after(self, op: str, name) -> None:
        pass


class FailAt(Counter):
    """Call ``index`` (0-based) fails with ``err``; every other call succeeds."""

    def __init__(self, index: int, err: int) -> None:
        super().__init__()
        self.index, self.err, self.fired = index, err, None

    def before(self, op: str, name) -> None:
        i = self.calls
        self.calls += 1
        if i == self.index:
            self.fired = (op, str(name))
            raise OSError(self.err, os.strerror(self.err) + " (injected)", str(name))


class KillAfter(Counter):
    """The process is killed (SIGKILL) right after call ``index`` completes."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def after(self, op: str, name) -> None:
        if self.calls - 1 == self.index:
            os.kill(os.getpid(), signal.SIGKILL)


def schedule(seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    ops: list[tuple] = []
    for step in range(14):
        n = int(rng.integers(20, 140))
        ops.append(("update", rng.choice(N, n, replace=False), rng.standard_normal((n, DIM)).astype(np.float32)))
        if step % 2 == 1:
            ops.append(("flush",))
        if step == 5:
            ops += [("pin",), ("compact",)]
        if step in (7, 11):
            ops.append(("reopen",))
        if step == 9:
            ops.append(("unpin",))
        ops.append(("get",))
    ops.append(("flush",))
    return ops


def run_workload(path, faults, on_ack=None) -> dict:
    """Run the schedule under ``faults`` (installed as fileio.FAULTS); return the outcome:
    ``wrong`` rows read that differed from the model, the accepted durable ``states`` (tensors)
    and how many calls were made. ``on_ack(k)`` is called after the k-th acknowledged flush."""
    fileio.FAULTS = faults
    wrong = 0
    model = torch.zeros(N, DIM)
    acked = model.clone()
    candidates: list[torch.Tensor] = []  # flushes that raised: durable or not, the caller was told no
    acks = 0
    pinned = None
    store = None
    try:
        for _ in range(5):  # the create itself may hit the fault: it leaves nothing behind
            try:
                store = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, hot_bytes=_hot())
                break
            except StoreError:
                assert not path.exists() or not any(path.iterdir()), "a failed create left files behind"
        assert store is not None
        for op in schedule():
            kind = op[0]
            try:
                if kind == "update":
                    ids, vals = torch.from_numpy(op[1]), torch.from_numpy(op[2])
                    store.update(ids, vals)
                    model[ids] = vals
                elif kind == "flush":
                    try:
                        store.flush()
                    except StoreError:
                        candidates.append(model.clone())
                        raise
                    acked, candidates = model.clone(), []
                    acks += 1
                    if on_ack is not None:
                        on_ack(acks)
                elif kind == "get":
                    got = store.get(torch.arange(N))
                    wrong += int((got != model).any(dim=1).sum())
                elif kind == "compact":
                    store.compact()
                elif kind == "pin":
                    pinned = store.version
                    store.pin(pinned)
                elif kind == "unpin" and pinned is not None:
                    store.unpin(pinned)
                elif kind == "reopen":
                    store.close()
                    store = _reopen(path)
                    model = _which(store, acked, candidates)
                    acked, candidates = model.clone(), []
            except StoreError:
                if store.closed:
                    store = _reopen(path)
                    model = _which(store, acked, candidates)
                    acked, candidates = model.clone(), []
        store.close()
    finally:
        fileio.FAULTS = None
    return {"wrong": wrong, "acked": acked, "candidates": candidates, "calls": faults.calls, "acks": acks}


def _reopen(path):
    for _ in range(5):
        try:
            return EmbeddingStore.open(path, hot_bytes=_hot())
        except StoreError:
            continue
    return EmbeddingStore.open(path, hot_bytes=_hot())


def _which(store, acked: torch.Tensor, candidates: list[torch.Tensor]) -> torch.Tensor:
    got = store.get(torch.arange(N))
    for state in [acked, *candidates]:
        if torch.equal(got, state):
            return state.clone()
    lost = int((got != acked).any(dim=1).sum())
    raise AssertionError(f"reopened store matches no acknowledged state: {lost} rows differ from the last acknowledged flush")


def rows_lost(path, acked: torch.Tensor, candidates: list[torch.Tensor]) -> int:
    """Rows of the reopened store (no faults) that differ from every acceptable durable state."""
    with EmbeddingStore.open(path, hot_bytes=_hot()) as s:
        got = s.get(torch.arange(N))
    best = min(int((got != st).any(dim=1).sum()) for st in [acked, *candidates])
    return best


def crash_trial(path, index: int) -> tuple[int, int, bool]:
    """Fork a child that runs the workload and is killed right after I/O call ``index``; return
    (acknowledged flushes, rows lost against the reference states, whether the kill happened)."""
    ref = _reference_states(path.with_name(path.name + "-ref"))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no cleanup, just the workload until the kill
        os.close(r)
        code = 0
        try:
            run_workload(path, KillAfter(index), on_ack=lambda k: os.write(w, b"a"))
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    os.close(w)
    acks = 0
    while chunk := os.read(r, 64):
        acks += len(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if not killed and os.WEXITSTATUS(status) != 0:
        raise AssertionError(f"the workload failed in the child without a fault (exit {os.WEXITSTATUS(status)})")
    if not path.exists() or not (path / "META").exists() or not any(p.name.startswith("manifest-") for p in path.iterdir()):
        return acks, 0, killed  # killed during create, before the store existed: nothing to lose
    if acks == 0 and not killed:
        return acks, 0, killed
    states = [torch.zeros(N, DIM)] + ref
    allowed = states[acks : acks + 2]
    return acks, rows_lost(path, allowed[0], allowed[1:]), killed


_REF: dict = {}


def _reference_states(scratch) -> list[torch.Tensor]:
    """The model after each acknowledged flush of a run without faults."""
    if _mode not in _REF:
        states: list[torch.Tensor] = []
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
        holder = {}

        class Snap(Counter):
            pass

        out = run_workload(scratch, Snap(), on_ack=lambda k: holder.setdefault("acks", []).append(k))
        # replay the schedule on a tensor: with no faults every flush acknowledges the model
        model = torch.zeros(N, DIM)
        for op in schedule():
            if op[0] == "update":
                model[torch.from_numpy(op[1])] = torch.from_numpy(op[2])
            elif op[0] == "flush":
                states.append(model.clone())
        assert len(states) == out["acks"] and torch.equal(states[-1], out["acked"])
        # How many calls a run makes depends on when background compaction and garbage
        # collection get their turns (490-824 calls in memory mode): the fewest of three runs,
        # so that a sampled point fires in most trials rather than only in runs as busy as this one.
        calls = [out["calls"]]
        for _ in range(2):
            shutil.rmtree(scratch, ignore_errors=True)
            calls.append(run_workload(scratch, Counter())["calls"])
        _REF[_mode] = {"states": states, "calls": min(calls)}
        shutil.rmtree(scratch, ignore_errors=True)
    return _REF[_mode]["states"]


def total_calls(scratch) -> int:
    _reference_states(scratch)
    return _REF[_mode]["calls"]
