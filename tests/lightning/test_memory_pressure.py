"""MemoryPressure with injected readings, and the memory reader on fake cgroup v1/v2 trees."""

from __future__ import annotations

import builtins
import os
import time
from pathlib import Path
from unittest import mock

import psutil
import pytest
from _lightning_helpers import tiny_model, tiny_trainer

from lightning_embcache import MemoryPressure
from lightning_embcache.lightning.memory_reading import MemoryReader, MemoryReading

GiB, MiB = 1 << 30, 1 << 20


def reading(fraction: float, total: int = 8 * GiB, rss: int = 100 * MiB) -> MemoryReading:
    return MemoryReading(total, int(total * (1 - fraction)), rss)


class Readings:
    def __init__(self, *fractions: float, total: int = 8 * GiB) -> None:
        self.fractions, self.total, self.calls = list(fractions), total, 0

    def __call__(self) -> MemoryReading:
        f = self.fractions[min(self.calls, len(self.fractions) - 1)]
        self.calls += 1
        return reading(f, self.total)


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="high=1.5"):
        MemoryPressure(high=1.5)
    with pytest.raises(ValueError, match="target=0.9"):
        MemoryPressure(high=0.85, target=0.9)
    with pytest.raises(ValueError, match="check_every_n_steps=0"):
        MemoryPressure(check_every_n_steps=0)


def test_checks_every_n_steps_and_logs_its_keys(tmp_path):
    readings = Readings(0.5)
    logger = mock.Mock()
    logger.save_dir = logger.log_dir = str(tmp_path)
    cb = MemoryPressure(check_every_n_steps=3, reader=readings)
    tiny_trainer(tmp_path, callbacks=[cb], max_steps=10, logger=logger).fit(tiny_model(tmp_path / "latents"))
    assert readings.calls == 3
    logged = [c.args[0] for c in logger.log_metrics.call_args_list if "embcache/mem_used_fraction" in c.args[0]]
    assert len(logged) == 3
    assert set(logged[0]) == {"embcache/mem_used_fraction", "embcache/rss_bytes", "embcache/evicted_bytes"}
    assert logged[0]["embcache/mem_used_fraction"] == pytest.approx(0.5)
    assert logged[0]["embcache/evicted_bytes"] == 0


def _pl_module_with(*handles):
    return mock.Mock(embedding_stores={h.name: h for h in handles})


def _handle(name: str, hot: int, evictable: int, budget: int):
    h = mock.Mock()
    h.name, h.path = name, Path("/x") / name
    h._is_open.return_value = True
    h.stats.return_value = mock.Mock(hot_bytes=hot, warm_bytes=0, hot_budget_bytes=budget)
    h.store.evict.side_effect = lambda n: min(n, evictable)
    return h


def test_eviction_follows_the_excess_and_is_shared_by_resident_bytes():
    a, b = _handle("a", 300 * MiB, 10 * GiB, 400 * MiB), _handle("b", 100 * MiB, 10 * GiB, 400 * MiB)
    trainer = mock.Mock(loggers=[], global_step=50)
    cb = MemoryPressure(high=0.85, target=0.75, reader=lambda: reading(0.90, total=10 * GiB))
    freed = cb.check(trainer, _pl_module_with(a, b))
    need = int(0.15 * 10 * GiB)
    assert freed == pytest.approx(need, abs=2)
    assert a.store.evict.call_args.args[0] == pytest.approx(need * 3 / 4, abs=1)
    assert b.store.evict.call_args.args[0] == pytest.approx(need / 4, abs=1)
    # further over: asks for more
    cb2 = MemoryPressure(reader=lambda: reading(0.99, total=10 * GiB))
    assert cb2.check(trainer, _pl_module_with(_handle("c", 1, 100 * GiB, 1))) > freed
    # below high: nothing
    cb3 = MemoryPressure(reader=lambda: reading(0.80, total=10 * GiB))
    d = _handle("d", 1, 1, 1)
    assert cb3.check(trainer, _pl_module_with(d)) == 0 and not d.store.evict.called


def test_budgets_are_lowered_and_a_warning_given_once_when_eviction_is_not_enough():
    a = _handle("a", 200 * MiB, 50 * MiB, 256 * MiB)
    trainer = mock.Mock(loggers=[], global_step=50)
    cb = MemoryPressure(high=0.85, target=0.75, reader=lambda: reading(0.95, total=4 * GiB), min_hot_bytes=16 * MiB)
    with pytest.warns(UserWarning, match=r"memory at 95% of 4096 MiB.*freed 50 MiB of the 819 MiB.*'a' 256 MiB -> 16 MiB"):
        cb.check(trainer, _pl_module_with(a))
    a.store.set_budget.assert_called_once_with(hot_bytes=16 * MiB)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb._reader = lambda: reading(0.97, total=4 * GiB)  # other figures: still no second warning
        cb.check(trainer, _pl_module_with(a))
    assert cb.budget_cuts == 2


