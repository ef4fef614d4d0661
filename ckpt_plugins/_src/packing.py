"""Messages every rank sends every other as plain bytes, and every rank's joined in one pass on
arrays: at scale a load's ranks each receive hundreds of thousands of messages, which take
seconds to rebuild as pickled objects and no time as bytes (`bench/plan_scale.py`). Each
message is a run of 8-byte-aligned sections, so that every rank's starts aligned when joined.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def aligned(*sections: bytes) -> bytes:
    """The sections one after the other, each padded with zeros to a multiple of 8 bytes."""
    return b"".join(s + bytes(-len(s) % 8) for s in sections)


def padded(nbytes: np.ndarray) -> np.ndarray:
    """Sections' lengths as `aligned` lays them out."""
    return -(-np.asarray(nbytes, dtype=np.int64) // 8) * 8


def spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """starts[k], starts[k] + 1, ..., starts[k] + counts[k] - 1 for each k in turn."""
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.repeat(np.asarray(starts, dtype=np.int64) - (ends - counts), counts) + \
        np.arange(ends[-1] if len(ends) else 0, dtype=np.int64)


class Joined:
    """Every rank's message, one after the other: `start[k]` is the byte where rank k's starts."""

    def __init__(self, blobs: Sequence[bytes], what: str):
        self.buffer = b"".join(blobs)
        self.size = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
        odd = np.flatnonzero(self.size % 8)
        if len(odd):
            raise ValueError(f"rank {odd[0]} sent {self.size[odd[0]]} bytes of {what}, not a multiple of 8")
        self.start = np.cumsum(self.size) - self.size
        self.longs = np.frombuffer(self.buffer, dtype=np.int64)
        self.words = np.frombuffer(self.buffer, dtype=np.int32)
        self.bytes = np.frombuffer(self.buffer, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.size)

    def header(self, fields: int) -> np.ndarray:
        """The first `fields` int64s of every rank's message, (ranks, fields)."""
        short = np.flatnonzero(self.size < 8 * fields)
        if len(short):
            raise ValueError(f"rank {short[0]} sent {self.size[short[0]]} bytes, short of a {8 * fields}-byte header")
        return self.longs[(self.start // 8)[:, None] + np.arange(fields)] if len(self) else \
            np.zeros((0, fields), dtype=np.int64)

    def strings(self, at: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Rank k's `nbytes[k]` bytes from byte `at[k]`, as a bytes array (trailing zeros dropped)."""
        width = max(int(nbytes.max(initial=0)), 1)
        index = np.minimum(at[:, None] + np.arange(width), len(self.bytes) - 1)
        rows = np.where(np.arange(width) < nbytes[:, None], self.bytes[index] if len(self.bytes) else 0, 0)
        return np.ascontiguousarray(rows, dtype=np.uint8).view(f"S{width}").reshape(-1)
