"""Samplers that know the store: tell it which rows come next, or read it in near-disk order.

Plain ``torch.utils.data`` samplers (no Lightning import): they run in the main process, where a
DataLoader iterates its sampler whatever ``num_workers`` is.
"""

from .chunk_shuffle import ChunkShuffleSampler
from .lookahead import LookaheadSampler

__all__ = ["ChunkShuffleSampler", "LookaheadSampler"]
