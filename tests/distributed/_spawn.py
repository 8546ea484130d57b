"""Run a function on N real Gloo processes (torch.multiprocessing.spawn) and surface failures."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any) -> None:
    """`fn(rank, world_size, *args)` on `world_size` Gloo processes; raises if any rank fails."""
    mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True,
                       start_method="spawn")
