"""Growing a row-sharded table (`ShardedStore.grow`) on 2 real Gloo ranks, against a plain tensor
grown by concatenating the rows of a table created at the new size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

import _grow_fns  # noqa: E402
from _spawn import run_ranks  # noqa: E402


def test_a_grown_sharded_table_equals_one_created_at_the_new_size(ranks, tmp_path):
    ranks.run(_grow_fns.grown_table_equals_one_created_at_the_new_size, str(tmp_path), "normal", 37, 90)


def test_grow_refusals_fail_every_rank_and_change_nothing(ranks, tmp_path):
    ranks.run(_grow_fns.refusals_change_nothing, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize(("init", "n0", "n1"), [("callable", 37, 90), ("zeros", 1, 7), ("normal", 2, 3)])
def test_growth_from_any_size_and_init_equals_a_table_created_at_the_new_size(ranks, tmp_path, init, n0, n1):
    """A callable init of global ids; a table smaller than the world (rank 1's shard holds a
    placeholder row until it owns one); a growth that adds rows to one shard only."""
    ranks.run(_grow_fns.grown_table_equals_one_created_at_the_new_size, str(tmp_path), init, n0, n1)


@pytest.mark.slow
def test_a_growth_one_shard_did_not_flush_is_refused_until_grown_again(ranks, tmp_path):
    ranks.run(_grow_fns.growth_one_shard_did_not_flush, str(tmp_path))


@pytest.mark.slow
def test_a_grown_three_rank_checkpoint_streams_to_two_ranks_at_its_size(ranks, tmp_path):
    record, want = _grow_fns.write_grown_shards(tmp_path, 3, 40, 95)
    ranks.run(_grow_fns.stream_a_grown_checkpoint, str(tmp_path), record, 40, want)


@pytest.mark.gpu
def test_grow_with_rows_on_the_owners_gpus_keeps_the_trained_rows_and_trains_the_new_ones(tmp_path):
    """Two ranks on two GPUs; on a machine of one GPU, one rank."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    run_ranks(_grow_fns.grow_with_gpu_rows, min(2, torch.cuda.device_count()), str(tmp_path), backend="nccl")


_ids = st.lists(st.integers(0, 10**6), max_size=8)
_op = st.one_of(
    st.tuples(st.just("update"), st.tuples(st.tuples(_ids, st.integers(0, 10**6)), st.tuples(_ids, st.integers(0, 10**6)))),
    st.tuples(st.just("get"), st.tuples(_ids, _ids)),
    st.tuples(st.just("grow"), st.integers(0, 40)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("reopen")),
)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=12))
def test_sequences_of_growth_flush_and_reopen_on_two_ranks_match_a_grown_tensor(ranks, tmp_path_factory, ops):
    ranks.run(_grow_fns.grow_sequence, str(tmp_path_factory.mktemp("seq")), ops, timeout=60)