def test_a_real_disk_store_shrinks_under_injected_pressure(tmp_path):
    readings = Readings(0.5, 0.5, 0.99, total=1 * MiB)  # pressure at the 3rd check: evict ~0.24 MiB
    cb = MemoryPressure(check_every_n_steps=2, reader=readings, min_hot_bytes=4096)
    model = tiny_model(tmp_path / "latents", hot_bytes=32 * 1024)
    hot = []

    from lightning.pytorch.callbacks import Callback

    class Watch(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            hot.append(pl_module.latents.stats().hot_bytes)

    # Pressure from the 3rd check (step 6) on; a store busy with background work at that moment
    # defers the relief to the next check (never raises), so a few more checks follow.
    tiny_trainer(tmp_path, callbacks=[cb, Watch()], max_steps=12).fit(model)
    assert cb.evicted_bytes_total > 0, f"nothing evicted; {cb.deferred} reliefs deferred"
    assert min(hot[5:]) < hot[4]


# ---------------------------------------------------------------------- reader and cgroup files
def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_cgroup_v2_limit_of_a_parent_binds_and_page_cache_is_not_pressure(tmp_path):
    fs = tmp_path / "cgroup"
    _write(tmp_path, "proc_cgroup", "0::/kubepods/pod1/ctr\n")
    _write(fs, "cgroup.controllers", "memory cpu\n")
    _write(fs, "kubepods/pod1/ctr/memory.max", "max\n")
    _write(fs, "kubepods/pod1/ctr/memory.current", str(700 * MiB))
    _write(fs, "kubepods/pod1/ctr/memory.stat", f"anon 1\ninactive_file {50 * MiB}\n")
    _write(fs, "kubepods/pod1/memory.max", str(1 * GiB))
    _write(fs, "kubepods/pod1/memory.current", str(900 * MiB))
    _write(fs, "kubepods/pod1/memory.stat", f"inactive_file {100 * MiB}\nactive_file 5\n")
    r = MemoryReader(cgroup_root=fs, proc_cgroup=tmp_path / "proc_cgroup")()
    assert r.cgroup_limit == 1 * GiB and r.cgroup_usage == 800 * MiB
    assert r.used_fraction == pytest.approx(800 / 1024)
    assert r.limit_bytes == 1 * GiB or r.system_fraction > r.cgroup_fraction


def test_cgroup_v2_namespace_root(tmp_path):
    fs = tmp_path / "cgroup"
    _write(tmp_path, "proc_cgroup", "0::/\n")
    _write(fs, "memory.max", str(2 * GiB))
    _write(fs, "memory.current", str(1 * GiB))
    r = MemoryReader(cgroup_root=fs, proc_cgroup=tmp_path / "proc_cgroup")()
    assert (r.cgroup_limit, r.cgroup_usage) == (2 * GiB, 1 * GiB)


def test_cgroup_v1_memory_controller_and_unlimited(tmp_path):
    fs = tmp_path / "cgroup"
    _write(tmp_path, "proc_cgroup", "12:cpu,cpuacct:/slurm/job_7\n4:memory:/slurm/uid_0/job_7\n0::/\n")
    job = "memory/slurm/uid_0/job_7/"
    _write(fs, job + "memory.limit_in_bytes", str(4 * GiB))
    _write(fs, job + "memory.usage_in_bytes", str(3 * GiB))
    _write(fs, job + "memory.stat", f"cache 9\ntotal_inactive_file {512 * MiB}\nhierarchical_memory_limit {8 * GiB}\n")
    r = MemoryReader(cgroup_root=fs, proc_cgroup=tmp_path / "proc_cgroup")()
    assert (r.cgroup_limit, r.cgroup_usage) == (4 * GiB, 3 * GiB - 512 * MiB)
    _write(fs, job + "memory.limit_in_bytes", "9223372036854771712")
    _write(fs, job + "memory.stat", "total_inactive_file 0\nhierarchical_memory_limit 9223372036854771712\n")
    r = MemoryReader(cgroup_root=fs, proc_cgroup=tmp_path / "proc_cgroup")()
    assert r.cgroup_limit is None and r.used_fraction == r.system_fraction


def test_no_cgroup_files_means_machine_memory_only(tmp_path):
    r = MemoryReader(cgroup_root=tmp_path / "none", proc_cgroup=tmp_path / "missing")()
    assert r.cgroup_limit is None and 0 < r.used_fraction < 1 and r.rss_bytes > 0


def test_workers_count_towards_rss_and_a_check_is_cheap():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    try:
        alone, with_workers = MemoryReader(include_workers=False), MemoryReader(include_workers=True)
        deadline = time.time() + 20
        while with_workers().rss_bytes - alone().rss_bytes < 60 * MiB and time.time() < deadline:
            time.sleep(0.1)
        assert with_workers().rss_bytes - alone().rss_bytes >= 60 * MiB
        # Cheap: a check reads this process's and its children's /proc entries, never every
        # process's on the machine (psutil's children() scan). Counted, not timed.
        mine = psutil.Process()

        def ours() -> set[str]:
            return {str(p) for p in (mine.pid, *(c.pid for c in mine.children(recursive=True)))}

        pids = ours()  # (a test's leftover processes are this process's children too: counted)
        seen: list[str] = []
        real_open, real_listdir = builtins.open, os.listdir

        def spy_open(file, *args, **kwargs):
            seen.append(str(file))
            return real_open(file, *args, **kwargs)

        def spy_listdir(path="."):
            seen.append(str(path))
            return real_listdir(path)

        with mock.patch("builtins.open", spy_open), mock.patch("os.listdir", spy_listdir):
            for _ in range(10):
                with_workers()
        pids |= ours()
        other = [p for p in seen if p.startswith("/proc/") and p.split("/")[2].isdigit() and p.split("/")[2] not in pids]
        assert not other, f"a check read other processes' /proc entries: {sorted(set(other))[:5]}"
        assert "/proc" not in [p.rstrip("/") for p in seen], "a check listed every process on the machine"
        tasks = sum(len(os.listdir(f"/proc/{p}/task")) for p in pids if os.path.isdir(f"/proc/{p}"))
        assert len(seen) <= 10 * (tasks + 20), f"{len(seen) / 10:.0f} files per check, {tasks} threads"
    finally:
        child.kill()
        child.wait()
