"""Streaming a checkpoint's shards of N ranks to M ranks (`lightning_embcache.distributed.stream`)
on real Gloo processes, each rank seeing only its own node's folder: every field of every row
arrives at its new owner exactly, in bounded slices, and a shard on no node is refused before
anything is written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import _stream_fns  # noqa: E402


@pytest.mark.parametrize("slice_rows", [8, 1 << 16])
def test_three_old_shards_on_two_nodes_stream_to_two_ranks_exactly(ranks, tmp_path, slice_rows):
    """Node 0 holds old shards 0 and 1, node 1 old shard 2: rank 0 reads two shards, rank 1 one, so
    with 8-row slices they make different numbers of exchanges (rank 1 joins the later ones empty)."""
    record = _stream_fns.write_old_shards(tmp_path, [[0, 1], [2]], 3, touched=70)
    ranks.run(_stream_fns.stream_to_new_world, str(tmp_path), record, 70, slice_rows)
    for node in range(2):  # each node holds its old shards and its new rank's shard, nothing else
        assert sorted(p.name for p in (tmp_path / f"node{node}" / "t").iterdir() if p.is_dir()) == (
            ["rank-00000-of-00002", "rank-00000-of-00003", "rank-00001-of-00003"] if node == 0
            else ["rank-00001-of-00002", "rank-00002-of-00003"])


def test_a_shard_on_no_node_is_refused_naming_it_and_nothing_is_made(ranks, tmp_path):
    record = _stream_fns.write_old_shards(tmp_path, [[0, 1], [2]], 3, touched=10)
    (tmp_path / "node1" / "t" / "rank-00002-of-00003").rename(tmp_path / "elsewhere")
    ranks.run(_stream_fns.refuse_missing_shards, str(tmp_path), record)


@pytest.mark.parametrize("case", ["existing", "checksum", "fields"])
def test_a_stream_that_cannot_go_through_fails_every_rank_and_leaves_nothing(ranks, tmp_path, case):
    """existing: rank 1's new shard folder holds something this checkpoint did not make; checksum:
    old shard 2 is not the version the checkpoint saw (fails at open, before anything is made);
    fields: the store is now made with other per-row fields (fails after the new shards were made,
    which are then removed)."""
    record = _stream_fns.write_old_shards(tmp_path, [[0, 1], [2]], 3, touched=10)
    ranks.run(_stream_fns.refuse_and_leave_nothing, str(tmp_path), record, case)
