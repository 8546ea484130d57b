"""Training loops shared by the equivalence tests: torch's sparse embedding vs our row optimizer."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_embcache.optim import RowGradBuffer, RowOptimizer, step_rows

NUM_ROWS, DIM, BATCH, STEPS = 40, 8, 24, 200


def batches(seed: int, steps: int = STEPS, micro: int = 1, num_rows: int = NUM_ROWS,
            batch: int = BATCH, all_rows: bool = False) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, `micro` micro-batches of (ids, targets); every batch holds duplicate ids.

    With `all_rows=True` each micro-batch holds every row once plus `batch // 4` repeats.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro):
            if all_rows:
                ids = torch.cat([torch.randperm(num_rows, generator=gen),
                                 torch.randint(0, num_rows, (batch // 4,), generator=gen)])
            else:
                ids = torch.randint(0, num_rows, (batch,), generator=gen)
                ids[: batch // 4] = ids[batch // 4: batch // 2]          # force duplicates
            step.append((ids, torch.randn(len(ids), DIM, generator=gen)))
        out.append(step)
    return out


def loss_fn(rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Depends on the rows non-linearly, so a wrong update compounds over the steps.
    return (rows - targets).pow(2).sum() * 0.5 + rows.tanh().sum()


def initial_weights(seed: int, num_rows: int = NUM_ROWS) -> torch.Tensor:
    return torch.randn(num_rows, DIM, generator=torch.Generator().manual_seed(seed + 1))


def train_torch(make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer], seed: int,
                micro: int = 1, num_rows: int = NUM_ROWS, all_rows: bool = False) -> torch.Tensor:
    """nn.Embedding(sparse=True) + a torch optimizer; micro-batches accumulate into one sparse grad."""
    emb = nn.Embedding(num_rows, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(initial_weights(seed, num_rows))
    opt = make_opt([emb.weight])
    for step in batches(seed, micro=micro, num_rows=num_rows, all_rows=all_rows):
        opt.zero_grad()
        for ids, targets in step:
            loss_fn(emb(ids), targets).backward()
        opt.step()
    return emb.weight.detach()


def train_rows(opt: RowOptimizer, seed: int, micro: int = 1, num_rows: int = NUM_ROWS, all_rows: bool = False) -> torch.Tensor:
    """Our path: gather rows with autograd, collect their gradients, one row step per optimizer step."""
    weight = initial_weights(seed, num_rows)
    state = opt.init_state(num_rows, DIM)
    buffer = RowGradBuffer()
    for t, step in enumerate(batches(seed, micro=micro, num_rows=num_rows, all_rows=all_rows), start=1):
        for ids, targets in step:
            rows = weight.index_select(0, ids).requires_grad_()
            loss_fn(rows, targets).backward()
            buffer.add(ids, rows.grad)
        ids, grads = buffer.pop()
        step_rows(opt, weight, state, ids, grads, step=t, coalesced=True)
    return weight


def train_dense_lazy(update: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None], seed: int,
                     micro: int = 1, num_rows: int = NUM_ROWS, all_rows: bool = False) -> torch.Tensor:
    """A dense reference: the full gradient from a dense nn.Embedding, and a mask of touched rows.

    `update(weight, grad, touched_mask, step)` must change only masked rows, in place.
    """
    emb = nn.Embedding(num_rows, DIM)
    with torch.no_grad():
        emb.weight.copy_(initial_weights(seed, num_rows))
    for t, step in enumerate(batches(seed, micro=micro, num_rows=num_rows, all_rows=all_rows), start=1):
        emb.zero_grad()
        touched = torch.zeros(num_rows, dtype=torch.bool)
        for ids, targets in step:
            loss_fn(emb(ids), targets).backward()
            touched[ids] = True
        with torch.no_grad():
            update(emb.weight, emb.weight.grad, touched, t)
    return emb.weight.detach()
