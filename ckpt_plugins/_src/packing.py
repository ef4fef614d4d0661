"""Messages every rank sends every other as plain bytes, and every rank's joined in one pass on
arrays: at scale a load's ranks each receive hundreds of thousands of messages, which take
seconds to rebuild as pickled objects and no time as bytes (`bench/plan_scale.py`). Each
message is a run of 8-byte-aligned sections, so that every rank's starts aligned when joined.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

FRAME = 8  # a message's length (int64), before it in a gathered buffer


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


def frame_bytes(longest: int) -> int:
    """The bytes each rank's message takes in a gathered buffer whose longest is `longest`: its
    length, then it, padded to a multiple of 8."""
    return FRAME + -(-longest // 8) * 8


def framed(data: bytes, stride: int) -> bytearray:
    """`data` as one rank's frame of a gathered buffer: its length, it, zeros up to `stride` bytes."""
    out = bytearray(stride)
    out[:FRAME] = len(data).to_bytes(FRAME, "little")
    out[FRAME:FRAME + len(data)] = data
    return out


def gathered(blobs: Sequence[bytes]) -> bytearray:
    """Every rank's message as a gather delivers them: a frame each (`framed`), one after the other."""
    sizes = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
    stride = frame_bytes(int(sizes.max(initial=0)))
    out = bytearray(stride * len(blobs))
    np.frombuffer(out, dtype="<i8")[::stride // 8] = sizes  # the lengths at once: a scatter frames one per rank
    view = memoryview(out)
    for at, data in zip(range(FRAME, len(out), stride), blobs):
        view[at:at + len(data)] = data
    return out


def unframed(buffer: bytearray, ranks: int) -> Tuple[np.ndarray, np.ndarray]:
    """Where each of the `ranks` messages of a gathered buffer lies: their first bytes and sizes."""
    stride = len(buffer) // max(ranks, 1)
    if ranks and (stride < FRAME or stride % 8 or len(buffer) != stride * ranks):
        raise ValueError(f"a gathered buffer of {len(buffer)} bytes does not hold {ranks} frames")
    size = np.frombuffer(buffer, dtype="<i8")[::stride // 8].astype(np.int64) if ranks else np.zeros(0, np.int64)
    bad = np.flatnonzero((size < 0) | (size > stride - FRAME))
    if len(bad):
        raise ValueError(f"rank {bad[0]}'s frame says {size[bad[0]]} bytes, in {stride - FRAME}")
    return np.arange(ranks, dtype=np.int64) * stride + FRAME, size


class Joined:
    """Every rank's message, one after the other: `start[k]` is the byte where rank k's starts."""

    def __init__(self, blobs: Sequence[bytes], what: str):
        size = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
        self._index(b"".join(blobs), np.cumsum(size) - size, size, what)

    @classmethod
    def gathered(cls, buffer: bytearray, ranks: int, what: str) -> "Joined":
        """Every rank's message where a gather delivered them (`gathered`), read in place."""
        joined = cls.__new__(cls)
        joined._index(buffer, *unframed(buffer, ranks), what)
        return joined

    def _index(self, buffer, start: np.ndarray, size: np.ndarray, what: str) -> None:
        self.buffer, self.start, self.size = buffer, start, size
        odd = np.flatnonzero(self.size % 8)
        if len(odd):
            raise ValueError(f"rank {odd[0]} sent {self.size[odd[0]]} bytes of {what}, not a multiple of 8")
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
