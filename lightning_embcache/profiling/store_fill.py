"""What an embedding store whose hot tier fills during an epoch adds to the epoch's time: the cost
model the epoch-time prediction charges for a cold store's first epoch (every row a batch brings
in is new), from the fill's projection (batch, bytes per batch, the hot tiers' budget).

Nothing before the prediction point has paid it and the store's statistics hold no measurement of
it yet (nothing has been written), so the model's constants are measured ones (below), with a
wide uncertainty."""

from __future__ import annotations

import math
from typing import NamedTuple

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
# with one store change, halved with the next and rose with the one after. The constants are set
# so that the first three versions weigh the same (mean errors +1%, -10%, +7%; the fourth, measured
# after, -7%); each part differed by a factor of 2-3 between runs of one version: the charge's
# uncertainty
STORE_FILLING_BYTES_PER_S = 400e6
EVICTION_BYTES_PER_S = 500e6
FOLD_BYTES_PER_S = 0.8e9
STORE_CHARGE_CV = 0.6


class StoreFill(NamedTuple):
    """The stores' hot tiers filling during an epoch: the batch of the epoch at which they are
    full, the bytes each batch brings in, and their budget in bytes."""

    batch: int
    bytes_per_batch: float
    hot_bytes: float

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
    return bpb * ((before + after_n) / STORE_FILLING_BYTES_PER_S + after / EVICTION_BYTES_PER_S)


def store_fill_save_s(fill: StoreFill, b: int) -> float:
    """Extra seconds of a checkpoint save at batch ``b`` of the epoch (none before the fill)."""
    if b < fill.batch:
        return 0.0
    return fill.hot_bytes * fill.level(b) ** 2 / FOLD_BYTES_PER_S
