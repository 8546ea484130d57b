"""SQLite-style I/O fault injection: for I/O call i of a fixed workload (write, fsync, rename,
link, unlink, open), make call i fail with EIO/ENOSPC/EACCES, or kill the process right after it;
then the store must match the last acknowledged flush (0 rows lost) and no read during the run may
differ from the model (0 wrong rows). A random sample of points in the default run, every point in
`make test-slow`."""

from __future__ import annotations

import errno
import os
import random

import pytest
from _fault_workload import FailAt, crash_trial, rows_lost, run_workload, set_mode, total_calls

ERRNOS = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "EACCES": errno.EACCES}
SAMPLE = int(os.environ.get("EMBCACHE_FAULT_SAMPLE", "12"))


@pytest.fixture(params=["disk", "memory"])
def mode(request):
    set_mode(request.param)
    yield request.param
    set_mode("disk")


def _points(shm_path, k: int | None) -> list[int]:
    """Every I/O call index of the workload (``k`` None), or a seeded shuffle of them to draw a
    sample of ``k`` from: a run makes 490-824 calls depending on when background work gets its
    turn, so a drawn point may not be reached; the trials draw on until ``k`` points fired."""
    n = total_calls(shm_path / "count")
    assert n > 100, f"the workload made only {n} I/O calls"
    pts = list(range(n))
    if k is not None:
        random.Random(13).shuffle(pts)
    return pts


def _error_trials(shm_path, points, err, want: int | None = None):
    """Inject ``err`` at each of ``points`` in turn (stopping once ``want`` fired)."""
    injected = survived = lost_total = wrong_total = 0
    for tried, i in enumerate(points):
        if want is not None and (injected >= want or tried >= 3 * want):
            break
        path = shm_path / f"e{i}"
        faults = FailAt(i, err)
        out = run_workload(path, faults)
        if faults.fired is None:
            continue
        injected += 1
        lost = rows_lost(path, out["acked"], out["candidates"])
        assert out["wrong"] == 0, f"{out['wrong']} wrong rows read after {faults.fired} failed (call {i})"
        assert lost == 0, f"{lost} rows lost after {faults.fired} failed (call {i})"
        survived += 1
        wrong_total += out["wrong"]
        lost_total += lost
    return injected, survived, lost_total, wrong_total


def _crash_trials(shm_path, points, want: int | None = None):
    """Kill the workload after each of ``points`` in turn (stopping once ``want`` kills happened)."""
    killed = lost_total = 0
    for tried, i in enumerate(points):
        if want is not None and (killed >= want or tried >= 3 * want):
            break
        acks, lost, was_killed = crash_trial(shm_path / f"k{i}", i)
        assert lost == 0, f"{lost} rows lost after a kill after I/O call {i} ({acks} flushes acknowledged)"
        killed += was_killed
        lost_total += lost
    return killed, lost_total


@pytest.mark.parametrize("name", sorted(ERRNOS))
def test_an_io_error_at_sampled_points_loses_and_corrupts_nothing(shm_path, mode, name):
    injected, survived, lost, wrong = _error_trials(shm_path, _points(shm_path, SAMPLE), ERRNOS[name], SAMPLE)
    assert injected >= SAMPLE // 2 and survived == injected and lost == wrong == 0


def test_a_kill_after_sampled_points_loses_nothing(shm_path, mode):
    killed, lost = _crash_trials(shm_path, _points(shm_path, SAMPLE), SAMPLE)
    assert killed >= SAMPLE // 2 and lost == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ERRNOS))
def test_an_io_error_at_every_point_loses_and_corrupts_nothing(shm_path, mode, name):
    injected, survived, lost, wrong = _error_trials(shm_path, _points(shm_path, None), ERRNOS[name])
    print(f"\nFAULTS {mode} {name}: points={len(_points(shm_path, None))} injected={injected} survived={survived} rows_lost={lost} wrong_rows={wrong}")
    assert survived == injected and lost == wrong == 0


@pytest.mark.slow
def test_a_kill_after_every_point_loses_nothing(shm_path, mode):
    pts = _points(shm_path, None)
    killed, lost = _crash_trials(shm_path, pts)
    print(f"\nKILLS {mode}: points={len(pts)} killed={killed} rows_lost={lost}")
    assert lost == 0
