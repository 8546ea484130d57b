"""What an embedding store whose hot tier fills during an epoch adds to the epoch's time: the cost
model the epoch-time prediction charges for a cold store's first epoch (every row a batch brings
in is new), from the fill's projection (batch, bytes per batch, the hot tiers' budget).

Early in the epoch nothing has paid it and the stores' statistics hold no measurement of it yet
(nothing has been written), so the model's rates are constants measured on a development host
(below), with a wide uncertainty. Once the stores have measured the same work in this run (their
flushes' bytes and seconds; their evicted bytes and the seconds of write-back and compaction
after the fill), the measured rates replace the constants (:func:`measured_rates`); once a
checkpoint save after the fill has been timed, the fold rate it ran at replaces
``FOLD_BYTES_PER_S`` (the Forecast measures it)."""

from __future__ import annotations

import math
from typing import NamedTuple

from lightning_embcache.profiling.stores import HotTiers

# An embedding store whose hot tier fills during the epoch, every row it takes in new (a cold
# store's first epoch). A batch at hot-tier fill level s (rows held over the budget) costs
#   bytes_per_batch * (min(s, 1) / STORE_FILLING_BYTES_PER_S + (s / EVICTION_BYTES_PER_S after the fill))
# more than one into an empty tier, and a checkpoint save after the fill
#   hot_bytes * s**2 / FOLD_BYTES_PER_S
# more than before it. Measured in `embcache demo` (1M x 64-dim rows, hot tier a quarter of the
# table, 273 kB a batch, saves every 250 batches) on the 2-vCPU development host, 46 runs over four
# versions of the store (its compaction and flushes changed between them), against the rate at 5%:
# batches between 5% and the fill +0.5..+1.0 ms (medians per version), batches after the fill
# +1.8..+4.0 ms in full epochs, saves after the fill 0.05-1.30 s; the costs after the fill doubled
# with one store change, halved with the next and rose with the one after. The batches' constants
# are set so that the first three versions weigh the same (mean errors +1%, -10%, +7%; the fourth,
# measured after, -7%); each part differed by a factor of 2-3 between runs of one version: the
# charge's uncertainty. The saves' constant is set on the versions since the first (79 more runs
# of the latest, whose saves after the fill took 0.14-2.1 s): 0.8 GB/s left their full epochs
# -5% to -20% short (median signed error per version), 0.6 GB/s -1% to -16% (docs/benchmarks.md);
# the first version's saves were cheaper (its full epochs +5% at 0.8 GB/s, +11% at 0.6 GB/s).
# The fifth version (compaction folded in a child process, announced chunks read by kernel
# threads) made the batches after the fill cheaper to the training thread: +1.2 ms median (+0.1
# .. +2.5) in 9 full epochs, against the 0.5 GB/s eviction rate's +2.3 ms (full epochs +9% median
# signed); the eviction rate is set on it (+3%)
STORE_FILLING_BYTES_PER_S = 400e6
EVICTION_BYTES_PER_S = 1.4e9
FOLD_BYTES_PER_S = 0.6e9
STORE_CHARGE_CV = 0.6

# Rates measured in the run replace the constants once measured over MEASURED_MIN_BYTES. The
# stores measure the seconds of their own work (flushes; write-back and compaction), most of it in
# background threads that the training thread waits for only in part: it is charged a share of
# them. On the development host, at the median rates the stores measured in full `embcache demo`
# epochs (flushes 330 MB/s; evictions, weighted by fill level, 740 MB/s with the fifth version),
# these
# shares give the constants above; on a host whose disk and cores do the same work faster or slower
# the charge follows. The uncertainty stays STORE_CHARGE_CV: on that host the rates a run measured
# did not tell its costs better than the constants (docs/benchmarks.md), what the training thread
# pays of the work varies with the host's load.
MEASURED_MIN_BYTES = 16 << 20
FILLING_SHARE = 0.8
EVICTION_SHARE = 0.5


class StoreRates(NamedTuple):
    """Rates of the cost model measured in this run (None: not measured enough; the constant).

    ``filling_bytes_per_s`` replaces ``STORE_FILLING_BYTES_PER_S``: the bytes the stores' flushes
    wrote per second of flushing, over ``FILLING_SHARE``. ``eviction_bytes_per_s`` replaces
    ``EVICTION_BYTES_PER_S``: the bytes evicted after the fill, each weighted by the fill level it
    was evicted at, per second of write-back and compaction, over ``EVICTION_SHARE`` (the model's
    eviction term over the batches so far then sums to that share of the seconds measured)."""

    filling_bytes_per_s: float | None = None
    eviction_bytes_per_s: float | None = None
    fold_bytes_per_s: float | None = None  # from checkpoint saves after the fill (Forecast)


