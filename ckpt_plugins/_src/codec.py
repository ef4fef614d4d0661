"""Lossless compression of stored chunks: each element's bytes grouped by position, then zstd.

The high (sign and exponent) bytes of floating-point tensors carry a few bits of entropy each and
the low mantissa bytes close to eight: apart, zstd codes the first in a few bits and stores the
second as they are (zstd switches to raw blocks by itself where a block does not compress), where
interleaved they compress hardly at all. A chunk is the checksum chunk (`CHUNK_BYTES` of the
item's bytes), so a read of a few rows decompresses only the chunks it touches, and checksums still
cover the bytes as loaded. Pure: no I/O.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .errors import CorruptCheckpointError
from .optional import require

LEVEL = 1  # zstd's fastest level: higher ones gained under 1% on model weights, at 2-3x the CPU time
# a tensor whose first chunk shrinks by less than this fraction is stored plainly: its other chunks
# (random bytes, already-compressed data) are not worth the CPU time to try, nor the reads' to undo
MIN_SAVING = 1 / 32


def zstd():
    """The zstandard module; a missing one is a one-line error naming the install."""
    return require("zstandard", "compressed checkpoints", "pip install 'ckpt_plugins[zstd]'")


def _grouped(data, group: int) -> memoryview:
    """The bytes of `data` (whole elements of `group` bytes) with byte k of every element together."""
    if group == 1:
        return memoryview(data).cast("B")
    return memoryview(np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8).reshape(-1, group).T)).cast("B")


class Packer:
    """Compresses chunks (one per thread: a zstd context is not shared)."""

    def __init__(self, level: int = LEVEL):
        self._ctx = zstd().ZstdCompressor(level=level, write_content_size=True)

    def pack(self, chunk, group: int) -> Optional[bytes]:
        """`chunk` compressed, grouped by `group` bytes; None when that does not make it smaller by
        `MIN_SAVING` (then it is stored as it is)."""
        view = memoryview(chunk).cast("B")
        frame = self._ctx.compress(_grouped(view, group))
        return frame if len(frame) <= len(view) * (1 - MIN_SAVING) else None


def unpack(frame, nbytes: int, group: int, where: str) -> memoryview:
    """The `nbytes` bytes a stored chunk holds; `frame` is them as they are when it is that long."""
    if len(frame) == nbytes:
        return memoryview(frame).cast("B")
    try:
        data = zstd().ZstdDecompressor().decompress(bytes(frame), max_output_size=nbytes)
    except zstd().ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: a compressed chunk does not decompress ({exc}); "
                                     "the checkpoint is corrupt") from None
    if len(data) != nbytes or nbytes % group:
        raise CorruptCheckpointError(f"{where}: a compressed chunk holds {len(data)} bytes, not {nbytes}; "
                                     "the checkpoint is corrupt")
    if group == 1:
        return memoryview(data)
    return memoryview(np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8).reshape(group, -1).T)).cast("B")
