"""The arithmetic behind an epoch's predicted wall time: what its steps so far say.

Pure arithmetic on the host-clock wall time of each finished step. The one entry point of the
prediction is :meth:`~lightning_embcache.profiling.predictor.EpochPredictor.predict` (behind
``StepProfiler.predict()``), which feeds a :class:`Forecast` and tells its
:meth:`Forecast.estimate` what the Trainer will still run (batches, validation runs, checkpoint
saves) and what earlier epochs showed.

What makes early steps unrepresentative, and how each is handled:

- **Loader warm-up**: the epoch's first step holds the iterator's creation and the workers'
  start-up. It is counted once in the time so far, never in the rate; each later epoch of the fit
  is charged the same extra time again.
- **Early transients and level shifts** (allocator, caches, JIT, the loader filling its prefetch
  queue; a store's hot tier filling up, after which every new row evicts one; the host getting
  busier): the step times so far are cut into 16 blocks and the latest block boundary where the
  typical step time (block medians) changed significantly is looked for; the rate is the mean
  wall of the steps after that shift, or of the *later half* of the steps when there is none, so
  that transients age out as the epoch goes on and a new level counts as soon as it has lasted
  three blocks.
- **A trend in store_io** (a cold store tier warming up, a hot tier filling): if the store time
  per step differs between the two halves of that later half by more than twice its standard
  error, the trend is carried on, at its measured slope, for as many steps as the epoch has run
  so far, then held level; the store time per step is never projected below zero.
- **The GPU running behind the host**: on CUDA the rate is the device's time per step of the
  sampled steps (event to event), and the steps the host has queued but the device not yet run
  are counted as still to come; no prediction before 3 sampled steps have been read.
- **Validation**: runs inside the epoch are timed apart; the runs still to come (from the
  Trainer's ``val_check_batch``) are charged at the measured mean time of a run, or before the
  first run at the sanity check's last batch times the validation batches.
- **Checkpoint saves**: steps during which a checkpoint was saved are kept out of the rate; the
  saves still to come (``ModelCheckpoint(every_n_train_steps=...)``) are charged at the measured
  extra time of a save. Before any save has been measured they are charged at an estimate from
  the bytes a save writes (:func:`save_estimate_s`), with half of it as their uncertainty, and
  counted in ``unmeasured_saves``.
- **A store's hot tier filling up** (a cold store's first epoch: every row a batch brings in is
  new): the callback projects from two readings of the stores' ``stats()`` the batch at which
  their hot tiers will be full, the bytes each batch brings in and the tiers' budget
  (:class:`StoreFill`). Nothing before the 5% point has paid what comes later, and the store's
  statistics hold no measurement of it yet (nothing has been written), so it is charged from a
  cost model measured on the store (:mod:`~lightning_embcache.profiling.store_fill`): the store's
  time per batch grows as the hot tier fills; after the fill every batch evicts as many rows as it
  brings in, at a cost that grows with the rows the store holds (background compaction folds them
  into a table on disk that keeps growing); and a checkpoint save after the fill waits for that
  folding, longer the larger the table. The share of it the rate's window already holds is left
  out, and the uncertainty is a large fraction of the charge (the costs differ by a factor of 2-3
  between runs on one host, and by 2 between versions of the store). Rates the stores measured
  in the run replace the model's constants once there is enough of them (the callback reads
  them with the fill); once saves after the fill have been timed in the epoch, the saves to come
  are charged their usual cost plus the model's wait at the rate the timed ones ran at.
- **The host's speed wandering within an epoch** (on a GPU host, a step time whose level moves
  by 10-30% for seconds at a time and comes back; the first 5% of an epoch catches one level):
  from the second epoch of a fit on, a device-timed rate is combined with the previous whole
  epoch's mean step time (:func:`epoch_level`), each weighted by the inverse of its uncertainty:
  the window's from the level variation over the blocks it spans, the previous epoch's from the
  level variation over its 20 blocks plus the drift its two halves showed, taken twice (one
  epoch on). A rate after a level shift, a store trend or a hot tier filling is left as it is:
  the workload changed. Host-timed (CPU) rates are left as they are: on the shared CPU hosts
  measured, the level moved between epochs as much as within one.
- **Rare slow steps** (the training thread waiting while another process runs on its core, a
  few times a second on a shared host): the window of the first 5% is short and usually holds
  fewer of them than the epoch will. From the second epoch of a fit on, the window's share of
  time in slow steps (over 3x the median) is replaced by the share the previous whole epoch had
  (:func:`slow_share`).

The uncertainty (one standard deviation) comes from the spread of the step times: the standard
error of the rate by the method of batch means (blocks of consecutive steps, so that steps that
are slow together count as one observation), times the batches to go, combined with the
step-to-step spread over those batches, and half the size of any trend correction; and the
variation of the host's speed between blocks of steps, as earlier epochs showed it and at least
as this epoch's steps so far show it (:func:`level_variation_so_far`).

The interval (``low`` .. ``high``, meant to hold the actual epoch 9 times in 10) is not that
standard deviation times 1.645: a host whose speed moves 10-40% within an epoch moves the rest of
the epoch off the rate by far more than the rate's own spread says, and the replays of recorded
runs found two standard deviations missing the actual epoch one time in four to one in two. So
the interval also counts the rest of the epoch running off the rate by the drift of the host's
speed seen so far: in this epoch's steps (:func:`level_drift`: the largest departure of a block
of steps' typical time from the typical block) and in every earlier whole epoch of the fit
(:func:`level_spread`: the slowest block's typical time less the fastest's, since the next
epoch's first steps may catch either level). In a fit's first epoch, where nothing yet says how
far the host drifts, by at least ``FIRST_EPOCH_DRIFT`` for a rate timed on the host clock (what the
replays of CPU hosts showed) or ``FIRST_EPOCH_DEVICE_DRIFT`` for a device-timed rate (a step the
GPU sets holds its speed); after ``k`` whole epochs by at least that floor over ``k + 1`` (the next
epoch drifts further than all ``k`` seen one time in ``k + 1``).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import numpy as np

from lightning_embcache.profiling.store_fill import (
    STORE_CHARGE_CV,
    StoreFill,
    StoreRates,
    fold_bytes,
    store_fill_save_s,
    store_fill_step_s,
)

MIN_STEPS = 8  # steps (after the first) before a prediction is made
SHIFT_BLOCKS = 16  # blocks of steps the level-shift search compares
SHIFT_T = 5.0  # |t| of the block medians before and after a boundary that counts as a shift
SHIFT_MIN_CHANGE = 0.02  # ... and by at least this fraction of the step time
SHIFT_MIN_AFTER = 3  # blocks a new level must have lasted to set the rate


LEVEL_BLOCKS = 20  # blocks of an epoch whose mean step times give its level variation
SO_FAR_BLOCKS = 16  # blocks (of at least 4 steps) of the running epoch's steps so far, likewise

# A checkpoint save not measured yet: a fixed cost (Lightning's checkpoint dict, opening the file)
# plus the bytes of the model's and optimizers' tensors at the rate torch.save wrote them on the
# benchmark hosts (268 MB: 0.65 s on the 2-vCPU host, 0.7-1.1 s from an H100's memory on its host)
SAVE_FIXED_S = 0.010
SAVE_BYTES_PER_S = 400e6


def save_estimate_s(nbytes: float) -> float:
    """Estimated seconds of one checkpoint save that writes ``nbytes`` of tensors."""
    return SAVE_FIXED_S + nbytes / SAVE_BYTES_PER_S


# a device-timed rate against the host's steps, whose wall the epoch is: the timed steps miss the
# host's own stalls and the drain at the epoch's end (a device-bound step on an H100 and an H200:
# the host's steps 0.3-0.5% longer than the timed steps' mean)
DEVICE_RATE_CV = 0.005
# a measured save's extra time against the saves still to come: one model's saves varied by 10%
# between epochs on one host (805 MB from an H100's memory: 2.3-2.7 s)
SAVE_MEASURED_CV = 0.1

INTERVAL_Z = 1.645  # a two-sided 90% interval of a normal error
# how far the rest of a host-timed first epoch may run off the rate of its first steps before any
# whole epoch has shown the host's drift: in the replays of recorded CPU-host epochs 90% of the
# first epochs' errors after 5% lay within 25% (the 2-vCPU host) and 53% (a 16-core host)
FIRST_EPOCH_DRIFT = 0.4
# ... and of a device-timed one: a step the GPU sets held within 0.5% over an epoch on the GPU
# hosts replayed, a step its host sets did not; 5% is the smallest floor that held 90% of the
# replayed GPU epochs
FIRST_EPOCH_DEVICE_DRIFT = 0.05
HOST_SETS_STEP = 0.9  # a host step this close to the device's (or longer) sets the step
# a step whose stores' work (store I/O on the training thread) takes this share of the host's
# step or more gets the host clock's first-epoch floor even where the GPU's steps time the rate:
# the demo on an H200 with its codes in a filling device tier spent 14-50% of its steps there and
# ran off its first 5% by up to 29%; the GPU models without a store spend none
STORE_SETS_STEP = 0.1
DRIFT_BLOCKS = 16  # blocks (of at least 4 steps) of the running epoch's steps for level_drift
EPOCH_DRIFT_BLOCKS = 20  # ... and of a finished epoch's

SLOW_STEP = 3.0  # a step over this many times the median step is a slow step
PREVIOUS_MAX_T = 3.0  # a rate this many standard deviations from the previous epoch's is not combined with it


def slow_share(wall: array | list[float] | np.ndarray, skip: Sequence[int] = ()) -> float:
    """The extra time of slow steps (over ``SLOW_STEP`` times the median) per step, as a fraction of
    the median step: how much of the steps' time rare stalls took. The first step (the loader's
    start-up) and the steps in ``skip`` (checkpoint saves) are left out; 0 for fewer than 8."""
    w = np.asarray(wall, dtype=np.float64)[1:]
    if skip:
        keep = np.ones(w.size, dtype=bool)
        keep[[i - 1 for i in skip if 0 < i <= w.size]] = False
        w = w[keep]
    return _slow_share(w)


def _slow_share(w: np.ndarray) -> float:
    if w.size < 8:
        return 0.0
    med = float(np.median(w))
    if med <= 0.0:
        return 0.0
    slow = w[w > SLOW_STEP * med]
    return float((slow - med).sum()) / (w.size * med)


def epoch_level(wall: array | list[float] | np.ndarray,
                skip: Sequence[int] = ()) -> tuple[float, float] | None:
    """A whole epoch's mean step time and how much it moved within the epoch (its second half's
    mean over its first half's, less 1): the level the next epoch's steps are taken to be near,
    and how far that may have drifted by then. The first step (the loader's start-up) and the
    steps in ``skip`` (checkpoint saves) are left out; None for fewer than 8 steps."""
    w = np.asarray(wall, dtype=np.float64)
    keep = np.ones(w.size, dtype=bool)
    keep[:1] = False
    if skip:
        keep[[i for i in skip if 0 <= i < w.size]] = False
    if keep.sum() < 8:
        return None
    half = w.size // 2
    first, second = w[:half][keep[:half]], w[half:][keep[half:]]
    mean = float(w[keep].mean())
    if mean <= 0.0 or not first.size or not second.size or first.mean() <= 0.0:
        return None
    return mean, float(second.mean() / first.mean() - 1.0)


def with_previous_epoch(rate_s: float, se_s: float, window_steps: int, total_batches: int, level_cv: float,
                        previous: tuple[float, float]) -> tuple[float, float, float] | None:
    """The rate combined with the previous epoch's mean step time (:func:`epoch_level`), each
    weighted by the inverse of its variance (relative to the rate): the window's, the level
    variation over the blocks of a twentieth of an epoch it spans (at least one) plus its standard
    error; the previous epoch's, the level variation over its 20 blocks plus twice the drift
    between its halves, squared. Returns the combined rate, the previous epoch's weight and the
    combined variance; None when the two differ by more than ``PREVIOUS_MAX_T`` standard
    deviations of their difference (the workload changed between the epochs, not the host's
    speed) or nothing varied."""
    prev_s, drift = previous
    blocks = max(1.0, LEVEL_BLOCKS * window_steps / max(1, total_batches))
    v_window = level_cv ** 2 / blocks + (se_s / rate_s) ** 2
    v_prev = level_cv ** 2 / LEVEL_BLOCKS + (2.0 * drift) ** 2
    if v_window + v_prev <= 0.0 or abs(rate_s / prev_s - 1.0) > PREVIOUS_MAX_T * math.sqrt(v_window + v_prev):
        return None
    weight = v_window / (v_window + v_prev)
    return weight * prev_s + (1.0 - weight) * rate_s, weight, v_window * v_prev / (v_window + v_prev)


def _batch_means_se(w: np.ndarray) -> float:
    """Standard error of ``w``'s mean by batch means (up to 8 blocks of at least 4 consecutive
    values): consecutive steps are not independent."""
    m = int(w.size)
    blocks = min(8, m // 4)
    if blocks < 2:
        return float(w.std(ddof=1)) / math.sqrt(m)
    size = m // blocks
    means = w[:blocks * size].reshape(blocks, size).mean(axis=1)
    return float(means.std(ddof=1)) / math.sqrt(blocks)


def level_variation_so_far(wall: array | list[float] | np.ndarray) -> float:
    """:func:`level_variation` of the running epoch's steps so far, over up to 16 blocks of at
    least 4 steps (0 for fewer than 4 blocks): how much the host's speed has varied already. Its
    blocks are shorter than a twentieth of the epoch, so it understates what the rest of the
    epoch may bring; it keeps a first epoch's +/- from claiming a steadiness its steps did not
    show."""
    n = len(wall) - 1
    size = max(4, n // SO_FAR_BLOCKS)
    m = n // size
    if m < 4:
        return 0.0
    w = np.asarray(wall, dtype=np.float64)[1:1 + m * size]  # a view of an array('d')
    med = np.median(w.reshape(m, size), axis=1)
    mean = float(med.mean())
    return float(med.std(ddof=1)) / mean if mean > 0 else 0.0


def level_drift(wall: array | list[float] | np.ndarray, blocks: int = DRIFT_BLOCKS, min_size: int = 4) -> float:
    """How far the host's speed drifted in these steps: the largest departure of one block's median
    step time from the median of the blocks' medians, as a fraction of it (``blocks`` blocks of at
    least ``min_size`` steps; the first step, the loader's start-up, left out). A stretch 30% slower
    than the rest shows as 0.3 while it holds a minority of the blocks, about half that once it
    holds half of them; single slow steps move a median little. 0 for fewer than 3 blocks."""
    med = _block_medians(wall, blocks, min_size)
    if med is None:
        return 0.0
    mid = float(np.median(med))
    return float(np.abs(med / mid - 1.0).max()) if mid > 0 else 0.0


def level_spread(wall: array | list[float] | np.ndarray, blocks: int = EPOCH_DRIFT_BLOCKS, min_size: int = 4) -> float:
    """How far apart the host's speeds in these steps lay: the slowest block's median step time
    less the fastest's, as a fraction of the blocks' median (blocks as :func:`level_drift`). A
    later epoch's first steps may catch one level and the rest run at another, so a finished
    epoch's drift is carried over as this span, not as one block's departure from the middle."""
    med = _block_medians(wall, blocks, min_size)
    if med is None:
        return 0.0
    mid = float(np.median(med))
    return float((med.max() - med.min()) / mid) if mid > 0 else 0.0


def _block_medians(wall: array | list[float] | np.ndarray, blocks: int, min_size: int) -> np.ndarray | None:
    """Median step time of each of up to ``blocks`` blocks of at least ``min_size`` steps (the
    first step, the loader's start-up, left out); None for fewer than 3 blocks."""
    n = len(wall) - 1
    size = max(min_size, n // blocks)
    m = n // size
    if m < 3:
        return None
    w = np.asarray(wall, dtype=np.float64)[1:1 + m * size]
    return np.median(w.reshape(m, size), axis=1)


def level_variation(wall: array | list[float]) -> float:
    """Coefficient of variation of the typical (median) step time over blocks of a twentieth of
    the epoch: how much the host's speed changed within it (single slow steps, such as a
    checkpoint save, move a median little). The first step, which holds the loader's start-up,
    is left out; 0 for too short an epoch."""
    n = len(wall) - 1
    size = n // LEVEL_BLOCKS
    if size < 4:
        return 0.0
    w = np.asarray(wall[1:1 + LEVEL_BLOCKS * size], dtype=np.float64)
    med = np.median(w.reshape(LEVEL_BLOCKS, size), axis=1)
    mean = float(med.mean())
    return float(med.std(ddof=1)) / mean if mean > 0 else 0.0


def level_shift(w: np.ndarray) -> int | None:
    """Index into ``w`` (step times in order) where the latest significant level shift starts,
    or None. The steps are cut into blocks; the boundary whose block medians before and after
    differ most (a t statistic over blocks, robust to single slow steps; at least 3 blocks either
    side) counts if the difference is large and significant; then the same is looked for after
    it (binary segmentation: a warm-up, then a store tier filling up)."""
    m = int(w.size)
    if m < 4 * SHIFT_BLOCKS:
        return None
    size = m // SHIFT_BLOCKS
    start = m - SHIFT_BLOCKS * size  # blocks end at the latest step
    med = np.median(w[start:].reshape(SHIFT_BLOCKS, size), axis=1)
    level = float(np.median(med))
    s = 0
    while SHIFT_BLOCKS - s >= 6:
        best, best_t = None, 0.0
        for j in range(s + 3, SHIFT_BLOCKS - SHIFT_MIN_AFTER + 1):
            a, b = med[s:j], med[j:]
            diff = abs(float(b.mean() - a.mean()))
            if diff < SHIFT_MIN_CHANGE * level:
                continue
            se = math.sqrt(float(a.var(ddof=1)) / a.size + float(b.var(ddof=1)) / b.size)
            t = math.inf if se == 0.0 else diff / se
            if t > best_t:
                best, best_t = j, t
        if best is None or best_t <= SHIFT_T:
            break
        s = best
    return start + s * size if s else None


class Forecast:
    """One epoch's steps so far, and what follows from them (:meth:`estimate`); fed and read by
    :class:`~lightning_embcache.profiling.predictor.EpochPredictor`."""

    def __init__(self, start_batches: int = 0, start_seconds: float = 0.0) -> None:
        # a resumed epoch: batches and training seconds of the earlier run, not in the steps below
        self.start_batches = start_batches
        self.start_seconds = start_seconds
        self.wall = array("d")    # per step, host wall seconds (validation excluded)
        self.store = array("d")   # per step, store_io seconds
        self.saves: list[int] = []  # indices of steps during which a checkpoint was saved
        self.val_runs: list[float] = []  # seconds of each validation run in this epoch
        # on a GPU: the device's time for sampled steps (event to event), by step index
        self.device_index: list[int] = []
        self.device_wall = array("d")
        self.backlog = 0  # steps closed on the host that the device may still be running
        # on a GPU no prediction is made before 3 sampled steps have been read: until then the
        # host's step times may only say how fast it queues work
        self.needs_device = False
        self.elapsed = 0.0
        self.shift_detection = True
        self._save_pending = False

    # -- feeding ------------------------------------------------------------------------------

    def add_step(self, wall: float, store: float) -> None:
        if self._save_pending:
            self._save_pending = False
            self.saves.append(len(self.wall))
        self.wall.append(wall)
        self.store.append(store)
        self.elapsed += wall

    def add_steps(self, walls: list[float], stores: list[float]) -> None:
        """Many steps at once, as :meth:`add_step` takes them one by one."""
        if not walls:
            return
        if self._save_pending:
            self._save_pending = False
            self.saves.append(len(self.wall))
        self.wall.extend(walls)
        self.store.extend(stores)
        elapsed = self.elapsed
        for w in walls:  # summed in step order: the same float as one add_step per step
            elapsed += w
        self.elapsed = elapsed

    def add_device_step(self, index: int, seconds: float) -> None:
        self.device_index.append(index)
        self.device_wall.append(seconds)

    def _device_steps(self) -> np.ndarray:
        """The timed steps' device seconds, in the order the steps ran (the timeline reads its
        events back first in, first out)."""
        return np.frombuffer(self.device_wall, dtype=np.float64, count=len(self.device_index))

    def mark_save(self) -> None:
        """A checkpoint is being saved during the step now running."""
        self._save_pending = True

    def add_validation(self, seconds: float) -> None:
        self.val_runs.append(seconds)

    # -- reading ------------------------------------------------------------------------------

    @property
    def batches(self) -> int:
        return self.start_batches + len(self.wall)

    @property
    def first_step_s(self) -> float | None:
        return self.wall[0] if self.wall and not self.start_batches else None

    def rate(self) -> dict | None:
        """The steady rate and its spread; None before ``MIN_STEPS`` steps after the first.
        Vectorised: called at log intervals over up to an epoch of steps."""
        n = len(self.wall)
        if n - 1 < MIN_STEPS or (self.needs_device and len(self.device_index) < 3):
            return None
        wall = np.frombuffer(self.wall, dtype=np.float64, count=n)
        store = np.frombuffer(self.store, dtype=np.float64, count=n)
        # the window the rate is taken over: after the latest level shift, else the later half
        idx = np.arange(1, n)
        if self.saves:
            idx = idx[~np.isin(idx, self.saves)]
        shift = level_shift(wall[idx]) if self.shift_detection else None
        lo = int(idx[shift]) if shift is not None else max(1, n // 2)
        # views of the window, copied only when a checkpoint save falls inside it
        w, st = wall[lo:], store[lo:]
        inside = [i - lo for i in self.saves if i >= lo]
        if inside:
            keep = np.ones(n - lo, dtype=bool)
            keep[inside] = False
            w, st = w[keep], st[keep]
        m = int(w.size)
        if m < 2:
            return None
        mean = float(w.mean())
        std = float(w.std(ddof=1))
        se = _batch_means_se(w)
        # a trend in store time: the two halves of the window
        half = m // 2
        s_a, s_b = st[:half], st[half:]
        slope = 0.0
        level = float(s_b.mean()) if s_b.size else 0.0
        if s_a.size >= 2 and s_b.size >= 2:
            ma = float(s_a.mean())
            se_d = math.sqrt(float(s_a.var(ddof=1)) / s_a.size + float(s_b.var(ddof=1)) / s_b.size)
            if abs(level - ma) > 2.0 * se_d and level != ma:
                slope = (level - ma) / max(1.0, (n - lo) / 2.0)
        # On a GPU the host can run ahead of the device by many steps (until the launch queue or
        # the allocator makes it wait): its early step times then say how fast it launches, not
        # how fast the GPU runs. The sampled steps' device time (event to event: the longer of
        # the two) is the rate there, over the same later half of the epoch.
        device = False
        if self.device_index:
            di = np.asarray(self.device_index)
            dw = self._device_steps()
            sel = (di >= lo) & ~np.isin(di, self.saves) if self.saves else di >= lo
            if sel.sum() < 3:
                sel = di >= 1
            if sel.sum() >= 3:
                d = dw[sel]
                mean, std = float(d.mean()), float(d.std(ddof=1))
                # by batch means over the timed steps: the host's step times say nothing of the
                # device's spread while the host runs ahead of it
                se = max(_batch_means_se(d), std / math.sqrt(d.size))
                device = True
        # the extra time of a checkpoint save: a save step's wall over the rate
        extra = [self.wall[i] - mean for i in self.saves if i > 0]
        return {"mean": mean, "std": std, "se": se, "steps": m, "slope": slope, "store_level": level,
                "device": device, "window_start": lo, "shifted": shift is not None,
                "median": float(np.median(w)), "slow_share": _slow_share(w),
                "window_center": (lo + n - 1) / 2.0, "n": n,
                "save_s": max(0.0, math.fsum(extra) / len(extra)) if extra else None}

    @staticmethod
    def trend_seconds(r: dict, start: float, count: int) -> float:
        """Extra seconds over ``count`` steps from step ``start`` on (step indices of this epoch)
        from the store trend: linear from the window's centre, held level after ``2 * n`` steps
        into the epoch, never driving the store time per step below zero."""
        slope = r["slope"]
        if slope == 0.0 or count <= 0:
            return 0.0
        c, n = r["window_center"], r["n"]
        stop = 2.0 * n  # the trend lasts as long again as the epoch so far, then levels off
        a, b = start, start + count  # steps a .. b-1

        def integral(x0: float, x1: float) -> float:  # sum of slope * (x - c) for x in [x0, x1)
            if x1 <= x0:
                return 0.0
            return slope * ((x1 - x0) * ((x0 + x1 - 1) / 2.0 - c))

        extra = integral(a, min(b, stop)) + slope * (stop - c) * max(0.0, b - max(a, stop))
        # store time per step cannot go below zero
        return max(extra, -r["store_level"] * count) if slope < 0 else extra

    def _saves_around_fill(self, rate: float, fill: StoreFill) -> tuple[float | None, float | None]:
        """The checkpoint saves of this epoch measured before the hot tiers' fill (their mean
        extra seconds: a save's usual cost; None if none) and the fold rate the saves after it ran
        at (the model's bytes over their extra seconds beyond the usual cost; None if none; inf
        if they cost no more than the usual)."""
        before: list[tuple[int, float]] = []
        after: list[tuple[int, float]] = []
        for i in self.saves:
            if i > 0:
                b = self.start_batches + i
                (after if b >= fill.batch else before).append((b, self.wall[i] - rate))
        usual = max(0.0, math.fsum(x for _, x in before) / len(before)) if before else None
        if not after:
            return usual, None
        waited = math.fsum(max(0.0, x - (usual or 0.0)) for _, x in after)
        units = math.fsum(fold_bytes(fill, b) for b, _ in after)
        return usual, (units / waited if waited > 0.0 else math.inf)

    def save_extra(self) -> float | None:
        """Mean extra seconds of the checkpoint saves seen in this epoch (None: none seen)."""
        r = self.rate()
        return None if r is None else r["save_s"]

    def estimate(self, total_batches: int, val_runs_left: float, val_run_s: float | None,
                 saves_left: int, save_s: float | None = None, level_cv: float = 0.0,
                 save_guess_s: float | None = None,
                 store_fill: StoreFill | None = None, save_batches: Sequence[int] = (),
                 slow_share: float | None = None,
                 previous: tuple[float, float] | None = None,
                 drift: float | None = None, drift_epochs: int = 1) -> dict | None:
        """Predicted wall seconds of the epoch (training and the validation inside it) when it has
        run ``total_batches`` batches; None before enough steps. ``save_s``: a save's extra time
        measured in an earlier epoch, used until this epoch has measured one; ``save_guess_s``:
        a save's estimated time (:func:`save_estimate_s`), used while none has been measured.
        ``level_cv``: how much the step time of earlier epochs varied between blocks of a
        twentieth of an epoch (:func:`level_variation`), which widens the uncertainty of the
        batches to go; at least what this epoch's steps so far show
        (:func:`level_variation_so_far`). ``store_fill``: the stores' hot tiers filling in this
        epoch: the batches to go are charged :func:`store_fill_step_s`, less what the rate's
        window already holds of it, and the saves to come (``save_batches``, batches of the epoch)
        :func:`store_fill_save_s` on top of a save's usual cost; once saves after the fill have
        been measured in this epoch, at the fold rate they ran at (their extra time over the usual
        cost of the saves before the fill); the store-time trend is not carried on then (the
        model replaces it).
        ``slow_share``: the previous epoch's :func:`slow_share`, which replaces the window's in
        the rate (host-timed rates only). ``previous``: the previous whole epoch's
        :func:`epoch_level`, combined with a device-timed rate (:func:`with_previous_epoch`)
        unless the window follows a level shift or a store trend, or a hot tier fills.
        ``drift``: the largest :func:`level_spread` of the fit's earlier whole epochs (None: none
        yet), ``drift_epochs`` of them, which widens the 90% interval (``low``, ``high``) with the
        rest of the epoch's time on the rate; at least what this epoch's steps so far show, and at
        least the first epoch's floor (``FIRST_EPOCH_DRIFT``, host-timed, or
        ``FIRST_EPOCH_DEVICE_DRIFT``) over ``1 + drift_epochs``: the next epoch drifts further
        than all ``k`` seen so far one time in ``k + 1``."""
        r = self.rate()
        if r is None:
            return None
        done = self.batches
        left = max(0, total_batches - done)
        if slow_share is not None and not r["device"]:
            # the rare slow steps at the rate the previous epoch had them, not the window's
            r["mean"] = max(0.0, r["mean"] + r["median"] * (slow_share - r["slow_share"]))
        # the host's speed may change within the epoch as it did in earlier ones, and at least
        # as it has so far in this one (on a GPU, in the device's step times: the host's early
        # steps run ahead of the device and vary with the launch queue, not with the step)
        level_cv = max(level_cv, level_variation_so_far(self._device_steps() if r["device"] else self.wall))
        rate_var = None  # the combined rate's relative variance, when the previous epoch's is in it
        r["previous_weight"] = 0.0
        if (previous is not None and r["device"] and r["mean"] > 0.0 and not r["shifted"] and r["slope"] == 0.0
                and store_fill is None):
            combined = with_previous_epoch(r["mean"], r["se"], r["steps"], total_batches, level_cv, previous)
            if combined is not None:
                r["mean"], r["previous_weight"], rate_var = combined
        # steps the host has closed but the device may not have run yet cost their time again
        steps_s = (left + (self.backlog if r["device"] else 0)) * r["mean"]
        trend = self.trend_seconds(r, len(self.wall), left)
        earlier_save_s = save_s
        save_s = r["save_s"] if r["save_s"] is not None else save_s
        measured = save_s is not None
        if not measured:
            save_s = save_guess_s
        r["save_s"] = save_s
        saves_s = saves_left * save_s if save_s is not None else 0.0
        guess_std = (SAVE_MEASURED_CV if measured else 0.5) * saves_s
        val_s = (val_runs_left * val_run_s) if val_run_s is not None else 0.0
        fill_s = fill_step = 0.0
        if store_fill is not None:
            trend = 0.0
            lo = self.start_batches + r["window_start"]
            window_step = store_fill_step_s(store_fill, lo, done) / max(1, done - lo)
            fill_s = store_fill_step_s(store_fill, done, total_batches) - left * window_step
            usual, fold = self._saves_around_fill(r["mean"], store_fill)
            if fold is not None:
                # saves after the fill measured: the saves to come cost their usual time plus the
                # model's wait at the fold rate those saves ran at
                if usual is None:  # no save before the fill in this epoch: an earlier one's, or the estimate
                    usual = next((x for x in (earlier_save_s, save_guess_s) if x is not None), 0.0)
                saves_s = saves_left * usual
                rates = store_fill.rates or StoreRates()
                store_fill = store_fill._replace(rates=rates._replace(fold_bytes_per_s=fold))
            fill_s += math.fsum(store_fill_save_s(store_fill, b) for b in save_batches if b >= done)
            fill_step = store_fill_step_s(store_fill, total_batches - 1, total_batches) - window_step
        fill_std = STORE_CHARGE_CV * abs(fill_s)
        total = (self.start_seconds + self.elapsed + math.fsum(self.val_runs) + steps_s + trend + saves_s
                 + val_s + fill_s)
        # the window the rate was taken over and the batches to go each stand for a number of
        # blocks whose levels (treated as independent) differ by the level variation; with the
        # previous epoch in the rate, the rate's part is the combined variance
        window_blocks = LEVEL_BLOCKS * r["steps"] / max(1, total_batches)
        blocks_left = LEVEL_BLOCKS * left / max(1, total_batches)
        if rate_var is None:
            rate_std = math.hypot(left * r["se"], left * r["mean"] * level_cv / math.sqrt(max(1.0, window_blocks)))
        else:
            rate_std = left * r["mean"] * math.sqrt(rate_var)
        if r["device"]:
            rate_std = math.hypot(rate_std, left * r["mean"] * DEVICE_RATE_CV)
        level_std = left * r["mean"] * level_cv / math.sqrt(max(1.0, blocks_left))
        std = math.sqrt(rate_std ** 2 + left * r["std"] ** 2 + (0.5 * trend) ** 2 + level_std ** 2 + guess_std ** 2
                        + fill_std ** 2)
        # the 90% interval: the estimator's spread, and the rest of the epoch running off the rate by
        # as much as the host's speed has drifted so far (this epoch, earlier ones)
        # (device-timed: the device's steps, and the host's over the rate's window where they take as
        # long as the device's; early in an epoch a host runs ahead of the device and its steps vary
        # with the launch queue, not with the step)
        if r["device"]:
            drift_now = level_drift(self._device_steps())
            if r["median"] >= HOST_SETS_STEP * r["mean"]:
                drift_now = max(drift_now, level_drift(self.wall[r["window_start"] - 1:]))
        else:
            drift_now = level_drift(self.wall)
        # a device-timed step whose host also does the stores' work (a device tier filling, rows
        # written down at each flush) moves as the host does, not as the GPU does
        store_sets = r["store_level"] > STORE_SETS_STEP * r["median"]
        floor = FIRST_EPOCH_DEVICE_DRIFT if r["device"] and not store_sets else FIRST_EPOCH_DRIFT
        if drift is None:
            drift_now = max(drift_now, floor)
        else:
            drift_now = max(drift_now, drift, floor / (1 + max(1, drift_epochs)))
        half = math.hypot(INTERVAL_Z * std, max(0.0, steps_s + trend) * drift_now)
        low = max(self.start_seconds + self.elapsed + math.fsum(self.val_runs), total - half)
        # the rate at the end of this epoch (later epochs run at it), the trend levelled off
        end_rate = r["mean"] + (self.trend_seconds(r, total_batches, 1) if r["slope"] and store_fill is None else 0.0)
        end_rate += fill_step
        return {"seconds": total, "std": std, "low": low, "high": total + half, "drift": drift_now,
                "at_batch": done, "rate_s": r["mean"], "rate": r,
                "end_rate_s": end_rate, "trend_s": trend, "unmeasured_saves": 0 if measured else saves_left,
                "store_fill_s": fill_s,
                "val_known": val_run_s is not None or val_runs_left == 0}
