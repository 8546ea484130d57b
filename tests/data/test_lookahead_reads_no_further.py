"""Reading ahead never runs the wrapped sampler further than a loader would."""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import BatchSampler, RandomSampler

from lightning_embcache import LookaheadSampler


class Hints:
    def upcoming(self, ids):
        pass


def _epochs(wrap: bool, epochs: int = 3) -> list[list[list[int]]]:
    """Each epoch taken as Lightning takes it: exactly len() batches, never one more ``next``."""
    sampler = BatchSampler(RandomSampler(range(100), generator=torch.Generator().manual_seed(0)), 10, False)
    source = LookaheadSampler(sampler, Hints(), lookahead=3) if wrap else sampler
    return [list(itertools.islice(iter(source), len(source))) for _ in range(epochs)]


def test_every_epoch_has_the_order_of_the_same_sampler_unwrapped():
    # RandomSampler with a generator draws a new permutation when asked past its last index
    assert _epochs(wrap=True) == _epochs(wrap=False)


def test_a_sampler_without_a_length_is_read_to_its_end():
    got = list(LookaheadSampler(iter([[1, 2], [3]]), Hints(), lookahead=4))
    assert got == [[1, 2], [3]]
