"""The fit-end table and the optional stacked-bar chart of the phase breakdown per epoch."""

from __future__ import annotations

import logging
from pathlib import Path

from lightning_embcache.profiling.slow_steps import attribute, describe
from lightning_embcache.profiling.summary import dominant_phase
from lightning_embcache.profiling.timeline import PHASES

log = logging.getLogger(__name__)

PLOT_TITLE = "StepProfiler: where each step's time goes"


def overall(epochs: list[dict], rank_rows: list[list[float]] | None = None) -> dict | None:
    """Batch-weighted means over all epochs of a summary (same keys as one epoch's dict).

    ``rank_rows``: per rank, ``[seconds of each phase..., batches]`` summed over the fit; gives the
    per-rank maximum of each phase's mean (without it, the largest per-epoch maximum)."""
    batches = sum(e["batches"] for e in epochs)
    if not batches:
        return None
    wall = sum(e["epoch_seconds"] for e in epochs)
    phases = {p: sum(e["phases_ms"][p] * e["batches"] for e in epochs) / batches for p in PHASES}
    if rank_rows:
        maxima = {p: max(1e3 * r[i] / r[-1] if r[-1] else 0.0 for r in rank_rows) for i, p in enumerate(PHASES)}
    else:
        maxima = {p: max(e["phases_max_ms"][p] for e in epochs if e["batches"]) for p in PHASES}
    steady_n = sum(e["steady_batches"] for e in epochs)
    steady = (sum(e["steady_batch_ms"] * e["steady_batches"] for e in epochs) / steady_n
              if steady_n else None)
    return {"batches": batches, "epoch_seconds": wall, "avg_batch_ms": 1e3 * wall / batches,
            "steady_batch_ms": steady, "phases_ms": phases, "phases_max_ms": maxima,
            "world_size": epochs[-1]["world_size"], "timeline": epochs[-1]["timeline"],
            "slowest_rank": epochs[-1]["slowest_rank"],
            "rank_spread_pct": max(e["rank_spread_pct"] for e in epochs)}


def format_table(epochs: list[dict], rank_rows: list[list[float]] | None = None) -> str:
    """The table printed at fit end: phase, ms/step, % of step, per-rank max."""
    tot = overall(epochs, rank_rows)
    if tot is None:
        return "StepProfiler: no training batches were profiled."
    step = sum(tot["phases_ms"].values())
    lines = [
        f"StepProfiler: {tot['batches']} batches in {len(epochs)} epoch(s), "
        f"{tot['epoch_seconds']:.3f} s of training, timeline: {tot['timeline']}, ranks: {tot['world_size']}",
        f"{'phase':<12}{'ms/step':>11}{'% of step':>11}{'rank max':>11}",
    ]
    for p in PHASES:
        ms = tot["phases_ms"][p]
        pct = 100.0 * ms / step if step > 0 else 0.0
        lines.append(f"{p:<12}{ms:>11.3f}{pct:>10.1f}%{tot['phases_max_ms'][p]:>11.3f}")
    lines.append(f"{'step':<12}{step:>11.3f}{100.0:>10.1f}%")
    steady = tot["steady_batch_ms"]
    lines.append(f"true average batch: {tot['avg_batch_ms']:.3f} ms (wall / batches, warm-up included); "
                 f"steady: {'n/a' if steady is None else f'{steady:.3f} ms'}")
    last = epochs[-1]
    if last.get("samples_per_sec") is not None:
        lines.append(f"throughput (last epoch): {last['samples_per_sec']:.1f} samples/s")
    lines.extend(_prediction_lines(epochs))
    if last.get("projected_epoch_seconds") is not None and last["epoch_batches"] > last["batches"]:
        full, low = last.get("predicted_full_epoch_seconds"), last.get("predicted_full_epoch_low_seconds")
        predicted = "" if full is None else (
            f"predicted {full:.1f} s (90% interval {low:.1f}-{last['predicted_full_epoch_high_seconds']:.1f} s); "
            if low is not None else f"predicted {full:.1f} +/- {last['predicted_full_epoch_std_seconds']:.1f} s; ")
        lines.append(f"a full epoch ({last['epoch_batches']} batches): {predicted}at the last epoch's rate "
                     f"{last['projected_epoch_seconds']:.1f} s")
    tier = last.get("device_tier")
    if tier is not None:
        where = (
            "rows in host RAM, trained in place by the GPU" if tier["rows_in_host_ram"] else "rows cached on the GPU"
        )
        rate = tier.get("host_to_device_bytes_per_s")
        speed = "" if rate is None else (
            f" ({rate / 1e9:.2f} GB/s up, {tier['device_to_host_bytes_per_s'] / 1e9:.2f} GB/s down)")
        hit = tier.get("lookup_hit_rate")
        window = "" if hit is None else (
            f"; {100 * hit:.1f}% of looked-up rows already on the GPU, "
            f"{tier.get('rows_staged_ahead_per_step', 0.0):.0f} rows/step staged ahead")
        lines.append(
            f"GPU tier (last epoch; {where}): {tier['host_to_device_bytes_per_step'] / 2**20:.2f} MiB/step "
            f"host->device, {tier['device_to_host_bytes_per_step'] / 2**20:.2f} MiB/step device->host{speed}, "
            f"{tier['rows_loaded_per_step']:.0f} rows loaded/step{window}; waiting for them is store_io"
        )
    if tot["world_size"] > 1:
        lines.append(
            f"slowest rank (last epoch): {tot['slowest_rank']}; "
            f"spread of batch time across ranks: {tot['rank_spread_pct']:.1f}%"
        )
    slow = attribute([s for e in epochs for s in e.get("phase_segments_ms") or ()])
    if slow is not None:
        lines.append(describe(slow))
    # the last epoch's, as its summary says (the first epoch's warm-up and one-off costs, such as
    # an optimizer creating its state, can make another phase dominate the fit's mean)
    dominant = last.get("dominant_phase") or dominant_phase(last["phases_ms"])
    whole = dominant_phase(tot["phases_ms"])
    fit = "" if whole == dominant or len(epochs) == 1 else f"; over the whole fit: {whole}"
    lines.append(f"dominant phase: {dominant} (last epoch{fit}; see docs/profiler.md for what to do about it)")
    return "\n".join(lines)


