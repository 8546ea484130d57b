"""Run functions on N real Gloo processes (torch.multiprocessing, spawn) and surface failures.

`run_ranks` starts fresh processes per call; `RankPool` keeps one group of processes alive for a
whole test module (starting two interpreters that import torch costs seconds on a small CI box),
runs each test's function on every rank, and re-raises the first rank's failure in the test.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":  # one GPU per rank
        import torch

        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, backend: str = "gloo") -> None:
    """`fn(rank, world_size, *args)` on `world_size` processes (Gloo; or NCCL, rank r on GPU r);
    raises if any rank fails."""
    mp.start_processes(_entry, args=(fn, world_size, free_port(), args, backend), nprocs=world_size, join=True,
                       start_method="spawn")


def _serve(rank: int, world_size: int, port: int, jobs: Any, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        while True:
            job = jobs[rank].get()
            if job is None:
                return
            fn, args = job
            try:
                fn(rank, world_size, *args)
                results.put((rank, None))
            except BaseException:
                results.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """`world_size` Gloo processes that run one function at a time on every rank."""

    def __init__(self, world_size: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [ctx.Process(target=_serve, args=(r, world_size, port, self._jobs, self._results), daemon=True)
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> None:
        for q in self._jobs:
            q.put((fn, args))
        errors: dict[int, str] = {}
        try:
            for _ in range(self.world_size):
                rank, err = self._results.get(timeout=timeout)
                if err is not None:
                    errors[rank] = err
        except Exception as exc:  # a rank left waiting in a collective: start a fresh group
            errors[-1] = f"no answer within {timeout} s ({type(exc).__name__})"
        if errors:
            self.close(force=True)
            self.__init__(self.world_size)  # type: ignore[misc]
            raise AssertionError("\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items())))

    def close(self, force: bool = False) -> None:
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(0 if force else 30)
            if p.is_alive():
                p.kill()
                p.join(10)
