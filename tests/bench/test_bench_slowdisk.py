"""`embcache bench disk --read-iops`: the throttled cgroup is set up exactly, or refused with a
message that says what is missing; it never silently runs on the unthrottled disk."""

from __future__ import annotations

import os

import pytest

from benchmarks import slowdisk


def test_a_v1_blkio_hierarchy_gets_a_group_capping_reads_of_the_paths_disk(tmp_path, monkeypatch):
    v1 = tmp_path / "blkio"
    v1.mkdir()
    (v1 / "cgroup.procs").write_text("")
    monkeypatch.setattr(slowdisk, "V1", v1)
    monkeypatch.setattr(slowdisk, "V2", tmp_path / "none")
    procs = slowdisk.throttled_cgroup(tmp_path, 1234, name="g")
    assert procs == v1 / "g" / "cgroup.procs"
    dev = os.stat(tmp_path).st_dev
    disk = slowdisk.disk_of(tmp_path)
    assert disk.split(":")[0] == str(os.major(dev))
    assert (v1 / "g" / "blkio.throttle.read_iops_device").read_text() == f"{disk} 1234"


def test_a_v2_hierarchy_gets_an_io_max_read_cap(tmp_path, monkeypatch):
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.procs").write_text("")
    (v2 / "cgroup.controllers").write_text("io memory")
    monkeypatch.setattr(slowdisk, "V1", tmp_path / "none")
    monkeypatch.setattr(slowdisk, "V2", v2)
    slowdisk.throttled_cgroup(tmp_path, 77, name="g")
    assert (v2 / "g" / "io.max").read_text() == f"{slowdisk.disk_of(tmp_path)} riops=77"


def test_without_a_block_io_cgroup_the_option_is_refused_saying_what_it_needs(tmp_path, monkeypatch):
    monkeypatch.setattr(slowdisk, "V1", tmp_path / "none1")
    monkeypatch.setattr(slowdisk, "V2", tmp_path / "none2")
    with pytest.raises(RuntimeError, match="--read-iops needs a writable block-I/O cgroup"):
        slowdisk.throttled_cgroup(tmp_path, 100)
    with pytest.raises(ValueError, match="read_iops must be a positive"):
        slowdisk.throttled_cgroup(tmp_path, 0)


def test_a_memory_limit_goes_under_this_process_s_own_memory_cgroup(tmp_path, monkeypatch):
    v1 = tmp_path / "memory"
    (v1 / "jobs" / "mine").mkdir(parents=True)
    (v1 / "cgroup.procs").write_text("")
    monkeypatch.setattr(slowdisk, "V1_MEMORY", v1)
    monkeypatch.setattr(slowdisk, "V2", tmp_path / "none")
    monkeypatch.setattr(slowdisk, "_own_cgroup", lambda controller: "jobs/mine" if controller == "memory" else "")
    procs = slowdisk.memory_cgroup(300 << 20, name="g")
    assert procs == v1 / "jobs" / "mine" / "g" / "cgroup.procs"
    assert (v1 / "jobs" / "mine" / "g" / "memory.limit_in_bytes").read_text() == str(300 << 20)
    monkeypatch.setattr(slowdisk, "V1_MEMORY", tmp_path / "none1")
    with pytest.raises(RuntimeError, match="--mem-limit-mib needs a writable memory cgroup"):
        slowdisk.memory_cgroup(1 << 20)
    with pytest.raises(ValueError, match="limit_bytes must be a positive"):
        slowdisk.memory_cgroup(0)


def test_own_cgroup_reads_the_controller_s_line_of_proc_self_cgroup():
    table = "9:name=systemd:/\n4:cpu,memory:/jobs/mine\n0::/unified/me\n"
    assert slowdisk._own_cgroup("memory", table) == "jobs/mine"
    assert slowdisk._own_cgroup("", table) == "unified/me"
    assert slowdisk._own_cgroup("blkio", table) == ""
