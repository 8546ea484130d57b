"""Run `_matrix_script.py` (Lightning re-runs it for the other ranks) and read what each rank wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

SCRIPT = Path(__file__).with_name("_matrix_script.py")


def launch(root: Path, name: str, timeout: float = 600, expect_ok: bool = True, **cfg: Any) -> dict[str, Any]:
    """One fit with config `cfg` under `root/name`; returns {"proc", "ranks": [rank0.pt, ...], "out"}."""
    out = root / name
    cfg = {"out": str(out), **cfg}
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out / "config.json"
    cfg_file.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOBAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(cfg_file)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(SCRIPT.parent))
    if expect_ok:
        assert proc.returncode == 0 and (out / "result.json").exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(p, weights_only=False) for p in sorted(out.glob("rank[0-9].pt"))]
    resumed = [torch.load(p, weights_only=False) for p in sorted(out.glob("rank[0-9]_resumed.pt"))]
    return {"proc": proc, "ranks": ranks, "resumed": resumed, "out": out}


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a["rows"][k] - b["rows"][k]).abs().max()) for k in a["rows"])
