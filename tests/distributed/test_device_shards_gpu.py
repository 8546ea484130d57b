"""Sharded trainable rows held on the owners' GPUs (`ShardedDeviceRows`), on real NCCL processes,
one GPU each, against nn.Embedding + SparseAdam. Run through the device tool: ``pytest -m gpu``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _gpu_rank_fns  # noqa: E402
from _spawn import run_ranks  # noqa: E402

pytestmark = pytest.mark.gpu


def _need(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs; {torch.cuda.device_count()} here")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("fraction", "prefetch"), [(0.4, 0), (0.4, 1), (0.4, 2), (1.0, 0), (1.0, 2)],
                         ids=["budget-below-shard", "budget-below-shard-prefetch", "budget-below-shard-prefetch-2",
                              "whole-shard", "whole-shard-prefetch-2"])
def test_gpu_rows_train_like_sparse_adam(tmp_path, world, fraction, prefetch):
    _need(world)
    run_ranks(_gpu_rank_fns.gpu_rows_match_sparse_adam, world, str(tmp_path), fraction, prefetch, backend="nccl")


def test_lookup_must_take_the_prefetched_ids(tmp_path):
    _need(2)
    run_ranks(_gpu_rank_fns.lookup_of_other_ids_than_prefetched_fails, 2, str(tmp_path), backend="nccl")


def test_direct_writes_reach_the_owners_gpu_rows(tmp_path):
    _need(2)
    run_ranks(_gpu_rank_fns.direct_writes_reach_gpu_rows, 2, str(tmp_path), backend="nccl")


def test_an_overflow_on_one_rank_skips_the_rows_step_on_every_rank(tmp_path):
    _need(2)
    run_ranks(_gpu_rank_fns.overflow_on_one_rank_skips_every_rank, 2, str(tmp_path), backend="nccl")


def test_training_steps_make_no_synchronizing_cuda_call(tmp_path):
    _need(2)
    run_ranks(_gpu_rank_fns.steps_never_wait_for_the_gpu, 2, str(tmp_path), backend="nccl")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("fraction", [1.0, 0.4], ids=["whole-shard", "budget-below-shard"])
def test_max_norm_on_the_owners_gpus_trains_like_nn_embedding(tmp_path, world, fraction):
    _need(world)
    run_ranks(_gpu_rank_fns.gpu_rows_max_norm_match_nn_embedding, world, str(tmp_path), fraction, backend="nccl")
