"""`embcache` / `python -m lightning_embcache`: every verb answers --help, bad input gets a message,
the demo never deletes a folder it did not make, bench writes only where --out says, and
inspect / verify / compact report what a reference (the files, a dict of rows) says is there."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import lightning_embcache
from lightning_embcache import EmbeddingStore, cli
from lightning_embcache.cli import main as embcache
from lightning_embcache.demo import RUN_MARKER, prepare_run_folder


def run(args, capsys):
    try:
        code = embcache(args)
    except SystemExit as exc:  # argparse's --help / errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version_matches_the_package_and_python_m_works():
    got = subprocess.run([sys.executable, "-m", "lightning_embcache", "--version"], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[1])
    assert got.stdout.strip() == f"embcache {lightning_embcache.__version__}"
    # one version source: the installed metadata is read from lightning_embcache.__version__
    assert importlib.metadata.version("lightning_embcache") == lightning_embcache.__version__
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]


@pytest.mark.parametrize("argv", [
    [], ["--help"], ["demo", "--help"], ["bench", "--help"], ["bench", "store", "--help"], ["bench", "optim", "--help"],
    ["bench", "profiler", "--help"], ["bench", "sync", "--help"], ["inspect", "--help"], ["verify", "--help"],
    ["compact", "--help"],
])
def test_every_verb_has_help(argv, capsys):
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "usage:" in out


def test_unknown_verbs_and_benchmarks_get_a_message(capsys):
    code, _, err = run(["frobnicate"], capsys)
    assert code == 2 and "invalid choice: 'frobnicate'" in err and "inspect" in err
    code, _, err = run(["bench", "nosuch"], capsys)
    assert code == 2 and "invalid choice: 'nosuch'" in err


def test_a_benchmark_module_that_is_not_installed_is_named(monkeypatch, capsys):
    monkeypatch.setitem(cli.BENCHMARKS, "train", "benchmarks.not_here")
    code, _, err = run(["bench", "train"], capsys)
    assert code == 2 and "has no benchmarks.not_here" in err


def test_a_benchmark_returning_its_results_exits_0(monkeypatch, capsys):
    """Benchmarks whose main returns a dict of results (rows16) exit 0, not with a TypeError."""
    fake = types.ModuleType("benchmarks.fake_results")
    fake.main = lambda argv: {"summary": {}}
    monkeypatch.setitem(sys.modules, "benchmarks.fake_results", fake)
    monkeypatch.setitem(cli.BENCHMARKS, "train", "benchmarks.fake_results")
    code, _, _ = run(["bench", "train"], capsys)
    assert code == 0
    fake.main = lambda argv: 3
    assert run(["bench", "train"], capsys)[0] == 3


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_benchmarks_checkout", lambda: None)
    code, _, err = run(["bench", "train"], capsys)
    assert code == 2 and "source checkout" in err and "benchmarks/" in err


def test_the_installed_package_holds_no_benchmark_code():
    import lightning_embcache

    pkg = Path(lightning_embcache.__file__).parent
    assert not (pkg / "bench").exists()
    assert not [f for f in pkg.rglob("*.py") if "import benchmarks" in f.read_text() or "from benchmarks" in f.read_text()]


def test_bench_passes_out_under_each_modules_own_flag(monkeypatch, tmp_path):
    seen = {}
    fake = types.ModuleType("fake_bench")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setitem(cli.BENCHMARKS, "store", "fake_bench")
    assert embcache(["bench", "store", "--quick", "--out", str(tmp_path / "r.json")]) == 0
    assert seen["argv"] == ["--quick", "--json", str(tmp_path / "r.json")]


@pytest.mark.slow
def test_bench_sync_writes_nothing_without_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    package = Path(lightning_embcache.__file__).parents[1]
    before = set((package / "bench-results").glob("*")) if (package / "bench-results").exists() else set()
    assert embcache(["bench", "sync", "--quick"]) == 0
    assert list(tmp_path.iterdir()) == []
    after = set((package / "bench-results").glob("*")) if (package / "bench-results").exists() else set()
    assert after == before
    assert embcache(["bench", "sync", "--quick", "--out", "r.json"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["benchmark"] == "sync"


# ---------------------------------------------------------------------- demo
def test_demo_refuses_a_non_empty_folder_it_did_not_make(tmp_path, capsys):
    (tmp_path / "thesis.tex").write_text("years of work")
    code, _, err = run(["demo", "--root", str(tmp_path), "--samples", "1000", "--max-steps", "1"], capsys)
    assert code == 2 and "refusing to delete" in err
    assert (tmp_path / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis.tex"]


def test_demo_empties_only_its_own_folder(tmp_path):
    root = tmp_path / "run"
    assert prepare_run_folder(root) is None and (root / RUN_MARKER).is_file()
    (root / "old-output").write_text("x")
    assert prepare_run_folder(root) is None
    assert sorted(p.name for p in root.iterdir()) == [RUN_MARKER]
    (tmp_path / "file").write_text("x")
    assert "not empty" in prepare_run_folder(tmp_path)
    old = tmp_path / "old-demo"  # a run folder of a demo version that wrote no marker
    (old / "latents").mkdir(parents=True)
    (old / "latents" / "META").write_bytes(b"x")
    (old / "checkpoints").mkdir()
    assert prepare_run_folder(old) is None and sorted(p.name for p in old.iterdir()) == [RUN_MARKER]
    (old / "notes.txt").write_text("mine")
    (old / RUN_MARKER).unlink()
    assert prepare_run_folder(old) is not None and (old / "notes.txt").exists()
    link = tmp_path / "link"
    link.symlink_to(root, target_is_directory=True)
    (root / "keep").write_text("x")
    assert prepare_run_folder(link) is not None and (root / "keep").exists()


# ---------------------------------------------------------------------- store tools
N, DIM, CHUNK = 3000, 8, 256


def make_store(path: Path, flushes: int = 4) -> dict[int, torch.Tensor]:
    """A store with several flushes (version 1 pinned); returns the reference rows of the last version."""
    ref: dict[int, torch.Tensor] = {}
    with EmbeddingStore.create(path, num_rows=N, dim=DIM, chunk_rows=CHUNK, hot_bytes=64 << 10, compression="lz4",
                               fields={"count": (torch.int32, 1)}) as store:
        g = torch.Generator().manual_seed(0)
        for i in range(flushes):
            ids = torch.randint(0, N, (400,), generator=g).unique()
            values = torch.full((len(ids), DIM), float(i + 1))  # compressible
            store.update(ids, values)
            ref.update({int(k): values[0] for k in ids})
            if store.flush() == 1:
                store.pin(1)  # as a checkpoint would
    return ref


def test_inspect_reports_shape_fields_versions_and_bytes(tmp_path, capsys):
    path = tmp_path / "s"
    make_store(path)
    code, out, _ = run(["inspect", str(path), "--json"], capsys)
    assert code == 0
    s = json.loads(out)
    assert (s["rows"], s["dim"], s["dtype"], s["chunk_rows"]) == (N, DIM, "float32", CHUNK)
    assert s["fields"] == {"weight": {"dtype": "float32", "dim": DIM}, "count": {"dtype": "int32", "dim": 1}}
    with EmbeddingStore.open(path, readonly=True) as store:
        assert (s["version"], s["versions"], s["pinned"]) == (store.version, store.versions(), [1])
    files = [p for p in path.rglob("*") if p.is_file()]
    assert s["disk"]["total_bytes"] == sum(p.stat().st_size for p in files)
    assert s["disk"]["segments"]["files"] == len(list((path / "segments").iterdir()))
    assert s["last_flush"] is not None
    code, text, _ = run(["inspect", str(path)], capsys)
    assert code == 0 and f"{N:,} x {DIM} float32" in text and "pinned [1]" in text


def test_inspect_of_a_folder_that_is_not_a_store_is_a_message(tmp_path, capsys):
    code, _, err = run(["inspect", str(tmp_path)], capsys)
    assert code == 2 and "embcache inspect:" in err and "Traceback" not in err


def test_verify_passes_a_sound_store_and_names_a_damaged_file(tmp_path, capsys):
    path = tmp_path / "s"
    make_store(path)
    code, out, _ = run(["verify", str(path)], capsys)
    assert code == 0, out
    assert "every checksum and the manifest chain verified" in out
    newest = sorted((path / "segments").iterdir())[-1]
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0xFF  # a record byte of the newest segment
    newest.write_bytes(bytes(data))
    code, out, _ = run(["verify", str(path), "--json"], capsys)
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    damaged = [v for v in report["versions"] if not v["ok"]]
    assert damaged and all(any(newest.name in f for f in v["damaged"]) for v in damaged)
    assert report["versions"][0]["ok"], "version 1 does not include the newest segment"


def test_verify_names_every_damaged_chunk(tmp_path, capsys):
    path = tmp_path / "s"
    with EmbeddingStore.create(path, num_rows=N, dim=DIM, chunk_rows=CHUNK, hot_bytes=64 << 10) as store:
        store.update(torch.arange(N), torch.randn(N, DIM))
        store.flush()
        store.compact()
        store.flush()
    chunks = sorted((path / "chunks").iterdir())
    for victim in (chunks[2], chunks[7]):
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    code, out, _ = run(["verify", str(path), "--latest"], capsys)
    assert code == 1
    assert chunks[2].name in out and chunks[7].name in out
    assert sum(c.name in out for c in chunks) == 2


def test_verify_names_a_damaged_manifest(tmp_path, capsys):
    path = tmp_path / "s"
    make_store(path)
    manifest = sorted(path.glob("manifest-*"))[-1]
    data = bytearray(manifest.read_bytes())
    data[-2] ^= 0x01
    manifest.write_bytes(bytes(data))
    code, out, err = run(["verify", str(path)], capsys)
    assert code == 1 and manifest.name in out + err


def test_compact_folds_segments_keeps_every_row_and_the_pins(tmp_path, capsys):
    path = tmp_path / "s"
    ref = make_store(path, flushes=8)
    code, out, _ = run(["compact", str(path), "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["versions"] == [1, result["version"]] and result["pinned"] == [1]  # the rest reclaimed
    with EmbeddingStore.open(path, readonly=True) as store:
        ids = torch.tensor(sorted(ref))
        assert torch.equal(store.get(ids), torch.stack([ref[int(i)] for i in ids]))
        assert store.stats().segments == 0, "the new version reads base chunks only"


def test_compact_interrupted_leaves_the_store_as_it_was(tmp_path, capsys, monkeypatch):
    path = tmp_path / "s"
    ref = make_store(path)
    with EmbeddingStore.open(path, readonly=True) as store:
        version = store.version

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(EmbeddingStore, "compact", interrupted)
    code, _, err = run(["compact", str(path)], capsys)
    assert code == 130 and "interrupted" in err
    with EmbeddingStore.open(path) as store:  # writable: the lock was released
        assert store.version == version
        ids = torch.tensor(sorted(ref))
        assert torch.equal(store.get(ids), torch.stack([ref[int(i)] for i in ids]))


def test_compact_refuses_a_store_a_writer_holds(tmp_path, capsys):
    path = tmp_path / "s"
    make_store(path)
    with EmbeddingStore.open(path):
        code, _, err = run(["compact", str(path)], capsys)
    assert code == 2 and "StoreLockedError" in err


if os.name != "posix":  # pragma: no cover
    pytestmark = pytest.mark.skip("symlink and flock semantics")


def test_a_row_sharded_store_is_inspected_verified_and_compacted_per_shard(tmp_path, capsys):
    root = tmp_path / "sharded"
    refs = [make_store(root / f"rank-{r:05d}-of-00002") for r in range(2)]
    code, out, _ = run(["inspect", str(root), "--json"], capsys)
    s = json.loads(out)
    assert code == 0 and len(s["shards"]) == 2 and s["rows"] == 2 * N
    code, out, _ = run(["verify", str(root)], capsys)
    assert code == 0, out
    code, out, _ = run(["compact", str(root), "--json"], capsys)
    assert code == 0 and len(json.loads(out)["shards"]) == 2
    with EmbeddingStore.open(root / "rank-00001-of-00002", readonly=True) as store:
        ids = torch.tensor(sorted(refs[1]))
        assert torch.equal(store.get(ids), torch.stack([refs[1][int(i)] for i in ids]))
