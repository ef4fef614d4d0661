"""Tensor specs by column (`SpecTable`): what a rank sends the coordinator for a new save plan,
as plain bytes (`packed_specs`), and every rank's joined there in one pass on arrays (`unpacked`,
see `packing`): at scale the coordinator receives millions of specs, which take seconds to
rebuild as objects."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .format import STORABLE_DTYPES
from .packing import Joined, aligned, padded, spans

_FIELDS = 4  # the header: specs, shape values, box values (offsets; as many lengths), key bytes
_DTYPE_CODES = {name: i for i, name in enumerate(STORABLE_DTYPES)}


def key_digest(key: bytes) -> bytes:
    """16 bytes naming a tensor key (utf-8): the planner groups specs by it (the strings it reads
    only once per key)."""
    return hashlib.blake2b(key, digest_size=16).digest()


def packed_specs(specs: Sequence) -> bytes:
    """One rank's `TensorSpec`s as `SpecTable.unpacked` reads them: each spec's key digest; its
    shape's values, then its box's offsets and lengths, spec after spec; its dtype (index in
    `STORABLE_DTYPES`), number of dimensions, of box dimensions (-1: offsets and lengths differ
    in length) and key length, as 4-byte words; the keys, utf-8, one after the other."""
    keys = [s.key.encode() for s in specs]
    boxes = [len(s.offsets) if len(s.offsets) == len(s.lengths) else -1 for s in specs]
    shape = [v for s in specs for v in s.shape]
    offsets = [v for s, n in zip(specs, boxes) if n > 0 for v in s.offsets]
    lengths = [v for s, n in zip(specs, boxes) if n > 0 for v in s.lengths]
    small = np.array([[_DTYPE_CODES[s.dtype] for s in specs], [len(s.shape) for s in specs], boxes,
                      [len(k) for k in keys]], dtype=np.int32).reshape(4, len(specs))
    joined = b"".join(keys)
    header = np.array([len(specs), len(shape), len(offsets), len(joined)], dtype=np.int64)
    return aligned(header.tobytes(), b"".join(map(key_digest, keys)),
                   np.array(shape + offsets + lengths, dtype=np.int64).tobytes(), small.tobytes(), joined)


@dataclass
class SpecTable:
    """Every rank's specs, rank by rank (`count[r]` of them rank r's): per spec its key digest
    (`digest`, two int64 words), `dtype` (index in `STORABLE_DTYPES`), `ndim`, `box_ndim` (-1 or
    other than `ndim`: a malformed box), and shape, offsets and lengths as (specs, dims) arrays
    padded with 1, 0 and 1; its key is bytes [`key_at`, `key_at` + `key_len`) of `buffer`."""
    digest: np.ndarray
    dtype: np.ndarray
    ndim: np.ndarray
    box_ndim: np.ndarray
    shape: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    key_at: np.ndarray
    key_len: np.ndarray
    buffer: bytes
    count: np.ndarray

    @classmethod
    def of(cls, specs: Sequence[Sequence]) -> "SpecTable":
        """The table of every rank's `specs[r]`."""
        joined = Joined([packed_specs(s) for s in specs], "tensor specs")
        return cls.unpacked(joined, joined.start, joined.size)

    def __len__(self) -> int:
        return len(self.dtype)

    def key(self, i: int) -> str:
        at = int(self.key_at[i])
        return self.buffer[at:at + int(self.key_len[i])].decode()

    def box(self, i: int) -> tuple:
        """Spec i's (offsets, lengths), as tuples."""
        n = int(self.ndim[i])
        return tuple(self.offsets[i, :n].tolist()), tuple(self.lengths[i, :n].tolist())

    @classmethod
    def unpacked(cls, joined: Joined, start: np.ndarray, nbytes: np.ndarray) -> "SpecTable":
        """Every rank's `packed_specs`, rank k's the `nbytes[k]` bytes from byte `start[k]` of
        `joined`, one rank after the other."""
        short = np.flatnonzero(nbytes < 8 * _FIELDS)
        if len(short):
            raise ValueError(f"rank {short[0]} sent {nbytes[short[0]]} bytes, short of its tensor specs' header")
        n, values, boxes, keys = joined.longs[(start // 8)[:, None] + np.arange(_FIELDS)].reshape(-1, _FIELDS).T
        at = start + 8 * _FIELDS
        digests, at = at, at + 16 * n
        shapes, at = at, at + 8 * values
        offsets, at = at, at + 8 * boxes
        lengths, at = at, at + 8 * boxes
        small, at = at, at + padded(16 * n)
        names, at = at, at + padded(keys)
        wrong = np.flatnonzero((at != start + nbytes) | (np.minimum.reduce([n, values, boxes, keys]) < 0))
        if len(wrong):
            raise ValueError(f"rank {wrong[0]} sent {nbytes[wrong[0]]} bytes that do not hold its tensor specs")
        dtype, ndim, box_ndim, key_len = (joined.words[spans(small // 4 + j * n, n)].astype(np.int64) for j in range(4))
        rank = np.repeat(np.arange(len(n)), n)
        sums = [np.bincount(rank, weights=w, minlength=len(n)) for w in (ndim, np.maximum(box_ndim, 0), key_len)]
        wrong = np.flatnonzero((sums[0] != values) | (sums[1] != boxes) | (sums[2] != keys)
                               | np.bincount(rank, weights=(dtype < 0) | (dtype >= len(STORABLE_DTYPES)) | (ndim < 0),
                                             minlength=len(n)).astype(bool))
        if len(wrong):
            raise ValueError(f"rank {wrong[0]} sent tensor specs whose columns disagree")
        key_at = names[rank] + np.cumsum(key_len) - key_len - (np.cumsum(keys) - keys)[rank]
        width = max(int(ndim.max(initial=0)), 1)
        box = np.where(box_ndim == ndim, box_ndim, 0)  # a malformed box's values are skipped
        skip = np.maximum(box_ndim, 0)
        return cls(digest=joined.longs[spans(digests // 8, 2 * n)].reshape(-1, 2), dtype=dtype, ndim=ndim,
                   box_ndim=box_ndim,
                   shape=_padded(joined.longs[spans(shapes // 8, values)], ndim, ndim, width, 1),
                   offsets=_padded(joined.longs[spans(offsets // 8, boxes)], skip, box, width, 0),
                   lengths=_padded(joined.longs[spans(lengths // 8, boxes)], skip, box, width, 1),
                   key_at=key_at, key_len=key_len, buffer=joined.buffer, count=n)


def _padded(values: np.ndarray, counts: np.ndarray, taken: np.ndarray, width: int, pad: int) -> np.ndarray:
    """Row i's first `taken[i]` of its `counts[i]` values, padded with `pad` to `width` columns."""
    out = np.full((len(counts), width), pad, dtype=np.int64)
    start = np.cumsum(counts) - counts
    for n in range(1, width + 1):  # rows of one length at a time (a few), a column at a time
        rows = np.flatnonzero(taken == n)
        first = start[rows]
        for j in range(n):
            out[rows, j] = values[first + j]
    return out
