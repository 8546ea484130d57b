"""The strategy matrix on CPU: precision x compile x {single device, DDP over 2 Gloo processes}.
Each cell fits 2 epochs with DeferredSync, MemoryPressure, StepProfiler and ModelCheckpoint, then
resumes from the first epoch's checkpoint: every row of both stores on every rank must equal the
uninterrupted fit's. FSDP cells are refused by Lightning on CPU (asserted here) and run on GPU
through `_matrix.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _matrix import COMPILE, PRECISIONS, run_cell, why_not  # noqa: E402


def _cells():
    for strategy in ("single", "ddp"):
        for precision in PRECISIONS:
            for compile in COMPILE:
                cell = (strategy, precision, compile)
                marks = [pytest.mark.slow]  # each cell launches 2-4 fresh interpreters: 15-90 s
                yield pytest.param(*cell, marks=marks, id=f"{strategy}-{precision}-compile{'On' if compile else 'Off'}")


@pytest.mark.parametrize("strategy,precision,compile", list(_cells()))
def test_cell_fits_and_resumes_to_the_same_rows(tmp_path, strategy, precision, compile):
    result = run_cell(tmp_path, strategy, precision, compile)
    assert result["status"] == "pass", result
    assert result["world"] == (2 if strategy == "ddp" else 1)


def test_fsdp_cells_are_refused_on_cpu_and_say_why():
    assert "CUDA" in why_not("fsdp", "32-true", False, "cpu")
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", strategy="fsdp", devices=2, logger=False)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gpu_cell_fits_and_resumes_to_the_same_rows(tmp_path, strategy):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.fail("needs 2 CUDA devices")
    result = run_cell(tmp_path, strategy, "bf16-mixed", False, accelerator="cuda", devices=2, tol=1e-5)
    assert result["status"] == "pass", result
