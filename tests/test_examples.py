"""Every example runs at a small size, and the notebook executes headless with no error.

The examples are what a new user copies first; each run here checks the claim the example makes
(trained rows, a resume that reopens the checkpoint's version, a bank that learns neighbours).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_autodecoder_trains_evaluates_and_resumes(tmp_path, capsys):
    load("autodecoder").main(["--samples", "1200", "--epochs", "2", "--root", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "validate: [{'val_loss'" in out
    assert "resumed from epoch=0-step=3.ckpt -> store version" in out


def test_autodecoder_refuses_a_non_empty_root(tmp_path):
    (tmp_path / "keep").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        load("autodecoder").main(["--root", str(tmp_path)])
    assert (tmp_path / "keep").exists()


def test_trainable_latents_trains_every_row_and_predicts(capsys):
    load("trainable_latents").main(["--samples", "1200", "--epochs", "1"])
    out = capsys.readouterr().out
    assert "rows trained: 1200 of 1200" in out and "predict: mean squared error" in out


def test_memory_bank_learns_neighbours():
    result = load("memory_bank").main(["--samples", "1500", "--epochs", "2", "--negatives", "64"])
    assert result["after"] > max(0.5, result["before"] + 0.2), result


@pytest.mark.slow  # a subprocess importing Lightning: ~5-10 s on 2 cores
def test_profile_training_prints_the_phases():
    got = subprocess.run([sys.executable, str(EXAMPLES / "profile_training.py"), "--batches", "30", "--epochs", "1",
                          "--load-ms", "0.5", "--loop-ms", "0.2"], capture_output=True, text=True, timeout=240)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "dominant:" in got.stdout


def test_the_notebook_runs_headless_at_a_small_size(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(EXAMPLES / "autodecoder.ipynb", as_version=4)
    stored = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("outputs") for c in stored[3:]), "the notebook is stored with its outputs"
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in stored for o in c.get("outputs", [])), "the profiler chart is stored inline"
    (params,) = [c for c in stored if "parameters" in c.metadata.get("tags", [])]
    params.source = f"from pathlib import Path\nN = 1200\nEPOCHS = 2\nROOT = Path({str(tmp_path)!r})\n"
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "resumed from epoch=0-step=3.ckpt" in text and "val_loss" in text
    assert (tmp_path / "phases.png").stat().st_size > 1000


def test_fit_new_samples_fits_only_the_new_codes(tmp_path):
    result = load("fit_new_samples").main(["--samples", "600", "--new", "60", "--epochs", "4", "--fit-epochs", "15",
                                           "--root", str(tmp_path)])
    assert result["untouched"] == 1.0 and result["frozen"] == 1.0      # old rows and decoder, bit for bit
    assert result["after"] < 0.75 * result["before"], result          # the new codes learned
    assert result["exported_rows"] == 660


def test_kept_versions_share_the_tables_chunk_files(capsys):
    result = load("kept_versions_disk_use").main(["--rows", "20000", "--dim", "16", "--versions", "6"])
    assert result["kept"] == 6 and result["disk_tables"] < 1.2 + 1.5 * result["changed_tables"], result
    assert "every kept version reads its rows bit for bit" in capsys.readouterr().out
