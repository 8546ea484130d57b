"""StepProfiler against references: a fake clock whose every phase costs a known amount, and
real wall time measured by an independent callback."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from _profiling_helpers import (
    MS,
    BatchDataset,
    Cost,
    CostModel,
    EpochWall,
    FakeClock,
    LoopOverhead,
    loader,
    trainer,
)
from lightning.pytorch.profilers import SimpleProfiler

from lightning_embcache import StepProfiler
from lightning_embcache.profiling import PHASES
from lightning_embcache.profiling.tap import ProfilerTap

DATA, FWD, BWD, OPT, OTHER = 2 * MS, 5 * MS, 7 * MS, 4 * MS, 1 * MS
LOGGED_KEYS = {f"profile/{p}_ms" for p in PHASES} | {
    "profile/step_ms", "profile/step_max_ms", "profile/slowest_rank", "profile/rank_spread_pct",
    "profile/samples_per_sec"}


def _fit_fake(sp: StepProfiler, batches: int = 4, epochs: int = 1, store_s: float = 0.0,
              manual: bool = False, tail_s: float = 0.0, val_s: float = 0.0, ckpt_path=None, model=None,
              clock=None, **trainer_kw):
    clock = clock or FakeClock()
    cost = Cost(clock)
    with mock.patch("time.perf_counter", clock):
        model = model or CostModel(cost, FWD, BWD, OPT, store_s=store_s, manual=manual, tail_s=tail_s,
                                   val_s=val_s)
        model.cost = cost
        ds = BatchDataset(batches, cost, DATA)
        kw = dict(max_epochs=epochs, callbacks=[sp, LoopOverhead(cost, OTHER)])
        kw.update(trainer_kw)
        t = trainer(**kw)
        val = loader(BatchDataset(2, cost, 0.0)) if val_s else None
        t.fit(model, loader(ds), val, ckpt_path=ckpt_path)
    return t, model, clock


def _approx(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def test_phases_match_the_costs_exactly_under_a_fake_clock():
    p = StepProfiler(report=False)
    clock = FakeClock()
    model = CostModel(Cost(clock), FWD, BWD, OPT, pre_transfer_s=0.5 * MS, transfer_s=0.25 * MS)
    _fit_fake(p, batches=4, epochs=2, model=model, clock=clock)
    s = p.summary()
    assert [e["epoch"] for e in s] == [0, 1]
    for e in s:
        ph = e["phases_ms"]
        assert _approx(ph["data_wait"], 2.25), ph  # the loader and the transfer
        assert _approx(ph["forward"], 5.0), ph
        assert _approx(ph["backward"], 7.0), ph
        assert _approx(ph["optimizer"], 4.0), ph
        assert _approx(ph["store_io"], 0.0), ph
        assert _approx(ph["other"], 1.5), ph  # after the batch, and between loader and transfer
        assert e["batches"] == 4
        assert _approx(e["epoch_seconds"], 4 * 19.75 * MS)
        assert _approx(e["avg_batch_ms"], 19.75)
        assert _approx(sum(ph.values()), e["avg_batch_ms"])
        assert e["samples"] == 16 and _approx(e["samples_per_sec"], 16 / (4 * 19.75 * MS))
        assert e["timeline"] == "host-clock" and e["world_size"] == 1


def test_loader_time_is_kept_apart_from_loop_overhead():
    # a profiler that calls the whole gap between batches "data" would report 2 + 1 ms here
    p = StepProfiler(report=False)
    clock = FakeClock()
    cost = Cost(clock)
    with mock.patch("time.perf_counter", clock):
        heavy_loop = LoopOverhead(cost, 9 * MS)
        model = CostModel(cost, FWD, BWD, OPT)
        t = trainer(max_epochs=1, callbacks=[p, heavy_loop])
        t.fit(model, loader(BatchDataset(5, cost, DATA)))
    ph = p.summary()[0]["phases_ms"]
    assert _approx(ph["data_wait"], 2.0) and _approx(ph["other"], 9.0), ph


def test_warmup_is_excluded_from_steady_but_not_from_the_true_average():
    clock = FakeClock()
    cost = Cost(clock)

    class SlowStart(LoopOverhead):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.cost(50 * MS if batch_idx < 2 else 0.0)

    p = StepProfiler(report=False, warmup_steps=2, epoch_batches=100)
    with mock.patch("time.perf_counter", clock):
        t = trainer(max_epochs=1, callbacks=[p, SlowStart(cost, 0)])
        t.fit(CostModel(cost, FWD, BWD, OPT), loader(BatchDataset(6, cost, DATA)))
    e = p.summary()[0]
    # batch wall: 18 ms; the first two batches also pay 50 ms of loop overhead
    assert _approx(e["avg_batch_ms"], (6 * 18 + 100) / 6)
    assert _approx(e["steady_batch_ms"], 18.0)
    assert e["steady_batches"] == 4
    assert _approx(e["projected_epoch_seconds"], e["epoch_seconds"] + 94 * 18 * MS)


def test_logger_receives_the_exact_keys_every_n_steps(tmp_path):
    logger = mock.Mock()
    logger.save_dir = str(tmp_path)
    logger.log_dir = str(tmp_path)
    logger.name = "mock"
    logger.version = 0
    p = StepProfiler(log_every_n_steps=2, report=False)
    _fit_fake(p, batches=4, logger=logger)
    calls = [c for c in logger.log_metrics.call_args_list
             if any(k.startswith("profile/") for k in c.kwargs["metrics"])]
    assert len(calls) == 2
    for c, step in zip(calls, (2, 4)):
        m = c.kwargs["metrics"]
        assert set(m) == LOGGED_KEYS
        assert c.kwargs["step"] == step
        assert _approx(m["profile/data_wait_ms"], 2.0) and _approx(m["profile/backward_ms"], 7.0)
        assert _approx(m["profile/step_ms"], 19.0) and _approx(m["profile/step_max_ms"], 19.0)
        assert m["profile/slowest_rank"] == 0 and m["profile/rank_spread_pct"] == 0
        assert _approx(m["profile/samples_per_sec"], 8 / (2 * 19 * MS))


def test_gradient_accumulation_charges_the_optimizer_only_on_stepping_batches():
    p = StepProfiler(report=False)
    _fit_fake(p, batches=6, accumulate_grad_batches=3)
    ph = p.summary()[0]["phases_ms"]
    assert _approx(ph["optimizer"], 4.0 / 3), ph
    assert _approx(ph["backward"], 7.0) and _approx(ph["forward"], 5.0), ph
    assert _approx(sum(ph.values()), p.summary()[0]["avg_batch_ms"])


def test_manual_optimization():
    p = StepProfiler(report=False)
    _fit_fake(p, batches=4, manual=True, tail_s=1.5 * MS)
    ph = p.summary()[0]["phases_ms"]
    # user code after opt.step() is training_step code: forward
    assert _approx(ph["forward"], 6.5), ph
    assert _approx(ph["backward"], 7.0) and _approx(ph["optimizer"], 4.0), ph
    assert _approx(ph["data_wait"], 2.0) and _approx(ph["other"], 1.0), ph


def test_store_io_is_taken_out_of_the_phase_it_happened_in():
    p = StepProfiler(report=False)
    _fit_fake(p, batches=3, store_s=3 * MS)
    ph = p.summary()[0]["phases_ms"]
    assert _approx(ph["store_io"], 3.0) and _approx(ph["forward"], 5.0), ph
    assert _approx(p.summary()[0]["avg_batch_ms"], 22.0)


def test_validation_inside_the_epoch_is_not_charged_to_steps():
    p = StepProfiler(report=False)
    _fit_fake(p, batches=4, val_s=30 * MS, val_check_interval=2)
    e = p.summary()[0]
    assert _approx(e["avg_batch_ms"], 19.0), e
    assert _approx(e["val_seconds"], 2 * 2 * 30 * MS), e


def test_resume_continues_the_epoch_totals(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    p1 = StepProfiler(report=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    _, _, clock = _fit_fake(p1, batches=6, callbacks=[p1, LoopOverhead(Cost(None), 0), ckpt],
                            enable_checkpointing=True)
    mid = tmp_path / "epoch=0-step=3.ckpt"
    assert mid.exists(), sorted(tmp_path.iterdir())
    assert p1.summary()[0]["batches"] == 6
    p2 = StepProfiler(report=False)
    _fit_fake(p2, batches=6, ckpt_path=str(mid), clock=clock)
    s = p2.summary()
    assert len(s) == 1 and s[0]["epoch"] == 0 and s[0]["batches"] == 6
    assert _approx(s[0]["epoch_seconds"], 6 * 18 * MS + 3 * OTHER)
    assert _approx(s[0]["phases_ms"]["optimizer"], 4.0)


def test_state_dict_round_trip_mid_epoch():
    p = StepProfiler(report=False)
    _fit_fake(p, batches=4, epochs=1)
    state = p.state_dict()
    q = StepProfiler(report=False)
    q.load_state_dict(state)
    assert q.summary() == p.summary()
    with pytest.raises(ValueError, match="version"):
        q.load_state_dict({**state, "version": 99})


def test_users_profiler_still_sees_every_action_and_is_restored():
    simple = SimpleProfiler()
    p = StepProfiler(report=False)
    t, _, _ = _fit_fake(p, batches=4, profiler=simple)
    assert t.profiler is simple and not isinstance(t.profiler, ProfilerTap)
    names = set(simple.recorded_durations)
    assert "[_TrainingEpochLoop].train_dataloader_next" in names
    assert len(simple.recorded_durations["[_TrainingEpochLoop].train_dataloader_next"]) == 4
    assert len(simple.recorded_durations["run_training_batch"]) == 4
    assert p.summary()[0]["batches"] == 4
    ph = p.summary()[0]["phases_ms"]  # the boundaries reach the profiler through SimpleProfiler too
    assert _approx(ph["forward"], 5.0) and _approx(ph["backward"], 7.0) and _approx(ph["optimizer"], 4.0), ph


def test_report_table_is_printed(capsys, caplog):
    p = StepProfiler()
    with caplog.at_level("INFO"):
        _fit_fake(p, batches=2)
    text = caplog.text + capsys.readouterr().out
    assert "ms/step" in text and "data_wait" in text and "dominant phase: backward" in text


def test_plot_without_matplotlib_warns_and_skips(tmp_path, caplog, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    p = StepProfiler(report=False, plot=tmp_path / "phases.png")
    with caplog.at_level("WARNING"):
        _fit_fake(p, batches=2)
    assert not (tmp_path / "phases.png").exists()
    assert "matplotlib is not installed" in caplog.text


def test_plot_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    p = StepProfiler(report=False, plot=tmp_path / "phases.png")
    _fit_fake(p, batches=2, epochs=2)
    assert (tmp_path / "phases.png").stat().st_size > 0


@pytest.mark.parametrize("kw, match", [
    (dict(log_every_n_steps=0), "log_every_n_steps=0"),
    (dict(warmup_steps=-1), "warmup_steps=-1"),
    (dict(epoch_batches=0), "epoch_batches=0"),
])
def test_invalid_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        StepProfiler(**kw)
    with pytest.raises(TypeError, match="batch_size_fn"):
        StepProfiler(batch_size_fn=3)


def test_batch_size_fn_and_opaque_batches():
    p = StepProfiler(report=False, batch_size_fn=lambda b: 10)
    _fit_fake(p, batches=2)
    assert p.summary()[0]["samples"] == 20


def _real_clock_fit() -> tuple[dict, float, float]:
    """Real sleeps: loader 4 ms (measured inside the dataset), step work, 3 ms of loop overhead.
    The profiler's epoch summary, the independent epoch wall time and the loader's own ms/batch."""
    cost = Cost()
    ds = BatchDataset(25, cost, 4 * MS)
    wall = EpochWall()
    p = StepProfiler(report=False)
    t = trainer(max_epochs=1, callbacks=[wall, p, LoopOverhead(cost, 3 * MS)])
    t.fit(CostModel(cost, 2 * MS, 1 * MS, 1 * MS), loader(ds))
    return p.summary()[0], wall.epochs[0], 1e3 * ds.loaded_s / 25


def test_real_clock_phases_hold_at_least_their_own_work():
    """The real clock, whatever the host's speed: a stall only ever adds time, so each phase holds
    at least its own sleep and the phases add up to the step. (Exact attribution is checked under
    a fake clock: test_phases_match_the_costs_exactly_under_a_fake_clock and the tests after it.)"""
    e, _, loader_ms = _real_clock_fit()
    assert abs(sum(e["phases_ms"].values()) - e["avg_batch_ms"]) < 1e-6
    ph = e["phases_ms"]
    assert ph["data_wait"] >= loader_ms, (ph, loader_ms)
    assert ph["other"] >= 3.0, ph
    assert ph["forward"] >= 2.0 and ph["backward"] >= 1.0 and ph["optimizer"] >= 1.0, ph


@pytest.mark.slow  # wall-clock bounds from above: a loaded host's stalls land in data_wait (2 ms seen under 4 hogs)
def test_real_clock_matches_independent_wall_and_loader_time():
    e, ref_wall, loader_ms = _real_clock_fit()
    assert abs(e["epoch_seconds"] - ref_wall) / ref_wall < 0.01, (e["epoch_seconds"], ref_wall)
    ph = e["phases_ms"]
    # the loader's own time, not the gap between batches (which also holds the 3 ms of overhead)
    assert loader_ms <= ph["data_wait"] < loader_ms + 1.0, (ph, loader_ms)


def _two_rank_straggler(tmp_path, accelerator="cpu", strategy="ddp"):
    """A real 2-rank Trainer (default: DDP on CPU with Gloo): one collective per interval, every
    rank joins, and the slow rank is named."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "ddp.json"
    script = os.path.join(os.path.dirname(__file__), "_ddp_script.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, script, str(out), accelerator, strategy], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["summary"]
    assert [e["epoch"] for e in s] == [0, 1]
    for e in s:
        assert e["world_size"] == 2 and e["batches"] == 8
        assert e["slowest_rank"] == 1, e
        # rank 1 spends 25 ms more in forward; the mean over ranks is half of that above rank 0.
        # The first epoch holds DDP's first-iteration syncs (and on CUDA NCCL's), in which the
        # fast rank waits for the straggler inside its own forward (2 x H100: forward 45 ms mean,
        # 52 max, spread 1.7%, the same before and after the phase boundaries moved to profiler
        # actions; Gloo on a loaded 2-core host: 47 mean, 53 max): the straggler's extra time is
        # asserted for the last epoch.
        if e["epoch"] == s[-1]["epoch"]:
            assert e["phases_max_ms"]["forward"] >= 25.0, e
            assert e["phases_max_ms"]["forward"] - e["phases_ms"]["forward"] >= 10.0, e
            assert e["rank_spread_pct"] > 50.0, e
        # CPU: phases are host intervals that tile the step exactly. CUDA: device phases come from
        # events and the step from the host clock; the epoch's ends are anchored to the host by
        # waiting for the device there, so the two agree (before that anchoring: 4.6% apart in the
        # second epoch on 2 x H200, the fast rank's GPU still waiting for the straggler at the end)
        tol = 1e-6 if accelerator == "cpu" else 0.01 * e["avg_batch_ms"]
        assert abs(sum(e["phases_ms"].values()) - e["avg_batch_ms"]) < tol, e
    assert len(res["logged"]) == 4  # 16 batches per rank / log_every_n_steps=4
    for k, m in enumerate(res["logged"]):
        assert set(m) == LOGGED_KEYS
        # the first interval holds the first iteration's syncs too (above): on CUDA the fast rank
        # waiting in them named rank 0 there once in a run of the FSDP cell on 2 x H100
        if k or accelerator == "cpu":
            assert m["profile/slowest_rank"] == 1.0, (k, m)
    assert "slowest rank (last epoch): 1" in proc.stdout + proc.stderr


@pytest.mark.slow  # two fresh interpreters import torch+lightning: ~30-40 s on the shared 2-core box
def test_ddp_two_processes_gloo_reports_the_straggler(tmp_path):
    _two_rank_straggler(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpus_report_the_straggler(tmp_path, strategy):
    """NCCL DDP and FSDP: CUDA-event phases reduced across ranks, the slow rank named."""
    _two_rank_straggler(tmp_path, "cuda", strategy)

def test_a_profiler_with_its_own_profile_method_keeps_it():
    from contextlib import contextmanager

    from lightning.pytorch.profilers import Profiler

    class Recording(Profiler):
        def __init__(self):
            super().__init__()
            self.seen = []

        def start(self, action_name):
            self.seen.append(("start", action_name))

        def stop(self, action_name):
            self.seen.append(("stop", action_name))

        @contextmanager
        def profile(self, action_name):
            self.seen.append(("enter", action_name))
            yield action_name
            self.seen.append(("exit", action_name))

    rec = Recording()
    p = StepProfiler(report=False)
    t, _, _ = _fit_fake(p, batches=3, profiler=rec)
    assert t.profiler is rec
    # every action reached the user's profile(), the boundaries' included
    assert rec.seen.count(("enter", "run_training_batch")) == 3
    assert rec.seen.count(("enter", "[LightningModule]CostModel.on_before_backward")) == 3
    assert rec.seen.count(("start", "[_TrainingEpochLoop].train_dataloader_next")) == 3
    ph = p.summary()[0]["phases_ms"]
    assert _approx(ph["data_wait"], 2.0) and _approx(ph["optimizer"], 4.0), ph
    assert _approx(ph["forward"], 5.0) and _approx(ph["backward"], 7.0) and _approx(ph["other"], 1.0), ph


@pytest.mark.parametrize("precision", ["bf16-mixed", pytest.param("16-mixed", marks=pytest.mark.gpu)])
def test_mixed_precision_keeps_the_phases(precision):
    kw = {"precision": precision}
    if precision == "16-mixed":  # Lightning's 16-mixed (GradScaler) needs CUDA
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        kw["accelerator"] = "cuda"
    p = StepProfiler(report=False)
    _fit_fake(p, batches=3, **kw)
    ph = p.summary()[0]["phases_ms"]
    if precision == "bf16-mixed":  # host clock: the fake clock's costs exactly
        assert _approx(ph["forward"], 5.0) and _approx(ph["backward"], 7.0), ph
        assert _approx(ph["optimizer"], 4.0), ph
    else:  # CUDA events: device time, no fake clock there
        assert p.summary()[0]["timeline"] == "cuda-events" and p.summary()[0]["batches"] == 3


@pytest.mark.slow  # inductor compiles the model: tens of seconds on a small CPU
def test_torch_compile_keeps_the_phases():
    cost = Cost()
    model = torch.compile(CostModel(cost, 0.0, 0.0, 0.0))
    wall = EpochWall()
    p = StepProfiler(report=False, warmup_steps=3)
    t = trainer(max_epochs=1, callbacks=[wall, p])
    t.fit(model, loader(BatchDataset(12, cost, 2 * MS)))
    e = p.summary()[0]
    assert e["batches"] == 12
    assert abs(e["epoch_seconds"] / wall.epochs[0] - 1) < 0.01
    assert e["phases_ms"]["data_wait"] >= 2.0


class _TierStore:
    """A store whose GPU tier moved 3 MiB up, 1 MiB down and 2,000 rows in at every get, 1,500 of
    them staged ahead, and found 3 of every 4 looked-up rows already on the GPU."""

    def __init__(self, in_host_ram: bool) -> None:
        self.up = self.down = self.rows = self.ahead = self.looked = self.hits = 0
        self.in_host_ram = in_host_ram

    def get(self, ids):
        self.up += 3 << 20
        self.down += 1 << 20
        self.rows += 2000
        self.ahead += 1500
        self.looked += 4000
        self.hits += 3000
        return torch.zeros(len(ids), 1)

    def stats(self):
        from _profiling_helpers import FakeStats

        return FakeStats(0.0)

    def device_stats(self):
        return {"host_to_device_bytes": self.up, "device_to_host_bytes": self.down, "device_loaded_rows": self.rows,
                "device_evicted_rows": self.rows, "device_mapped_host": self.in_host_ram,
                "device_bytes": 0 if self.in_host_ram else 1 << 30, "device_staged_ahead_rows": self.ahead,
                "device_lookup_rows": self.looked, "device_lookup_hit_rows": self.hits}


@pytest.mark.parametrize("in_host_ram", [True, False])
def test_the_gpu_tiers_traffic_per_step_is_in_the_summary_and_the_table(in_host_ram):
    """Per epoch, from the tiers' counters at its start and end (no sync): bytes each way and rows
    loaded per step, and whether the rows stay in host RAM; the table names them."""
    clock = FakeClock()
    model = CostModel(Cost(clock), FWD, BWD, OPT, store_s=1 * MS)
    model.embedding_stores = {"rows": _TierStore(in_host_ram)}
    sp = StepProfiler(report=False)
    _fit_fake(sp, batches=5, epochs=2, model=model, clock=clock)
    for epoch in sp.summary():
        tier = epoch["device_tier"]
        assert tier["host_to_device_bytes_per_step"] == 3 << 20 and tier["device_to_host_bytes_per_step"] == 1 << 20
        assert tier["rows_loaded_per_step"] == 2000 and tier["rows_in_host_ram"] is in_host_ram
        assert tier["rows_staged_ahead_per_step"] == 1500 and tier["lookup_hit_rate"] == 0.75
        step_s = epoch["avg_batch_ms"] / 1e3
        assert tier["host_to_device_bytes_per_s"] == pytest.approx((3 << 20) / step_s)
        assert tier["device_to_host_bytes_per_s"] == pytest.approx((1 << 20) / step_s)
    line = next(ln for ln in sp.report_table().splitlines() if ln.startswith("GPU tier"))
    assert "3.00 MiB/step host->device" in line and "1.00 MiB/step device->host" in line
    assert "75.0% of looked-up rows already on the GPU" in line and "1500 rows/step staged ahead" in line
    assert f"{(3 << 20) / (sp.summary()[-1]['avg_batch_ms'] / 1e3) / 1e9:.2f} GB/s up" in line
    assert ("in host RAM" in line) is in_host_ram


def test_without_a_gpu_tier_the_summary_has_no_tier_figures():
    p = StepProfiler(report=False)
    _fit_fake(p, batches=3, store_s=1 * MS)
    assert "device_tier" not in p.summary()[0]
    assert "GPU tier" not in p.report_table()
