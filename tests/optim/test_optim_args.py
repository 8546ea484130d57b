"""Argument checks: every error names the argument, the value and the allowed range."""

from __future__ import annotations

import pytest
import torch

from lightning_embcache.optim import OPTIMIZERS, RowOptimizer, make_row_optimizer
from lightning_embcache.store.errors import InvalidArgumentError, InvalidTypeError


@pytest.mark.parametrize("name,kwargs,message", [
    ("sgd", dict(lr=-1), "lr must be >= 0; got -1"),
    ("sgd", dict(momentum=1.0), "momentum must be in [0, 1); got 1"),
    ("sgd", dict(dampening=1.5), "dampening must be in [0, 1]; got 1.5"),
    ("sgd", dict(nesterov=True), "nesterov=True needs momentum > 0 and dampening = 0"),
    ("sgd", dict(weight_decay=-0.1), "weight_decay must be >= 0; got -0.1"),
    ("adagrad", dict(lr_decay=-1), "lr_decay must be >= 0; got -1"),
    ("adagrad", dict(initial_accumulator_value=-1), "initial_accumulator_value must be >= 0; got -1"),
    ("rowwise_adagrad", dict(eps=-1e-8), "eps must be >= 0; got -1e-08"),
    ("adam", dict(betas=(0.9, 1.0)), "betas[1] must be in [0, 1); got 1"),
    ("adam", dict(betas=(-0.1, 0.9)), "betas[0] must be in [0, 1); got -0.1"),
    ("adamw", dict(lr=float("nan")), "lr must be finite; got nan"),
    ("adamw", dict(weight_decay=-1), "weight_decay must be >= 0; got -1"),
    ("adam", dict(beta=0.9), "unknown argument 'beta' for optimizer 'adam'; allowed: ['lr', 'betas'"),
    ("lamb", dict(), "optimizer must be one of ['adagrad', 'adam', 'adamw', 'rowwise_adagrad', 'sgd']; got 'lamb'"),
])
def test_out_of_range_arguments_are_named(name, kwargs, message):
    with pytest.raises(InvalidArgumentError) as info:
        make_row_optimizer(name, **kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name,kwargs,message", [
    ("adam", dict(lr="0.1"), "lr must be a real number; got '0.1' (str)"),
    ("adam", dict(betas=0.9), "betas must be a pair (beta1, beta2); got 0.9"),
    ("sgd", dict(nesterov=1), "nesterov must be a bool; got 1 (int)"),
    ("adam", dict(per_row_step="yes"), "per_row_step must be a bool; got 'yes' (str)"),
])
def test_wrong_types_are_named(name, kwargs, message):
    with pytest.raises(InvalidTypeError) as info:
        make_row_optimizer(name, **kwargs)
    assert message in str(info.value)


def test_names_are_case_insensitive_and_all_registered():
    assert set(OPTIMIZERS) == {"sgd", "adagrad", "rowwise_adagrad", "adam", "adamw"}
    assert make_row_optimizer("AdamW").name == "adamw"
    for name in OPTIMIZERS:
        assert isinstance(make_row_optimizer(name), RowOptimizer)


def test_lr_setter_is_checked():
    opt = make_row_optimizer("sgd", lr=0.1)
    opt.lr = 0.5
    assert opt.lr == 0.5
    with pytest.raises(InvalidArgumentError, match="lr must be >= 0; got -2"):
        opt.lr = -2


def test_step_must_be_positive_with_global_step():
    opt = make_row_optimizer("adam")
    state = opt.init_state(2, 4)
    with pytest.raises(InvalidArgumentError, match="step must be an int >= 1; got 0"):
        opt.step(torch.zeros(2, 4), state, torch.ones(2, 4), step=0)


@pytest.mark.parametrize("name,fields", [
    ("sgd", {}),
    ("adagrad", {"sum": (torch.float32, 16)}),
    ("rowwise_adagrad", {"sum": (torch.float32, 1)}),
    ("adam", {"exp_avg": (torch.float32, 16), "exp_avg_sq": (torch.float32, 16)}),
])
def test_state_fields(name, fields):
    assert make_row_optimizer(name).state_fields(16, torch.bfloat16) == fields
    with_step = make_row_optimizer(name, per_row_step=True).state_fields(16)
    assert with_step == {**fields, "step": (torch.int32, 1)}
    assert make_row_optimizer("sgd", momentum=0.9).state_fields(4, torch.float64) == {
        "momentum_buffer": (torch.float64, 4)}


def test_state_fields_rejects_bad_dim_and_dtype():
    with pytest.raises(InvalidArgumentError, match="dim must be an int >= 1; got 0"):
        make_row_optimizer("adam").state_fields(0)
    with pytest.raises(InvalidTypeError, match="dtype must be a floating torch.dtype"):
        make_row_optimizer("adam").state_fields(4, torch.int64)
