"""From per-rank rows of sums to what the user reads: the logged interval metrics and the
per-epoch summary dict. Pure functions of the rows, so every rank computes the same thing."""

from __future__ import annotations

from lightning_embcache.profiling import ranks, slow_steps
from lightning_embcache.profiling.timeline import BACKWARD, NUM_PHASES, PHASES, Totals

# interval row: phase seconds..., wall, batches, samples
_WALL, _BATCHES, _SAMPLES = NUM_PHASES, NUM_PHASES + 1, NUM_PHASES + 2


def interval_row(t: Totals, fallback: Totals | None = None) -> list[float]:
    return [*t.phases(fallback), t.wall_s, float(t.batches), float(t.samples)]


def interval_metrics(rows: list[list[float]], samples_known: bool) -> dict[str, float] | None:
    """The ``profile/*`` dict for one log interval (None when no rank finished a step in it)."""
    batches = sum(r[_BATCHES] for r in rows)
    if batches <= 0:
        return None
    metrics = {f"profile/{p}_ms": 1e3 * sum(r[i] for r in rows) / batches for i, p in enumerate(PHASES)}
    _, slowest, pct = ranks.spread(rows, _WALL, _BATCHES, BACKWARD)
    metrics["profile/step_ms"] = 1e3 * sum(r[_WALL] for r in rows) / batches
    metrics["profile/step_max_ms"] = max(1e3 * r[_WALL] / r[_BATCHES] if r[_BATCHES] else 0.0 for r in rows)
    metrics["profile/slowest_rank"] = float(slowest)
    metrics["profile/rank_spread_pct"] = pct
    wall = sum(r[_WALL] for r in rows) / len(rows)
    if samples_known and wall > 0:
        metrics["profile/samples_per_sec"] = sum(r[_SAMPLES] for r in rows) / wall
    return metrics


# epoch row: reported phase seconds..., host phase seconds..., then these
_K = 2 * NUM_PHASES
_E_WALL, _E_BATCHES, _E_SAMPLES, _E_STEADY_WALL, _E_STEADY_BATCHES, _E_VAL = range(_K, _K + 6)


def epoch_row(t: Totals) -> list[float]:
    return [*t.phases(), *t.host_phase_s[:NUM_PHASES], t.wall_s, float(t.batches), float(t.samples), t.steady_wall_s,
            float(t.steady_batches), t.val_s]


def dominant_phase(phases_ms: dict[str, float]) -> str:
    """The phase with the most time per step (docs/profiler.md says what to do about each). The
    end-of-fit table names the last epoch's, as the summary's ``dominant_phase`` does."""
    return max(PHASES, key=lambda p: phases_ms[p])


def rank_phase_rows(rows: list[list[float]]) -> list[list[float]]:
    """Per rank: reported phase seconds..., batches (for the fit-end table's per-rank maximum)."""
    return [[*r[:NUM_PHASES], r[_E_BATCHES]] for r in rows]


