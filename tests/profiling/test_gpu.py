"""StepProfiler on a CUDA device: CUDA-event phases, no synchronization added inside steps."""

import pytest
import torch

from lightning_embcache import StepProfiler

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_cuda_phases_with_sync_debug_error_around_steady_steps():
    from benchmarks.profiler_gpu import _gpu_fit, _ListLogger, _SyncGuard

    guard = _SyncGuard(10, 50)  # any synchronization in batches 10..51 raises
    sp = StepProfiler(log_every_n_steps=5, report=False, warmup_steps=10)
    logger = _ListLogger()
    _gpu_fit("gpu_small", [guard, sp], batches=60, logger=logger)
    assert guard.steps_guarded == 41
    e = sp.summary()[0]
    assert e["timeline"] == "cuda-events" and e["batches"] == 60
    assert all(v >= 0 for v in e["phases_ms"].values()), e
    # the device timeline spans the same epoch as the host wall, give or take the GPU's lag at its ends
    assert abs(sum(e["phases_ms"].values()) / e["avg_batch_ms"] - 1) < 0.05, e
    logged = [m for _, m in logger.rows if "profile/step_ms" in m]
    assert 10 <= len(logged) <= 12  # an interval whose steps the GPU has not finished yet logs nothing


def test_cuda_forward_is_device_time_not_launch_time():
    from benchmarks.profiler_gpu import _gpu_fit

    sp = StepProfiler(report=False, sample_every_n_steps=1)  # every step timed on the device
    _gpu_fit("gpu_large", [sp], batches=12)
    e = sp.summary()[0]
    # big matmuls: the host returns from launching long before the GPU finishes
    assert e["phases_ms"]["backward"] > 2 * e["host_phases_ms"]["backward"] or \
        e["phases_ms"]["forward"] > 2 * e["host_phases_ms"]["forward"], e


def test_sampled_events_no_syncs_and_a_prediction():
    """~1 step in 8 timed on the device: few events, none waited for inside steps, phases that
    still add up to the wall, and an epoch prediction within reach of the actual epoch."""
    from benchmarks.profiler_gpu import _gpu_fit, _ListLogger, _SyncGuard

    guard = _SyncGuard(10, 390)
    sp = StepProfiler(log_every_n_steps=50, report=False)
    logger = _ListLogger()
    _gpu_fit("gpu_small", [guard, sp], batches=400, logger=logger)
    assert guard.steps_guarded == 381
    tl = sp._timeline
    # 5 events a timed step, one more when the step before was not timed, the epoch's two anchors
    assert tl.events_recorded <= 6.3 * 400 / 8 + 12, tl.events_recorded
    assert len(tl._pool) + tl.pending <= 64  # events are reused
    e = sp.summary()[0]
    assert e["timeline"] == "cuda-events" and e["batches"] == 400
    assert abs(sum(e["phases_ms"].values()) / e["avg_batch_ms"] - 1) < 1e-6
    assert e["phases_ms"]["forward"] > 0 and e["phases_ms"]["backward"] > 0 and e["phases_ms"]["optimizer"] > 0
    # at 5% (batch 20), or a little later until 3 sampled steps have been read from the device
    assert 20 <= e["predicted_at_batch"] <= 80 and abs(e["prediction_error_pct"]) < 25.0, e
    keys = set().union(*(m for _, m in logger.rows if "profile/step_ms" in m))
    assert {"profile/predicted_epoch_s", "profile/predicted_epoch_std_s"} <= keys
