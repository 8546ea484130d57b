"""ShardedStore and ShardedTrainableRows on real 2-process Gloo groups, against plain tensors and
nn.Embedding + SparseAdam; and the single-process pieces (the id map, initial rows)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

import _rank_fns  # noqa: E402

from lightning_embcache import EmbeddingStore  # noqa: E402
from lightning_embcache.distributed import RowSharding  # noqa: E402
from lightning_embcache.distributed.sharding import GlobalNormalInit  # noqa: E402


def test_every_id_has_exactly_one_owner_and_local_row():
    for num_rows, world in [(10, 3), (7, 8), (1000, 4), (1, 2)]:
        s = RowSharding(num_rows, world)
        ids = torch.arange(num_rows)
        owner, local = s.owner(ids), s.local(ids)
        assert sum(s.shard_rows(r) for r in range(world)) == num_rows
        for r in range(world):
            mine = ids[owner == r]
            assert torch.equal(local[owner == r], torch.arange(s.shard_rows(r)))
            assert torch.equal(s.global_ids(r, torch.arange(s.shard_rows(r))), mine)


def test_global_normal_init_reproduces_the_single_process_rows():
    n, dim = 1000, 5
    whole = EmbeddingStore.create(None, n, dim, init="normal", seed=9, chunk_rows=64, init_std=0.5).get(torch.arange(n))
    s = RowSharding(n, 3)
    for r in range(3):
        got = GlobalNormalInit(s, r, dim, 9, 0.5)(torch.arange(s.shard_rows(r)))
        assert torch.equal(got, whole[r::3])


def test_get_update_on_two_gloo_ranks_match_a_tensor(ranks, tmp_path):
    ranks.run(_rank_fns.get_update_match_a_tensor, str(tmp_path))


def test_invalid_ids_on_one_rank_fail_every_rank_and_change_nothing(ranks, tmp_path):
    ranks.run(_rank_fns.invalid_ids_fail_every_rank, str(tmp_path))


def test_sharded_trainable_rows_equal_sparse_adam_with_mean_gradients(ranks, tmp_path):
    ranks.run(_rank_fns.trainable_rows_match_sparse_adam, str(tmp_path))


def test_max_norm_rows_of_a_sharded_store_train_like_nn_embedding(tmp_path, ranks):
    ranks.run(_rank_fns.max_norm_rows_match_nn_embedding, str(tmp_path))


def test_bytes_exchanged_per_get_follow_the_batch_not_the_table(ranks, tmp_path):
    ranks.run(_rank_fns.exchange_is_o_batch, str(tmp_path))


def test_a_path_laid_out_for_another_world_size_is_refused_naming_the_reshard_command(tmp_path):
    from lightning_embcache import InvalidArgumentError
    from lightning_embcache.distributed.sharding import shard_dir
    from lightning_embcache.distributed.store import _check_layout

    single = tmp_path / "single"
    EmbeddingStore.create(single, 10, 4).close()
    with pytest.raises(InvalidArgumentError, match=r"holds a single-process store, but 2 processes run.*embcache reshard"):
        _check_layout(single, 2)
    sharded = tmp_path / "sharded"
    for r in range(2):
        EmbeddingStore.create(shard_dir(sharded, r, 2), 5, 4).close()
    with pytest.raises(InvalidArgumentError, match=r"shards for world_size=\[2\], but 4 process\(es\) run.*embcache reshard"):
        _check_layout(sharded, 4)
    _check_layout(sharded, 2)  # its own layout is fine
    for r in range(4):  # after resharding both layouts live side by side
        EmbeddingStore.create(shard_dir(sharded, r, 4), 3, 4).close()
    _check_layout(sharded, 4)


_ids = st.lists(st.integers(0, 96), max_size=12)
_op = st.one_of(
    st.tuples(st.just("update"), st.tuples(st.tuples(_ids, st.integers(0, 10**6)), st.tuples(_ids, st.integers(0, 10**6)))),
    st.tuples(st.just("get"), st.tuples(_ids, _ids)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("reopen")),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=12))
def test_operation_sequences_on_two_ranks_match_a_tensor_with_durable_flushes(ranks, tmp_path_factory, ops):
    ranks.run(_rank_fns.operation_sequence, str(tmp_path_factory.mktemp("seq")), ops, timeout=120)


def test_a_rank_with_an_empty_batch_takes_part_and_the_others_rows_train(ranks, tmp_path):
    ranks.run(_rank_fns.trainable_rows_with_an_idle_rank, str(tmp_path), timeout=120)


def test_a_device_budget_is_per_shard_and_cpu_ranks_keep_host_rows(ranks, tmp_path):
    ranks.run(_rank_fns.device_budget_reaches_each_shard, str(tmp_path))


def test_announced_lookups_are_exchanged_ahead_and_train_like_sparse_adam(ranks, tmp_path):
    ranks.run(_rank_fns.announced_lookups_train_like_sparse_adam, str(tmp_path), timeout=60)
