"""`RowOptimizer`: the base class of the sparse row-wise optimizers.

A row optimizer updates only the rows it is given. The caller (the store, the Lightning mixin,
or `step_rows` for plain tensors) gathers the B touched rows and their per-row state, calls
`step`, and writes them back. Subclasses declare their state columns in `_state_columns` and do
the arithmetic in `_update`; everything else (the learning rate, per-row step counts, dtypes,
the scheduler handle, checkpoints) lives here.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_embcache.optim._checks import check_bool, check_number
from lightning_embcache.optim.rounding import ROUNDED_DTYPES, stochastic_round, uniform_noise
from lightning_embcache.store.errors import InvalidArgumentError, InvalidTypeError

StateFields = dict[str, tuple[torch.dtype, int]]

STEP_FIELD = "step"


def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Optimizer state is float32 for float32/float16/bfloat16 rows and float64 for float64 rows."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RowOptimizer:
    """Sparse row-wise optimizer: updates the rows in a batch and their per-row state, nothing else.

    Example::

        opt = make_row_optimizer("adam", lr=1e-3)
        fields = opt.state_fields(dim=128, dtype=torch.float32)   # {"exp_avg": (float32, 128), ...}
        ids, grads = coalesce(ids, grads)                          # unique rows, summed gradients
        w = table[ids]; st = {k: state[k][ids] for k in fields}
        opt.step(w, st, grads, step=global_step)                   # in place on w and st
        table[ids] = w; for k in fields: state[k][ids] = st[k]

    Notes:
        * Every state column starts at zero: each optimizer is written so that an all-zero state is
          its correct initial state (Adagrad keeps the sum of squares *without*
          `initial_accumulator_value` and adds it when it divides). A store can therefore create
          optimizer fields zero-filled, and rows never touched need no state written.
        * `step` is the optimizer's global step count, 1 for the first call (what
          `torch.optim.SparseAdam` and `torch.optim.Adagrad` use for bias correction and lr decay:
          one count per parameter). With `per_row_step=True` the optimizer adds an int32 column
          `"step"` and uses each row's own count (how many times that row was updated) instead; the
          global `step` argument is then ignored.
        * `lr` is a plain attribute read at every `step`; a scheduler can drive it through
          `as_torch_optimizer()`, or `follow()` another optimizer's param group.
        * Rows may be float16/bfloat16: the update is computed in the state dtype (float32) and
          rounded back into the rows once, to nearest or (``stochastic_rounding=True``) stochastically.

    Args:
        lr: learning rate, >= 0.
        per_row_step: keep a per-row int32 step count column `"step"` and use it instead of the
            global step.

    Raises:
        InvalidArgumentError: an argument is out of range (the message names it and the range).
        InvalidTypeError: an argument has the wrong type.
    """

    #: name used by `make_row_optimizer`
    name: ClassVar[str] = ""

    def __init__(self, *, lr: float, per_row_step: bool = False) -> None:
        # The param group dict is the single home of the hyperparameters, so that a torch LR
        # scheduler writing `param_groups[0]["lr"]` through `as_torch_optimizer()` is seen here.
        self._own_group: dict[str, Any] = {"lr": check_number("lr", lr, ge=0.0)}
        self.per_row_step = check_bool("per_row_step", per_row_step)
        self._torch_view: torch.optim.Optimizer | None = None
        self._followed: dict[str, Any] | None = None
        self._follow_scale = 1.0

    @property
    def _group(self) -> dict[str, Any]:
        # Once a torch view exists its param group is the truth (torch's load_state_dict replaces
        # the dict object, so holding on to our own copy would miss restored values).
        if self._torch_view is not None:
            return self._torch_view.param_groups[0]
        return self._own_group

    # -- learning rate -------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The learning rate used by the next step (a torch optimizer's group lr, when following one)."""
        if self._followed is not None:
            return float(self._followed["lr"]) * self._follow_scale
        return self._group["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        if self._followed is not None:
            raise InvalidArgumentError("lr cannot be set while it follows a param group; "
                                       "call follow(None) first")
        self._group["lr"] = check_number("lr", value, ge=0.0)

    def follow(self, param_group: dict[str, Any] | None, *, scale: float = 1.0) -> None:
        """Take `lr` from another optimizer's param group, times `scale`, at every step.

        For Lightning's automatic optimization (one optimizer per module): a scheduler attached to
        the model's optimizer then drives the rows too, e.g.
        `rows_opt.follow(trainer.optimizers[0].param_groups[0], scale=row_lr / model_lr)`.
        `follow(None)` stops following and keeps the last value.
        """
        if param_group is None:
            if self._followed is not None:
                value = self.lr
                self._followed = None
                self.lr = value
            return
        if not isinstance(param_group, dict) or "lr" not in param_group:
            raise InvalidTypeError(f"param_group must be a dict with an 'lr' key; got {param_group!r:.80}")
        self._follow_scale = check_number("scale", scale, ge=0.0)
        self._followed = param_group

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """One param group holding `lr` (the same dict the torch view exposes)."""
        return [self._group]

    def as_torch_optimizer(self) -> torch.optim.Optimizer:
        """A parameterless `torch.optim.Optimizer` sharing this optimizer's `lr`.

        Torch and Lightning LR schedulers only accept `torch.optim.Optimizer` instances; hand them
        this view (`LambdaLR(opt.as_torch_optimizer(), ...)`, or return it from
        `configure_optimizers` with its scheduler). Its `param_groups[0]` is the dict this row
        optimizer reads `lr` from, so a scheduler's writes take effect at the next `step`. Its own
        `step()` does nothing: the rows are updated by whoever calls `RowOptimizer.step`. Its
        `state_dict()` carries `lr`, so a checkpoint restores the scheduled value. The same
        object is returned on every call.
        """
        if self._torch_view is None:
            self._torch_view = _LRView(self)
        return self._torch_view

    # -- state ---------------------------------------------------------------------------------
    def state_fields(self, dim: int, dtype: torch.dtype = torch.float32) -> StateFields:
        """Per-row state columns this optimizer needs for rows of `dim` values of `dtype`.

        Returns `{name: (column dtype, number of columns)}`, e.g. Adam's
        `{"exp_avg": (torch.float32, dim), "exp_avg_sq": (torch.float32, dim)}`. All start at zero.
        """
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"dim must be an int >= 1; got {dim!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidTypeError(f"dtype must be a floating torch.dtype; got {dtype!r}")
        fields = dict(self._state_columns(dim, state_dtype_for(dtype)))
        if self.per_row_step:
            fields[STEP_FIELD] = (torch.int32, 1)
        return fields

    def init_state(self, num_rows: int, dim: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> dict[str, Tensor]:
        """Zero-filled state tensors `{name: Tensor[num_rows, cols]}` for a table held in memory."""
        return {name: torch.zeros(num_rows, cols, dtype=dt, device=device)
                for name, (dt, cols) in self.state_fields(dim, dtype).items()}

    # -- the update ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, weights: Tensor, state: dict[str, Tensor], grads: Tensor, *,
             step: int, lr: float | None = None, ids: Tensor | None = None,
             stochastic_rounding: bool = False, seed: int = 0) -> None:
        """Update `weights` (Tensor[B, dim]) and every `state[name]` (Tensor[B, cols]) in place.

        Args:
            weights: the B rows, each id at most once (see `coalesce`).
            state: the same B rows of every column in `state_fields`.
            grads: Tensor[B, dim], the summed gradient of each row.
            step: the global step count including this step (>= 1); ignored with
                `per_row_step=True`.
            lr: overrides `self.lr` for this call only.
            ids: the B rows' ids; they key the random numbers of stochastic rounding (default:
                the positions 0..B-1).
            stochastic_rounding: write 16-bit rows back with unbiased stochastic rounding
                (`lightning_embcache.optim.rounding`) instead of round-to-nearest; deterministic
                in ``(seed, step, id)``. Ignored for 32/64-bit rows.
            seed: the rounding's seed.
        """
        if lr is None:
            lr = self.lr
        if self.per_row_step:
            counts = state[STEP_FIELD]
            counts.add_(1)
            row_step: int | Tensor = counts.to(torch.float64 if weights.dtype == torch.float64
                                               else torch.float32)
        else:
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise InvalidArgumentError(f"step must be an int >= 1; got {step!r}")
            row_step = step
        compute = state_dtype_for(weights.dtype)
        if weights.dtype == compute:
            self._update(weights, state, grads.to(compute), step=row_step, lr=lr)
        else:  # low-precision rows: one upcast, one rounding
            w = weights.to(compute)
            self._update(w, state, grads.to(compute), step=row_step, lr=lr)
            if stochastic_rounding and weights.dtype in ROUNDED_DTYPES:
                keys = ids if ids is not None else torch.arange(len(w), device=w.device)
                noise = uniform_noise(keys.to(w.device), w.shape[1], step=step, seed=seed)
                weights.copy_(stochastic_round(w, weights.dtype, noise))
            else:
                weights.copy_(w)

    # -- for subclasses ------------------------------------------------------------------------
    def _state_columns(self, dim: int, dtype: torch.dtype) -> StateFields:
        """The state columns besides the optional per-row step (override)."""
        return {}

    def _update(self, w: Tensor, state: dict[str, Tensor], g: Tensor, *,
                step: int | Tensor, lr: float) -> None:
        """The arithmetic (override). `step` is an int, or a Tensor[B, 1] with per-row counts."""
        raise NotImplementedError

    def _hparams(self) -> dict[str, Any]:
        """Hyperparameters besides `lr` and `per_row_step`, for repr and state_dict (override)."""
        return {}

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The hyperparameters (lr included, as a scheduler left it); per-row state lives with the rows."""
        return {"name": self.name, "lr": self.lr, "per_row_step": self.per_row_step, **self._hparams()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `lr` from `state_dict()`; other hyperparameters must match this optimizer's."""
        mine = self.state_dict()
        for key, value in state.items():
            if key == "lr":
                continue
            if key not in mine or mine[key] != (tuple(value) if isinstance(value, list) else value):
                raise InvalidArgumentError(
                    f"state_dict[{key!r}] must equal this optimizer's {mine.get(key)!r}; got {value!r}")
        if self._followed is None:          # a followed group is restored with its own optimizer
            self.lr = state["lr"]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in {"lr": self.lr, **self._hparams(),
                                                    "per_row_step": self.per_row_step}.items())
        return f"{type(self).__name__}({args})"


class _LRView(torch.optim.Optimizer):
    """A torch Optimizer with one empty parameter; the row optimizer reads `lr` from its param group."""

    def __init__(self, owner: RowOptimizer) -> None:
        placeholder = torch.nn.Parameter(torch.empty(0))
        super().__init__([placeholder], {"lr": owner.lr})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        # The rows are stepped by RowOptimizer.step; this view only carries the lr.
        if closure is not None:
            with torch.enable_grad():
                closure()
        return None
