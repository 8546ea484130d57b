"""A slower disk for benchmarks: run a process inside a block-I/O-throttled cgroup, and a table
far beyond the page cache: inside a memory-limited one.

The development VMs' disks are cached by their hosts, so a "cold" read is served almost as fast
as the page cache and nothing is left for a lookahead prefetch to hide. The kernel's block
throttle (cgroup v1 ``blkio.throttle.read_iops_device``, v2 ``io.max riops=``) caps the read
operations per second the processes of a cgroup may issue to one disk: a network volume or a
busy SSD, on the same files. A memory limit (cgroup v1 ``memory.limit_in_bytes``, v2
``memory.max``) bounds the page cache the process's reads may fill, so a table a few times the
limit behaves as one far beyond RAM: its rows are read from the disk again after they were
evicted. Needs root (or a delegated cgroup); Linux only.
"""

from __future__ import annotations

import os
from pathlib import Path

V1 = Path("/sys/fs/cgroup/blkio")
V1_MEMORY = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def disk_of(path: str | os.PathLike) -> str:
    """``major:minor`` of the whole disk holding ``path`` (the throttle applies to disks, not
    partitions)."""
    dev = os.stat(path).st_dev
    ident = f"{os.major(dev)}:{os.minor(dev)}"
    sysfs = Path("/sys/dev/block") / ident
    if (sysfs / "partition").exists():
        ident = (sysfs.resolve().parent / "dev").read_text().strip()
    return ident


def _make_group(candidates: list[tuple[Path, Path, str, str]], refusal: str) -> Path:
    """The first of ``candidates`` (hierarchy root, group folder, knob, value; v1 first) whose
    hierarchy is mounted and lets us make the group and set the knob: its ``cgroup.procs``.
    RuntimeError ``refusal`` plus what failed otherwise."""
    errors = []
    for root, group, knob, value in candidates:
        if not (root / "cgroup.procs").exists() or (root is V2 and not (root / "cgroup.controllers").exists()):
            continue
        try:
            group.mkdir(exist_ok=True)
            (group / knob).write_text(value)
            return group / "cgroup.procs"
        except OSError as exc:
            errors.append(f"{group / knob}: {exc}")
    raise RuntimeError(f"{refusal}; could not set one up: {'; '.join(errors) or 'no such cgroup hierarchy found'}")


def throttled_cgroup(path: str | os.PathLike, read_iops: int, name: str = "embcache-bench-slowdisk") -> Path:
    """Create (or reuse) cgroup ``name`` whose reads from ``path``'s disk are capped at
    ``read_iops`` per second; returns its ``cgroup.procs`` file (write a pid there to move that
    process in). Raises RuntimeError saying what is missing when the host does not allow it."""
    if read_iops <= 0:
        raise ValueError(f"read_iops must be a positive number of reads per second; got {read_iops}")
    disk = disk_of(path)
    return _make_group([(V1, V1 / name, "blkio.throttle.read_iops_device", f"{disk} {read_iops}"),
                        (V2, V2 / name, "io.max", f"{disk} riops={read_iops}")],
                       "--read-iops needs a writable block-I/O cgroup (root on Linux, cgroup v1 blkio or v2 io "
                       "controller)")


def _own_cgroup(controller: str, table: str | None = None) -> str:
    """This process's cgroup path for ``controller`` (v1; "" asks for the v2 path), from
    ``/proc/self/cgroup`` (or ``table``, text in its format); "" if none."""
    text = Path("/proc/self/cgroup").read_text() if table is None else table
    for line in text.splitlines():
        _, names, where = line.split(":", 2)
        if controller in names.split(",") or (not names and controller == ""):
            return where.lstrip("/")
    return ""


def memory_cgroup(limit_bytes: int, name: str = "embcache-bench-memory") -> Path:
    """Create (or reuse) cgroup ``name`` under this process's memory cgroup, limited to
    ``limit_bytes`` of memory (the process's own and the page cache its reads fill); returns its
    ``cgroup.procs``. Raises RuntimeError saying what is missing when the host does not allow it."""
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be a positive number of bytes; got {limit_bytes}")
    limit = str(int(limit_bytes))
    return _make_group([(V1_MEMORY, V1_MEMORY / _own_cgroup("memory") / name, "memory.limit_in_bytes", limit),
                        (V2, V2 / _own_cgroup("") / name, "memory.max", limit)],
                       "--mem-limit-mib needs a writable memory cgroup (root on Linux, cgroup v1 memory or v2 "
                       "memory controller)")


def enter(*procs: Path) -> None:
    """Move the calling process into the cgroups of ``procs`` (a `subprocess` ``preexec_fn``)."""
    for p in procs:
        p.write_text(str(os.getpid()))
