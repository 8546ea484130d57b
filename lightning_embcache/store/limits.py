"""Limits of the on-disk format that the compaction process needs too (no torch import here)."""

MAX_ROWS = 1 << 48  # ids are int64; the disk-mode id map costs 4 bytes per row of address space
