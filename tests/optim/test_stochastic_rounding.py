"""bf16/fp16 rows that keep learning: float32 arithmetic, unbiased stochastic rounding back."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache import EmbeddingStore
from lightning_embcache.optim import make_row_optimizer, step_rows
from lightning_embcache.optim.rounding import stochastic_round, uniform_noise
from lightning_embcache.trainable import TrainableRows, trainable_fields

ROWS, DIM = 32, 16


def _climb(dtype: torch.dtype, rounding: bool | None, steps: int = 2000, seed: int = 0) -> torch.Tensor:
    """`steps` SGD updates of +1e-4 each to rows starting at 1.0, through a store."""
    opt = make_row_optimizer("sgd", lr=1e-4)
    store = EmbeddingStore.create(None, ROWS, DIM, dtype=dtype, init=lambda ids: torch.ones(len(ids), DIM),
                                  seed=seed, fields=trainable_fields(opt, DIM, dtype))
    rows = TrainableRows(store, opt, stochastic_rounding=rounding)
    ids = torch.arange(ROWS)
    for step in range(1, steps + 1):
        (-rows.lookup(ids).float().sum()).backward()    # gradient -1: each update adds lr = 1e-4
        rows.apply(step=step)
    out = store.get(ids).float()
    store.close()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_updates_accumulate_with_stochastic_rounding(dtype):
    on = _climb(dtype, None)          # default: on for 16-bit rows
    assert abs(on.mean().item() - 1.2) < 0.02 * 1.2
    off = _climb(dtype, False)
    assert torch.equal(off, torch.ones_like(off))   # 1e-4 is below half a bf16 (and fp16) step at 1.0


def test_bf16_rounding_is_deterministic_under_a_seed():
    a = _climb(torch.bfloat16, True, steps=50, seed=3)
    b = _climb(torch.bfloat16, True, steps=50, seed=3)
    c = _climb(torch.bfloat16, True, steps=50, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_moments_stay_float32_for_16bit_rows():
    opt = make_row_optimizer("adam")
    fields = trainable_fields(opt, DIM, torch.bfloat16)
    assert fields["exp_avg"] == (torch.float32, DIM) and fields["exp_avg_sq"] == (torch.float32, DIM)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_round_is_unbiased_and_picks_a_neighbour(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=g) * torch.logspace(-6, 3, 64)
    reps = 4000
    values = x.repeat(reps, 1)
    noise = uniform_noise(torch.arange(reps), 64, step=1, seed=0)
    out = stochastic_round(values, dtype, noise).float()
    near = x.to(dtype).float()
    other = torch.where(near > x, torch.nextafter(x.to(dtype), torch.tensor(-float("inf"), dtype=dtype)).float(),
                        torch.nextafter(x.to(dtype), torch.tensor(float("inf"), dtype=dtype)).float())
    assert ((out == near) | (out == other)).all()               # always one of the two neighbours
    gap = (near - other).abs()
    err = (out.mean(0) - x).abs() / gap                          # bias in units of the spacing
    assert err.max() < 0.05, err.max()
    exact = torch.tensor([1.0, -2.5, 0.0], dtype=torch.float32)
    assert torch.equal(stochastic_round(exact, dtype, torch.rand(3)), exact.to(dtype))


def test_noise_does_not_depend_on_the_batch_it_is_in():
    ids = torch.tensor([5, 9, 1000, 3])
    full = uniform_noise(ids, 8, step=7, seed=2)
    assert torch.equal(full[2:3], uniform_noise(ids[2:3], 8, step=7, seed=2))
    assert not torch.equal(full, uniform_noise(ids, 8, step=8, seed=2))
    assert (full >= 0).all() and (full < 1).all()


def test_step_rows_on_a_bf16_table_rounds_stochastically():
    opt = make_row_optimizer("sgd", lr=1e-4)
    w = torch.ones(8, 4, dtype=torch.bfloat16)
    ids = torch.arange(8)
    for step in range(1, 2001):
        step_rows(opt, w, {}, ids, -torch.ones(8, 4), step=step, stochastic_rounding=True)
    assert abs(w.float().mean().item() - 1.2) < 0.02 * 1.2


@pytest.mark.slow
def test_compiled_cpu_step_rounds_bf16_rows_as_the_torch_path():
    # Builds the C++ extension (30-90 s the first time on a machine), hence slow.
    from lightning_embcache.optim import fused_cpu

    opt = make_row_optimizer("adam", lr=1e-4)
    ids = torch.arange(16)
    for fused in (True, False):   # 2,000 steps of +1e-4 (Adam on a constant gradient)
        w, s = torch.ones(16, 8, dtype=torch.bfloat16), opt.init_state(16, 8)
        for step in range(1, 2001):
            step_rows(opt, w, s, ids, -torch.ones(16, 8), step=step, fused=fused, stochastic_rounding=True, seed=1)
        assert abs(w.float().mean().item() - 1.2) < 0.02 * 1.2, fused
    assert fused_cpu.loaded()
    # one step from the same state: the same rows as the torch path (an element may round the other
    # way where the two float32 computations differ in the last bit, then by one bf16 step)
    opt = make_row_optimizer("adamw", lr=0.01, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    s0 = {k: torch.rand(300, 64, generator=g) for k in opt.init_state(300, 64)}
    ids, grads = torch.randint(0, 300, (512,), generator=g), torch.randn(512, 64, generator=g)
    out = {}
    for fused in (True, False):
        w, s = w0.clone(), {k: v.clone() for k, v in s0.items()}
        step_rows(opt, w, s, ids, grads, step=3, fused=fused, stochastic_rounding=True, seed=5)
        out[fused] = (w.float(), s)
    differ = out[True][0] != out[False][0]
    assert differ.float().mean() < 0.01
    ulp = (out[False][0].abs() * 2 ** -7).clamp(min=1e-30)
    assert ((out[True][0] - out[False][0]).abs()[differ] <= ulp[differ] * 1.01).all()
    torch.testing.assert_close(out[True][1]["exp_avg_sq"], out[False][1]["exp_avg_sq"], rtol=1e-5, atol=1e-6)
    # round to nearest: bit for bit where the float32 results agree
    w1, w2 = w0.clone(), w0.clone()
    step_rows(opt, w1, {k: v.clone() for k, v in s0.items()}, ids, grads, step=3, fused=True)
    step_rows(opt, w2, {k: v.clone() for k, v in s0.items()}, ids, grads, step=3, fused=False)
    assert (w1 != w2).float().mean() < 0.01


def test_a_resumed_run_rounds_as_the_uninterrupted_one(tmp_path):
    opt = make_row_optimizer("adam", lr=1e-3)
    fields = trainable_fields(opt, DIM, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, ROWS, (24,), generator=g) for _ in range(40)]

    def run(store, rows, steps):
        for step in steps:
            z = rows.lookup(batches[step - 1])
            (z.float() - 0.5).pow(2).sum().backward()
            rows.apply(step=step)

    straight = EmbeddingStore.create(tmp_path / "a", ROWS, DIM, dtype=torch.bfloat16, init="normal", seed=9,
                                     fields=fields)
    run(straight, TrainableRows(straight, opt), range(1, 41))
    want = straight.get(torch.arange(ROWS))
    straight.close()
    first = EmbeddingStore.create(tmp_path / "b", ROWS, DIM, dtype=torch.bfloat16, init="normal", seed=9,
                                  fields=fields)
    run(first, TrainableRows(first, opt), range(1, 21))
    first.flush()
    first.close()
    resumed = EmbeddingStore.open(tmp_path / "b")
    run(resumed, TrainableRows(resumed, opt), range(21, 41))
    assert torch.equal(resumed.get(torch.arange(ROWS)), want)
    resumed.close()
