"""One reading of memory use: the machine (psutil), this process and its workers, and its cgroup.

psutil sees the machine, not the container: in a Kubernetes pod or a Slurm job the cgroup limit
is what the OOM killer enforces, so the cgroup's own files are read too.

cgroup v2: ``/proc/self/cgroup`` has ``0::/<path>``; ``<root>/<path>/memory.max`` (``max`` = no
limit) and ``memory.current``. Every ancestor up to ``<root>`` is checked, since a parent's
limit binds as well. cgroup v1: the ``memory`` line of ``/proc/self/cgroup`` gives the path under
``<root>/memory``; ``memory.limit_in_bytes`` (a huge number = no limit) and
``memory.usage_in_bytes``, and ``hierarchical_memory_limit`` in ``memory.stat``.
Usage counts the working set, ``usage - inactive_file`` as kubelet and ``docker stats`` do: the
page cache of store files that the kernel can drop is not pressure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

# v1 reports "no limit" as PAGE_COUNTER_MAX rounded to pages; anything this large is no limit.
_NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class MemoryReading:
    """Bytes; cgroup fields are None outside a memory-limited cgroup."""

    system_total: int
    system_available: int
    rss_bytes: int  # this process + its worker children (sum of RSS: shared pages counted per process)
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None

    @property
    def system_fraction(self) -> float:
        return 1.0 - self.system_available / self.system_total if self.system_total else 0.0

    @property
    def cgroup_fraction(self) -> float | None:
        if not self.cgroup_limit or self.cgroup_usage is None:
            return None
        return self.cgroup_usage / self.cgroup_limit

    @property
    def used_fraction(self) -> float:
        """The tighter of machine and cgroup: the share of the binding limit in use."""
        cg = self.cgroup_fraction
        return max(self.system_fraction, cg) if cg is not None else self.system_fraction

    @property
    def limit_bytes(self) -> int:
        """Size of the binding limit, to turn a fraction over target into bytes."""
        cg = self.cgroup_fraction
        if cg is not None and cg >= self.system_fraction and self.cgroup_limit:
            return self.cgroup_limit
        return self.system_total


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


class CgroupMemory:
    """Finds this process's memory cgroup once; each :meth:`read` then reads 2-3 small files per level."""

    def __init__(
        self, root: str | os.PathLike[str] = "/sys/fs/cgroup", proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup"
    ) -> None:
        self.root = Path(root)
        self.version: int | None = None
        self.dirs: list[Path] = []  # v2: leaf first, then ancestors; v1: the one memory dir
        try:
            lines = Path(proc_cgroup).read_text().splitlines()
        except OSError:
            return
        v1_path = v2_path = None
        for line in lines:
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            hid, controllers, path = parts
            if "memory" in controllers.split(","):
                v1_path = path
            elif hid == "0" and controllers == "":
                v2_path = path
        if v1_path is not None and (self.root / "memory").is_dir():
            self.version = 1
            leaf = self.root / "memory" / v1_path.lstrip("/")
            self.dirs = [leaf if leaf.is_dir() else self.root / "memory"]
        elif v2_path is not None:
            self.version = 2
            leaf = self.root / v2_path.lstrip("/")
            if not leaf.is_dir():  # cgroup namespace: our cgroup is mounted at the root
                leaf = self.root
            d = leaf
            while True:
                self.dirs.append(d)
                if d == self.root or self.root not in d.parents:
                    break
                d = d.parent

    def read(self) -> tuple[int | None, int | None]:
        """(limit, working-set usage) of the tightest memory limit, or (None, None) if unlimited."""
        best: tuple[float, int, int] | None = None
        for d in self.dirs:
            if self.version == 2:
                limit = _read_int(d / "memory.max")
                usage = _read_int(d / "memory.current")
                inactive = _read_stat(d / "memory.stat").get("inactive_file", 0) if limit else 0
            else:
                limit = _read_int(d / "memory.limit_in_bytes")
                usage = _read_int(d / "memory.usage_in_bytes")
                stat = _read_stat(d / "memory.stat")
                hier = stat.get("hierarchical_memory_limit")
                if hier is not None and (limit is None or hier < limit):
                    limit = hier
                inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
            if limit is None or limit >= _NO_LIMIT or usage is None or limit <= 0:
                continue
            working = max(usage - inactive, 0)
            fraction = working / limit
            if best is None or fraction > best[0]:
                best = (fraction, limit, working)
        if best is None:
            return None, None
        return best[1], best[2]


class MemoryReader:
    """Reads a :class:`MemoryReading`; call it. Construct once: it caches the process and cgroup lookups.

    Cost per call, measured on a 2-core VM: see docs/lightning.md (about 1 ms: machine memory
    0.1 ms, own RSS 0.03 ms, children via ``/proc/<pid>/task/*/children`` plus one ``statm`` read
    each, cgroup files 0.1-0.5 ms).
    """

    def __init__(
        self,
        include_workers: bool = True,
        cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
        proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
    ) -> None:
        self.include_workers = include_workers
        self.cgroup = CgroupMemory(cgroup_root, proc_cgroup)
        self._process = psutil.Process()

    def __call__(self) -> MemoryReading:
        vm = psutil.virtual_memory()
        rss = self._process.memory_info().rss
        if self.include_workers:
            rss += self._children_rss()
        limit, usage = self.cgroup.read()
        return MemoryReading(int(vm.total), int(vm.available), int(rss), limit, usage)

    def _children_rss(self) -> int:
        # /proc/<pid>/task/<tid>/children costs O(children); psutil's children() reads the stat
        # file of every process on the machine (5 ms with 90 processes), so it is only the fallback.
        pids = _descendants(self._process.pid)
        if pids is None:
            pids = [c.pid for c in self._process.children(recursive=True)]
        total = 0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * _PAGE
            except (OSError, IndexError, ValueError):  # a worker that just exited
                pass
        return total


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _descendants(pid: int) -> list[int] | None:
    """Child processes of `pid`, recursively, from /proc/<pid>/task/*/children; None where unsupported."""
    found: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            if p == pid:
                return None
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children", "rb") as f:
                    kids = [int(x) for x in f.read().split()]
            except FileNotFoundError:
                if p == pid and not os.path.exists(f"/proc/{p}/task/{tid}"):
                    continue  # the thread ended
                if p == pid:
                    return None  # kernel without CONFIG_PROC_CHILDREN
                continue
            except OSError:
                continue
            found += kids
            todo += kids
    return found
