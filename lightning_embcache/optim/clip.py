"""Gradient clipping for gradient rows.

The rows of a table never appear in `model.parameters()`, so Lightning's
`gradient_clip_val`/`gradient_clip_algorithm` does not see them. These helpers apply the same
clipping to coalesced gradient rows:

* `clip_rows_by_value_`: element-wise clamp, the same as Lightning's `"value"` algorithm.
* `clip_rows_by_norm_`: each row's norm at most `max_norm` (per-row clipping, a common choice for
  per-sample latents: one sample's gradient cannot move its row further than the others).
* `clip_grad_norm_with_rows_`: the `"norm"` algorithm over the dense parameters *and* the rows
  together, as if the table were one dense parameter whose gradient is zero outside the batch.

Clip *after* `coalesce`: the norm of the table's dense gradient is the norm of the summed rows, not
of the per-occurrence rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_embcache.optim._checks import check_number
from lightning_embcache.store.errors import InvalidArgumentError


@torch.no_grad()
def clip_rows_by_value_(grads: Tensor, clip_value: float) -> Tensor:
    """Clamp every element of `grads` to [-clip_value, clip_value] in place; returns `grads`."""
    clip_value = check_number("clip_value", clip_value, ge=0.0)
    return grads.clamp_(-clip_value, clip_value)


@torch.no_grad()
def clip_rows_by_norm_(grads: Tensor, max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale each row of `grads` (Tensor[B, dim]) in place so its 2-norm is at most `max_norm`.

    Returns the per-row norms before clipping, Tensor[B]. Rows under the limit are unchanged
    (scale `max_norm / (norm + eps)` clamped to 1, as `torch.nn.utils.clip_grad_norm_`).
    """
    max_norm = check_number("max_norm", max_norm, ge=0.0)
    norms = torch.linalg.vector_norm(grads, dim=1, dtype=torch.float32)
    scale = (max_norm / (norms + eps)).clamp_(max=1.0)
    grads.mul_(scale.unsqueeze(1).to(grads.dtype))
    return norms


@torch.no_grad()
def rows_grad_norm(grads: Tensor, norm_type: float = 2.0) -> Tensor:
    """The `norm_type`-norm of coalesced gradient rows: their contribution to a global norm."""
    return torch.linalg.vector_norm(grads, ord=norm_type, dtype=torch.float32)


@torch.no_grad()
def clip_grad_norm_with_rows_(parameters: Iterable[Tensor] | Tensor, row_grads: Iterable[Tensor],
                              max_norm: float, norm_type: float = 2.0, eps: float = 1e-6) -> Tensor:
    """Clip dense parameters' `.grad` and coalesced gradient rows by their joint norm, in place.

    The same rule as `torch.nn.utils.clip_grad_norm_` (scale `max_norm / (total + eps)`, only if
    below 1), with each tensor of `row_grads` counted as if it were a dense gradient. Returns the
    total norm before clipping (a float32 tensor on the first gradient's device).
    """
    max_norm = check_number("max_norm", max_norm, ge=0.0)
    norm_type = check_number("norm_type", norm_type, gt=0.0) if norm_type != float("inf") else norm_type
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None] + list(row_grads)
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    norms = torch.stack([torch.linalg.vector_norm(g, ord=norm_type, dtype=torch.float32).to(device)
                         for g in grads])
    total = torch.linalg.vector_norm(norms, ord=norm_type)
    scale = (max_norm / (total + eps)).clamp_(max=1.0)   # stays on device: no host sync
    for g in grads:
        g.mul_(scale.to(g.device, g.dtype))
    return total


# ---- max_norm on the rows themselves (nn.Embedding's rule) -------------------------------------
def check_max_norm(max_norm: object, norm_type: object) -> tuple[float | None, float]:
    """Validate ``max_norm`` (None or a finite number > 0) and ``norm_type`` (a number > 0, inf allowed)."""
    if max_norm is not None:
        if (
            isinstance(max_norm, bool)
            or not isinstance(max_norm, (int, float))
            or not 0 < float(max_norm) < float("inf")
        ):
            raise InvalidArgumentError(f"max_norm must be None or a finite number > 0; got {max_norm!r}")
        max_norm = float(max_norm)
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not float(norm_type) > 0:
        raise InvalidArgumentError(
            f"norm_type must be a number > 0 (2.0: Euclidean, float('inf'): max); got {norm_type!r}"
        )
    return max_norm, float(norm_type)


@torch.no_grad()
def renorm_rows(rows: Tensor, max_norm: float, norm_type: float = 2.0) -> tuple[Tensor, Tensor]:
    """`nn.Embedding`'s max_norm rule on rows (Tensor[B, dim]): each row whose `norm_type`-norm
    exceeds `max_norm` is scaled by ``max_norm / (norm + 1e-7)``. Returns (new rows, Tensor[B]
    bool: which rows were scaled); rows under the limit keep their exact bits.

    The arithmetic is `torch.embedding_renorm_`'s: the norm in the rows' compute dtype, the scale
    in double, the product in float32 (rounded once into 16-bit rows).
    """
    compute = torch.float64 if rows.dtype == torch.float64 else torch.float32
    r = rows.to(compute)
    norms = torch.linalg.vector_norm(r, ord=norm_type, dim=1)
    over = norms > max_norm
    scale = torch.where(over, max_norm / (norms.double() + 1e-7), torch.ones_like(norms, dtype=torch.float64))
    return (r * scale.to(compute)[:, None]).to(rows.dtype), over
