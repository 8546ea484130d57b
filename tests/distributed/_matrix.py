"""The strategy matrix: precision x compile x strategy, each cell a fit with all three callbacks and a
checkpoint, then a resume from the first epoch's checkpoint that must end where the fit did.

    python tests/distributed/_matrix.py --accelerator cuda --devices 2 --out matrix.json [--cells ...]

prints one line per cell and writes {cell: {status, step_ms, note}}; the pytest cells in
test_strategy_matrix.py run the same `run_cell`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _launch import launch, max_diff  # noqa: E402

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
COMPILE = (False, True)
STRATEGIES = ("single", "ddp", "fsdp")


def cell_name(strategy: str, precision: str, compile: bool) -> str:
    return f"{strategy}/{precision}/compile-{'on' if compile else 'off'}"


def why_not(strategy: str, precision: str, compile: bool, accelerator: str) -> str | None:
    """Why a cell cannot run on this accelerator (it is then reported, never skipped silently)."""
    if strategy == "fsdp" and accelerator == "cpu":
        return "Lightning's FSDP strategy requires a CUDA accelerator (ValueError at Trainer construction)"
    return None


def run_cell(root: Path, strategy: str, precision: str, compile: bool, accelerator: str = "cpu",
             devices: int = 2, tol: float = 0.0) -> dict[str, Any]:
    """Fit 2 epochs (checkpoint each epoch), then in the same processes resume a fresh model from
    epoch 0's checkpoint; every row of both stores on every rank must end where the fit did."""
    cfg: dict[str, Any] = dict(accelerator=accelerator, precision=precision, compile=compile, epochs=2)
    world = 1
    if strategy != "single":
        cfg.update(strategy=strategy, devices=devices)
        world = devices
    t0 = time.perf_counter()
    run = launch(root, "cell", path=str(root / "s"), ckpt_dir=str(root / "ck"), ckpt_dir_after=str(root / "ck2"),
                 resume_after=str(root / "ck" / f"epoch=0-step={16 // world}.ckpt"), **cfg)
    assert len(run["ranks"]) == len(run["resumed"]) == world, run["proc"].stderr[-3000:]
    diff = max(max_diff(a, b) for a, b in zip(run["ranks"], run["resumed"]))
    r0 = run["ranks"][0]
    note = ""
    if precision == "16-mixed" and accelerator == "cpu":
        note = "Lightning runs 16-mixed as bf16-mixed on CPU (fp16 AMP is CUDA-only)"
    return {"status": "pass" if diff <= tol else "FAIL", "resume_max_diff": diff, "step_ms": 1e3 * r0["step_s"],
            "world": r0["world"], "wall_s": time.perf_counter() - t0, "note": note}


def table(files: list[str], label: str) -> str:
    """Markdown rows (one per cell) from result files of `main`."""
    lines = []
    for f in files:
        for name, r in json.loads(Path(f).read_text()).items():
            step = f"{r['step_ms']:.1f}" if "step_ms" in r else "-"
            diff = f"{r['resume_max_diff']:.1e}" if "resume_max_diff" in r else "-"
            lines.append(f"| {label} | {name} | {r['status']} | {step} | {diff} | {r.get('note', '')} |")
    return "\n".join(lines)


def merge(out: str, files: list[str]) -> None:
    """One result file from several lanes; a cell no lane finished is reported as such."""
    results: dict[str, Any] = {}
    for f in files:
        results.update(json.loads(Path(f).read_text()))
    merged = {}
    for strategy in STRATEGIES:
        for precision in PRECISIONS:
            for compile in COMPILE:
                name = cell_name(strategy, precision, compile)
                merged[name] = results.get(name, {"status": "did not finish",
                                                  "note": "its lane was stopped at the run's time limit"})
    Path(out).write_text(json.dumps(merged, indent=1))


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--table"]:
        print(table(sys.argv[3:], sys.argv[2]))
        return 0
    if argv is None and sys.argv[1:2] == ["--merge"]:
        merge(sys.argv[2], sys.argv[3:])
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--cells", nargs="*", default=None, help="strategy/precision/compile-on|off names")
    p.add_argument("--tol", type=float, default=0.0)
    args = p.parse_args(argv)
    results: dict[str, Any] = {}
    out = Path(args.out)
    for strategy in STRATEGIES:
        for precision in PRECISIONS:
            for compile in COMPILE:
                name = cell_name(strategy, precision, compile)
                if args.cells and name not in args.cells:
                    continue
                reason = why_not(strategy, precision, compile, args.accelerator)
                if reason:
                    results[name] = {"status": "cannot run", "note": reason}
                else:
                    with tempfile.TemporaryDirectory() as tmp:
                        try:
                            results[name] = run_cell(Path(tmp), strategy, precision, compile, args.accelerator,
                                                     args.devices, args.tol)
                        except Exception as exc:  # a failed cell is a result, with its reason
                            results[name] = {"status": "FAIL", "note": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
                print(name, json.dumps(results[name])[:300], flush=True)
                out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
