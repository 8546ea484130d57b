"""Base chunk files shared by the writer's version and the versions kept beside it (pins).

A kept version reads a chunk map and its own list of delta segments. When it reads the writer's
chunk map and lists exactly the writer's segments up to its own newest one (the writer's version
descends from it by flushes and compaction rounds), a compaction round that folds only segments
it lists too writes base files that hold that version's rows: the round publishes the kept
version again with the new chunk map and the segments still to fold (same rows, same number,
same identity), and the old chunk files are garbage. Segments newer than the oldest such version
stay segments: they hold the rows changed since, once each, and disk use is the table plus them,
not a table per kept version.

Folding past a kept version instead writes base files it cannot read: it keeps its own chunk
files (up to a table). The round does that to the oldest kept versions only while the writer's
segments newer than them hold more than SHARE_RATIO of the table or are more than SHARE_SEGMENTS
files, so the segments held for kept versions stay bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .disk import Manifest, Segment

# Rows changed since the oldest kept version are held as segments up to this share of the table's
# bytes and this many files; past either, that version keeps its own chunk files instead.
SHARE_RATIO = 1.0
SHARE_SEGMENTS = 128


@dataclass(frozen=True)
class Sharing:
    """What compaction rounds fold while kept versions share the writer's chunk files."""

    upto: int | None = None  # fold only segments numbered up to this (None: every segment)
    members: tuple[int, ...] = ()  # kept versions each round publishes again with its chunk map
    segments: frozenset[int] = field(default_factory=frozenset)  # segments they list

    def foldable(self, seg: Segment) -> bool:
        return self.upto is None or seg.seq <= self.upto


def top(m: Manifest) -> int:
    """The newest segment ``m`` lists (0: none)."""
    return max(m.segments, default=0)


def shares(m: Manifest, gen: int, seqs: set[int]) -> bool:
    """Whether kept version ``m`` reads chunk map ``gen`` and lists exactly the writer's segments
    ``seqs`` up to its own newest: then base files that fold only those segments hold its rows."""
    newest = top(m)
    return m.chunkmap == gen and set(m.segments) == {s for s in seqs if s <= newest}


def plan(segs: list[Segment], members: list[Manifest], table_bytes: int) -> Sharing:
    """The fold limit for the writer's committed ``segs`` given the kept versions that share its
    chunk files (``members``, checked with `shares`): up to the newest segment of the oldest of
    them whose newer segments stay within SHARE_RATIO of ``table_bytes`` and SHARE_SEGMENTS files;
    the older ones are left to keep their own files."""
    for limit in sorted({top(m) for m in members}):
        newer = [s for s in segs if s.seq > limit]
        if sum(s.live_bytes for s in newer) <= SHARE_RATIO * table_bytes and len(newer) <= SHARE_SEGMENTS:
            keep = [m for m in members if top(m) >= limit]
            return Sharing(limit, tuple(m.version for m in keep), frozenset(s for m in keep for s in m.segments))
    return Sharing()