class StoreFill(NamedTuple):
    """The stores' hot tiers filling during an epoch: the batch of the epoch at which they are
    full, the bytes each batch brings in, their budget in bytes, and the rates measured in the
    run (:class:`StoreRates`; None: the constants)."""

    batch: int
    bytes_per_batch: float
    hot_bytes: float
    rates: StoreRates | None = None

    def level(self, b: float) -> float:
        """Rows the stores hold at batch ``b`` of the epoch over what their hot tiers hold when
        full (linear in the batch: every batch brings in new rows)."""
        return max(0.0, 1.0 + self.bytes_per_batch * (b - self.batch) / max(1.0, self.hot_bytes))


def store_fill_step_s(fill: StoreFill, a: int, b: int) -> float:
    """Extra seconds of batches ``a .. b-1`` of the epoch (over batches into an empty hot tier)."""
    if b <= a:
        return 0.0
    k = fill.bytes_per_batch / max(1.0, fill.hot_bytes)  # level per batch
    bpb, f = fill.bytes_per_batch, fill.batch

    def level_sum(x0: float, x1: float) -> float:  # sum of level(x) over x0 .. x1-1, level > 0 there
        if x1 <= x0:
            return 0.0
        return (x1 - x0) * (1.0 + k * ((x0 + x1 - 1) / 2.0 - f))

    empty = f - 1.0 / k if k > 0 else -math.inf  # the batch at which the projected tier was empty
    lo = max(a, math.ceil(empty))
    before = level_sum(lo, min(b, f))  # filling: level < 1
    after_n = max(0, b - max(a, f))
    after = level_sum(max(a, f), b) if after_n else 0.0
    filling, eviction, _ = _rates(fill)
    return bpb * ((before + after_n) / filling + after / eviction)


def store_fill_save_s(fill: StoreFill, b: int) -> float:
    """Extra seconds of a checkpoint save at batch ``b`` of the epoch (none before the fill)."""
    return fold_bytes(fill, b) / _rates(fill)[2]


def fold_bytes(fill: StoreFill, b: int) -> float:
    """What a checkpoint save at batch ``b`` waits for, in the model's bytes (0 before the fill):
    ``store_fill_save_s`` is this over the fold rate."""
    if b < fill.batch:
        return 0.0
    return fill.hot_bytes * fill.level(b) ** 2


def _rates(fill: StoreFill) -> tuple[float, float, float]:
    """(filling, eviction, fold) bytes per second: those measured in the run, else the constants."""
    r = fill.rates or StoreRates()
    return (r.filling_bytes_per_s or STORE_FILLING_BYTES_PER_S, r.eviction_bytes_per_s or EVICTION_BYTES_PER_S,
            r.fold_bytes_per_s or FOLD_BYTES_PER_S)


def measured_rates(reading: HotTiers, fill: StoreFill | None, batch: int) -> StoreRates | None:
    """The rates ``reading`` (cumulative since the stores were opened) measured, at ``batch`` of
    an epoch whose hot tiers fill as ``fill`` projects; a rate measured over fewer than
    ``MEASURED_MIN_BYTES`` is None (None for both: None). The eviction rate needs compaction to have run: before it
    has, write-back alone (a few percent of the cost after the fill) would say evictions are
    nearly free."""
    filling = None
    if reading.flushed_bytes >= MEASURED_MIN_BYTES and reading.flush_seconds > 0.0:
        filling = reading.flushed_bytes / reading.flush_seconds / FILLING_SHARE
    eviction = None
    seconds = reading.write_back_seconds + reading.compaction_seconds
    if (fill is not None and reading.evicted_bytes >= MEASURED_MIN_BYTES and reading.compaction_seconds > 0.0
            and batch > fill.batch):
        # batches fill .. batch-1 evicted, at fill levels from 1 to level(batch - 1), linearly
        level = (1.0 + fill.level(batch - 1)) / 2.0
        eviction = reading.evicted_bytes * level / seconds / EVICTION_SHARE
    return None if filling is None and eviction is None else StoreRates(filling, eviction)
