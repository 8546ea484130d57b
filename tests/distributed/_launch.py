"""Run `_matrix_script.py` (Lightning re-runs it for the other ranks) and read what each rank wrote.

`launch` runs one machine's ranks; `launch_nodes` simulates several nodes on this machine: one
`_matrix_script.py` per node (``NODE_RANK=r``, a shared ``MASTER_ADDR``/``MASTER_PORT``, Lightning's
launcher starting the node's other ranks), each in its own working folder ``<root>/node<r>``
so that a relative store path resolves to node-local shards, as on separate machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

SCRIPT = Path(__file__).with_name("_matrix_script.py")
REPO = Path(__file__).resolve().parents[2]  # the checkout under test, also in a git worktree


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOBAL_RANK"):
        env.pop(k, None)
    # the ranks import this checkout's package, not the one the venv was installed from
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def launch(root: Path, name: str, timeout: float = 600, expect_ok: bool = True, **cfg: Any) -> dict[str, Any]:
    """One fit with config `cfg` under `root/name`; returns {"proc", "ranks": [rank0.pt, ...], "out"}."""
    out = root / name
    cfg = {"out": str(out), **cfg}
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out / "config.json"
    cfg_file.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(cfg_file)], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=str(SCRIPT.parent))
    if expect_ok:
        assert proc.returncode == 0 and (out / "result.json").exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return {"proc": proc, **_results(out)}


def launch_nodes(root: Path, name: str, nodes: int = 2, timeout: float = 600, expect_ok: bool = True,
                 **cfg: Any) -> dict[str, Any]:
    """One fit over `nodes` simulated nodes of ``cfg["devices"]`` ranks each, every node started
    in its own session (so a kill -9 of a node's process group takes all its ranks) and working
    folder ``root/node<r>`` (give a relative ``path`` for node-local stores; ``ckpt_dir``
    absolute for the shared checkpoint folder). Returns {"procs", "ranks", "resumed", "out", "log"}."""
    from _spawn import free_port

    out = root / name
    cfg = {"out": str(out), "num_nodes": nodes, **cfg}
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out / "config.json"
    cfg_file.write_text(json.dumps(cfg))
    port = str(free_port())
    procs, logs = [], []
    for r in range(nodes):
        where = root / f"node{r}"  # the node's own disk: the same for every launch of a test
        where.mkdir(exist_ok=True)
        log = open(out / f"node{r}.log", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        env = {**_env(), "NODE_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(cfg_file)], stdout=log,
                                      stderr=subprocess.STDOUT, env=env, cwd=str(where), start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:  # a node left waiting for a dead peer: end its whole process group
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        for log in logs:
            log.close()
    text = "".join(f"--- node {r}\n" + (out / f"node{r}.log").read_text()[-6000:] for r in range(nodes))
    if expect_ok:
        assert all(p.returncode == 0 for p in procs) and (out / "result.json").exists(), text
    return {"procs": procs, "log": text, **_results(out)}


def _results(out: Path) -> dict[str, Any]:
    ranks = [torch.load(p, weights_only=False) for p in sorted(out.glob("rank[0-9].pt"))]
    resumed = [torch.load(p, weights_only=False) for p in sorted(out.glob("rank[0-9]_resumed.pt"))]
    return {"ranks": ranks, "resumed": resumed, "out": out}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a["rows"][k] - b["rows"][k]).abs().max()) for k in a["rows"])
