"""Samplers that know the store (tell it which rows come next, or read it in near-disk order), and a
loader that resumes mid-epoch exactly.

Plain ``torch.utils.data`` samplers (no Lightning import): they run in the main process, where a
DataLoader iterates its sampler whatever ``num_workers`` is.
"""

from .chunk_shuffle import ChunkShuffleSampler
from .lookahead import LookaheadSampler
from .resumable import ResumableLoader

__all__ = ["ChunkShuffleSampler", "LookaheadSampler", "ResumableLoader"]