def epoch_summary(epoch: int, rows: list[list[float]], samples_known: bool, epoch_batches: int | None,
                  timeline: str, prediction: dict | None = None, full_prediction: dict | None = None,
                  segments: list[list[float]] | None = None) -> dict:
    """One epoch's dict of ``StepProfiler.summary()`` (keys documented in docs/profiler.md).

    ``prediction``: what the profiler predicted for this epoch early on (``StepProfiler.predict()``
    at ``predict_at`` of the epoch), compared here with the epoch's actual wall time;
    ``full_prediction``: for an epoch cut short, its prediction at ``epoch_batches`` made at its end;
    ``segments``: this rank's mean ms per step of each phase over the epoch's twentieths
    (:mod:`~lightning_embcache.profiling.slow_steps`), for which phase moved when the step did."""
    n = len(rows)
    wall_s = sum(r[_E_WALL] for r in rows) / n
    batches = round(sum(r[_E_BATCHES] for r in rows) / n)
    samples = sum(r[_E_SAMPLES] for r in rows)
    steady_b = sum(r[_E_STEADY_BATCHES] for r in rows)
    steady_ms = 1e3 * sum(r[_E_STEADY_WALL] for r in rows) / steady_b if steady_b else None
    all_b = sum(r[_E_BATCHES] for r in rows)

    def mean_ms(col: int) -> float:
        return 1e3 * sum(r[col] for r in rows) / all_b if all_b else 0.0

    def max_ms(col: int) -> float:
        return max(1e3 * r[col] / r[_E_BATCHES] if r[_E_BATCHES] else 0.0 for r in rows)

    _, slowest, pct = ranks.spread(rows, _E_WALL, _E_BATCHES, BACKWARD)
    val_s = sum(r[_E_VAL] for r in rows) / n
    projected = None
    if epoch_batches is not None and batches:
        rate_ms = steady_ms if steady_ms is not None else 1e3 * wall_s / batches
        projected = wall_s + 1e-3 * rate_ms * max(0, epoch_batches - batches)
    predicted = predicted_std = at = error = fit = fit_std = fit_low = fit_high = low = high = None
    if prediction is not None:
        predicted, predicted_std, at = prediction["epoch_s"], prediction["epoch_std_s"], prediction["at_batch"]
        low, high = prediction.get("epoch_low_s"), prediction.get("epoch_high_s")
        fit, fit_std = prediction["fit_s"], prediction["fit_std_s"]
        fit_low, fit_high = prediction.get("fit_low_s"), prediction.get("fit_high_s")
        if prediction["epoch_batches"] == batches and wall_s + val_s > 0:
            error = 100.0 * (predicted / (wall_s + val_s) - 1.0)
    return {
        "epoch": epoch,
        "batches": batches,
        "epoch_seconds": wall_s,
        "val_seconds": val_s,
        "epoch_wall_seconds": wall_s + val_s,
        "avg_batch_ms": 1e3 * wall_s / batches if batches else 0.0,
        "steady_batches": round(steady_b / n),
        "steady_batch_ms": steady_ms,
        "epoch_batches": epoch_batches,
        "projected_epoch_seconds": projected,
        "predicted_full_epoch_seconds": full_prediction["epoch_s"] if full_prediction else None,
        "predicted_full_epoch_std_seconds": full_prediction["epoch_std_s"] if full_prediction else None,
        "predicted_full_epoch_low_seconds": full_prediction.get("epoch_low_s") if full_prediction else None,
        "predicted_full_epoch_high_seconds": full_prediction.get("epoch_high_s") if full_prediction else None,
        "predicted_epoch_seconds": predicted,
        "predicted_epoch_std_seconds": predicted_std,
        "predicted_epoch_low_seconds": low,
        "predicted_epoch_high_seconds": high,
        "predicted_at_batch": at,
        "prediction_error_pct": error,
        "predicted_unmeasured_saves": prediction["unmeasured_saves"] if prediction is not None else None,
        "predicted_store_fill_batch": prediction.get("store_fill_batch") if prediction is not None else None,
        "predicted_store_fill_seconds": prediction.get("store_fill_s") if prediction is not None else None,
        "predicted_fit_seconds": fit,
        "predicted_fit_std_seconds": fit_std,
        "predicted_fit_low_seconds": fit_low,
        "predicted_fit_high_seconds": fit_high,
        "samples": int(samples) if samples_known else None,
        "samples_per_sec": samples / wall_s if samples_known and wall_s > 0 else None,
        "phases_ms": (phases := {p: mean_ms(i) for i, p in enumerate(PHASES)}),
        "dominant_phase": dominant_phase(phases),
        "phase_segments_ms": [list(s) for s in segments or []],
        "slow_steps": slow_steps.attribute(segments) if segments else None,
        "phases_max_ms": {p: max_ms(i) for i, p in enumerate(PHASES)},
        "host_phases_ms": {p: mean_ms(NUM_PHASES + i) for i, p in enumerate(PHASES)},
        "slowest_rank": slowest,
        "rank_spread_pct": pct,
        "world_size": n,
        "timeline": timeline,
    }