def _prediction_lines(epochs: list[dict]) -> list[str]:
    """Per epoch: the wall time predicted early in the epoch against the actual one."""
    rows = [e for e in epochs if e.get("predicted_epoch_seconds") is not None]
    if not rows:
        return []
    lines = [
        f"{'epoch':<7}{'batches':>9}{'actual s':>11}{'predicted s':>13}{'90% interval s':>17}{'at batch':>10}"
        f"{'error':>9}  inside"
    ]
    for e in epochs:
        pred = e.get("predicted_epoch_seconds")
        actual = e.get("epoch_wall_seconds", e["epoch_seconds"] + e.get("val_seconds", 0.0))
        if pred is None:
            lines.append(f"{e['epoch']:<7}{e['batches']:>9}{actual:>11.2f}{'-':>13}{'':>17}{'':>10}{'':>9}")
            continue
        err = e.get("prediction_error_pct")
        err_s = f"{err:+.1f}%" if err is not None else "n/a"
        low, high = e.get("predicted_epoch_low_seconds"), e.get("predicted_epoch_high_seconds")
        if low is None:  # a summary from a version without the interval: one standard deviation
            low = pred - e["predicted_epoch_std_seconds"]
            high = pred + e["predicted_epoch_std_seconds"]
        inside = "" if err is None else ("yes" if low <= actual <= high else "NO")
        lines.append(
            f"{e['epoch']:<7}{e['batches']:>9}{actual:>11.2f}{pred:>13.2f}"
            f"{f'{low:.2f}-{high:.2f}':>17}{e['predicted_at_batch']:>10}{err_s:>9}  {inside}"
        )
    fills = [(e["epoch"], e["predicted_store_fill_batch"]) for e in rows if e.get("predicted_store_fill_batch")]
    for epoch, batch in fills:
        lines.append(
            f"(epoch {epoch}: the prediction came before the stores' hot tiers fill up, at about batch "
            f"{batch}; batches after that, each evicting rows, were charged at an estimate "
            "from the bytes they bring in)"
        )
    unmeasured = max((e.get("predicted_unmeasured_saves") or 0) for e in rows)
    if unmeasured:
        lines.append(
            f"(up to {unmeasured} checkpoint save(s) per epoch came before any was measured: "
            "a prediction charges those at an estimate from the bytes a save writes)"
        )
    return ["epoch wall time (validation inside the epoch included), predicted early in each epoch:", *lines]


def save_plot(epochs: list[dict], path: str | Path) -> bool:
    """Stacked bars of ms/step per phase, one bar per epoch. False (and a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning(
            "StepProfiler(plot=%r): matplotlib is not installed, so no chart was saved "
            "(pip install 'lightning_embcache[plot]').",
            str(path),
        )
        return False
    fig, ax = plt.subplots(figsize=(max(6.5, 0.6 * len(epochs) + 4.5), 4.0))
    xs = [str(e["epoch"]) for e in epochs]
    bottom = [0.0] * len(epochs)
    for p in PHASES:
        heights = [e["phases_ms"][p] for e in epochs]
        ax.bar(xs, heights, bottom=bottom, label=p)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("epoch")
    ax.set_ylabel("ms per training step")
    # the title on the figure, not the axes: the legend beside the bars narrows the axes, and an
    # axes title wider than them was cut at the figure's edge
    fig.suptitle(PLOT_TITLE)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True


def print_table(table: str) -> None:
    """Show the end-of-fit table: through Lightning's INFO log where that reaches the console (its
    default), else printed: with logging at WARNING (or a handler-less logger) it would vanish."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info
    from lightning_utilities.core import rank_zero as _rz

    if _rz.log.isEnabledFor(logging.INFO) and _rz.log.hasHandlers():
        rank_zero_info(table)
    else:
        print(table, flush=True)
