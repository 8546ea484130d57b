"""Learning rate at run time, checkpoints, low-precision rows, per-row step counts."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache.optim import make_row_optimizer, step_rows
from lightning_embcache.store.errors import InvalidArgumentError


def test_torch_scheduler_drives_lr_through_the_view():
    opt = make_row_optimizer("adam", lr=0.1)
    view = opt.as_torch_optimizer()
    assert view is opt.as_torch_optimizer()
    assert isinstance(view, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(view, step_size=1, gamma=0.5)
    for expected in (0.05, 0.025):
        view.step()        # what the mixin calls after stepping the rows; keeps torch's order check quiet
        sched.step()
        assert opt.lr == pytest.approx(expected)


def test_follow_takes_lr_from_a_scheduled_param_group():
    model = torch.nn.Linear(2, 2)
    main = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(main, step_size=1, gamma=0.5)
    rows = make_row_optimizer("adam", lr=1.0)
    rows.follow(main.param_groups[0], scale=10.0)
    assert rows.lr == pytest.approx(1.0)
    main.step()
    sched.step()
    assert rows.lr == pytest.approx(0.5)
    with pytest.raises(InvalidArgumentError, match="lr cannot be set while it follows"):
        rows.lr = 3.0
    w = torch.zeros(1, 2)
    sgd = make_row_optimizer("sgd", lr=9.0)
    sgd.follow(main.param_groups[0])
    sgd.step(w, {}, torch.ones(1, 2), step=1)
    torch.testing.assert_close(w, torch.full((1, 2), -0.05))
    rows.follow(None)
    assert rows.lr == pytest.approx(0.5)
    rows.lr = 0.25
    assert rows.lr == 0.25


def test_lr_override_applies_to_one_step_only():
    opt = make_row_optimizer("sgd", lr=1.0)
    w = torch.zeros(1, 2)
    opt.step(w, {}, torch.ones(1, 2), step=1, lr=0.25)
    torch.testing.assert_close(w, torch.full((1, 2), -0.25))
    assert opt.lr == 1.0


def test_state_dict_restores_scheduled_lr_and_rejects_other_hparams():
    opt = make_row_optimizer("adamw", lr=0.1, weight_decay=0.1)
    opt.lr = 0.003
    saved = opt.state_dict()
    fresh = make_row_optimizer("adamw", lr=0.1, weight_decay=0.1)
    fresh.load_state_dict(saved)
    assert fresh.lr == 0.003
    other = make_row_optimizer("adamw", lr=0.1, weight_decay=0.2)
    with pytest.raises(InvalidArgumentError, match="state_dict\\['weight_decay'\\] must equal"):
        other.load_state_dict(saved)


def test_view_state_dict_carries_lr():
    opt = make_row_optimizer("sgd", lr=0.1)
    view = opt.as_torch_optimizer()
    opt.lr = 0.02
    sd = view.state_dict()
    opt.lr = 0.5
    view.load_state_dict(sd)
    # torch's load_state_dict replaces the param group dict: the owner must still see it
    assert view.param_groups[0]["lr"] == 0.02
    assert opt.lr == 0.02


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rows_are_updated_in_float32_and_rounded_once(dtype):
    opt = make_row_optimizer("adam", lr=0.01)
    w32 = torch.randn(5, 8)
    g = torch.randn(5, 8)
    w = w32.to(dtype)
    state = opt.init_state(5, 8, dtype)
    assert state["exp_avg"].dtype == torch.float32
    ref_state = opt.init_state(5, 8)
    ref = w.float()
    opt.step(ref, ref_state, g, step=1)
    opt.step(w, state, g.to(dtype), step=1)
    assert w.dtype == dtype
    torch.testing.assert_close(w, ref.to(dtype))


def test_per_row_step_counts_updates_of_each_row():
    opt = make_row_optimizer("adam", per_row_step=True)
    weight = torch.zeros(4, 3)
    state = opt.init_state(4, 3)
    for ids in ([0, 1], [1, 1, 2], [1]):
        ids = torch.tensor(ids)
        step_rows(opt, weight, state, ids, torch.ones(len(ids), 3), step=1)
    assert state["step"].flatten().tolist() == [1, 3, 1, 0]
    assert torch.all(weight[3] == 0)


def test_sgd_per_row_step_sets_first_buffer_to_gradient_like_torch():
    opt = make_row_optimizer("sgd", lr=1.0, momentum=0.5, dampening=0.5, per_row_step=True)
    w, state = torch.zeros(1, 2), opt.init_state(1, 2)
    opt.step(w, {k: v for k, v in state.items()}, torch.ones(1, 2), step=1)
    torch.testing.assert_close(state["momentum_buffer"], torch.ones(1, 2))   # not (1 - dampening)
    ref = torch.nn.Parameter(torch.zeros(1, 2))
    t = torch.optim.SGD([ref], lr=1.0, momentum=0.5, dampening=0.5)
    for _ in range(3):
        ref.grad = torch.ones(1, 2)
        t.step()
    for step in (2, 3):
        opt.step(w, state, torch.ones(1, 2), step=step)
    torch.testing.assert_close(w, ref.detach())


def test_untouched_rows_and_state_stay_bitwise_identical():
    for name in ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw"):
        opt = make_row_optimizer(name, **({"momentum": 0.9} if name == "sgd" else {}))
        weight = torch.randn(10, 4)
        state = {k: torch.rand_like(v) for k, v in opt.init_state(10, 4).items()}
        before = weight.clone(), {k: v.clone() for k, v in state.items()}
        step_rows(opt, weight, state, torch.tensor([2, 7, 2]), torch.randn(3, 4), step=5)
        untouched = torch.tensor([i for i in range(10) if i not in (2, 7)])
        assert torch.equal(weight[untouched], before[0][untouched]), name
        for k in state:
            assert torch.equal(state[k][untouched], before[1][k][untouched]), (name, k)
        assert not torch.equal(weight[2], before[0][2]), name


@pytest.mark.slow
def test_compiled_cpu_step_matches_torch_path_with_duplicates():
    # Builds the C++ extension (30-90 s the first time on a machine), hence slow.
    from lightning_embcache.optim import fused_cpu
    for name, kw in [("adam", {}), ("adam", {"weight_decay": 0.01}), ("adamw", {"weight_decay": 0.1})]:
        opt = make_row_optimizer(name, lr=0.01, betas=(0.8, 0.99), **kw)
        w0 = torch.randn(300, 96)
        ref_w, ref_s = w0.clone(), opt.init_state(300, 96)
        w, s = w0.clone(), opt.init_state(300, 96)
        gen = torch.Generator().manual_seed(0)
        for t in range(1, 51):
            ids = torch.randint(0, 300, (512,), generator=gen)
            grads = torch.randn(512, 96, generator=gen)
            step_rows(opt, ref_w, ref_s, ids, grads, step=t, fused=False)
            step_rows(opt, w, s, ids, grads, step=t, fused=True)
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s["exp_avg_sq"], ref_s["exp_avg_sq"], rtol=1e-5, atol=1e-6)
    assert fused_cpu.loaded()
    # ids outside the table are skipped, never written
    w = torch.zeros(4, 8)
    s = make_row_optimizer("adam").init_state(4, 8)
    step_rows(make_row_optimizer("adam"), w, s, torch.tensor([1, 4, -1, 1000]), torch.ones(4, 8), step=1,
              fused=True)
    assert torch.count_nonzero(w[1]) == 8 and torch.count_nonzero(w[[0, 2, 3]]) == 0


def test_fused_true_is_refused_where_no_fused_step_applies():
    opt = make_row_optimizer("sgd")
    with pytest.raises(InvalidArgumentError, match="fused=True needs Adam/AdamW"):
        step_rows(opt, torch.zeros(4, 2), {}, torch.tensor([1]), torch.ones(1, 2), step=1, fused=True)


def test_step_rows_checks_ids_and_grads_before_any_kernel():
    opt = make_row_optimizer("adam")
    with pytest.raises(InvalidArgumentError, match="grads must have one row per id; got 1 rows for 3 ids"):
        step_rows(opt, torch.zeros(4, 2), opt.init_state(4, 2), torch.tensor([0, 1, 2]), torch.ones(1, 2),
                  step=1)
