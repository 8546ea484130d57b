"""`embcache demo`, run tiny."""

from __future__ import annotations

from lightning_embcache.cli import main as embcache


def test_demo_runs_tiny_and_reports(tmp_path, capsys):
    rc = embcache(["demo", "--samples", "4096", "--dim", "16", "--max-steps", "12", "--batch-size", "256",
                   "--workers", "0", "--sync-every", "3", "--ckpt-every", "5", "--root", str(tmp_path / "demo")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "trained 12 steps" in out
    # stopped inside the epoch (12 of 16 batches): the profiler's prediction of a whole one
    assert "stopped at step 12 of 16: StepProfiler predicts a full epoch at" in out
    assert "store 'latents'" in out and "hit rate" in out and "DeferredSync:" in out
    assert "memory:" in out and "RSS now" in out
    assert (tmp_path / "demo" / "latents").is_dir()
    assert sorted(p.name for p in (tmp_path / "demo" / "checkpoints").glob("*.ckpt")) == [
        "epoch=0-step=10.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"]


def test_demo_prefetches_by_default_and_trains_the_same_rows_without(tmp_path, capsys):
    """The demo tells the store each next batch's ids (its rows are read while the step trains);
    `--no-prefetch` reads them in the step. Same data, same model: the same losses."""
    args = ["demo", "--samples", "4096", "--dim", "16", "--max-steps", "12", "--batch-size", "256",
            "--workers", "0", "--sync-every", "3", "--ckpt-every", "5", "--hot-mib", "0.0625"]
    assert embcache(args + ["--root", str(tmp_path / "on")]) == 0
    on = capsys.readouterr().out
    assert embcache(args + ["--root", str(tmp_path / "off"), "--no-prefetch"]) == 0
    off = capsys.readouterr().out
    line = next(l for l in on.splitlines() if l.strip().startswith("prefetch:"))
    ahead = int(line.split("prefetch:")[1].split("rows")[0].replace(",", ""))
    # each batch's ids are told while the one before trains: batches 2-12, and 13, which the run
    # stops before; rows already hot are not read again
    assert 0 < ahead <= 12 * 256, line
    assert "prefetch:" not in off
    losses = [[l.split("loss ")[1].split()[0] for l in out.splitlines() if " loss " in l] for out in (on, off)]
    assert losses[0] and losses[0] == losses[1], losses


def test_a_demo_stopped_mid_epoch_leaves_no_loader_worker_behind(tmp_path, capsys):
    """`--max-steps` ends the fit inside an epoch, with the loader's persistent worker alive.
    Lightning stops the workers of the DataLoaders it sees; the demo's is inside a wrapper, so the
    demo stops it at teardown. Left to the garbage collector, it was stopped inside a finalizer
    that waited 5 s, stalling whatever the process ran next (a second fit, a benchmark)."""
    import gc

    import psutil

    gc.collect()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    gc.disable()  # nothing may be left for a collection to clean up
    try:
        rc = embcache(["demo", "--samples", "4096", "--dim", "16", "--max-steps", "6", "--batch-size", "256",
                       "--workers", "1", "--sync-every", "3", "--ckpt-every", "5", "--root", str(tmp_path / "demo")])
        assert rc == 0
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        assert left == [], [p.cmdline() for p in left]
    finally:
        gc.enable()
    capsys.readouterr()
