"""Lossless compression of stored chunks: each element's bytes grouped by position, the high
ones zstd-compressed, the low ones as they are.

The sign and exponent bytes of floating-point tensors carry a few bits of entropy each and the low
mantissa bytes close to eight: apart, zstd codes the first in a few bits, where interleaved they
compress hardly at all; the low bytes are not worth zstd's time. So a chunk (the checksum chunk:
the checkpoint's `chunk_bytes` of the item's bytes) is stored as its bytes grouped by position,
most significant first, with a leading part of that (a float's top byte, an integer's every byte)
as one zstd frame and the rest as it is: the frame says how long its part is, so reading needs
nothing more. A read of a few rows decompresses only the chunks it touches; checksums cover the
bytes as loaded. Pure: no I/O.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .errors import CorruptCheckpointError
from .optional import require

# a tensor whose first chunk shrinks by less than this fraction is stored plainly: its other chunks
# (random bytes, already-compressed data) are not worth the CPU time to try, nor the reads' to undo
MIN_SAVING = 1 / 32


def zstd():
    """The zstandard module; a missing one is a one-line error naming the install."""
    return require("zstandard", "compressed checkpoints", "pip install 'ckpt_plugins[zstd]'")


_WORDS = {2: np.uint16, 4: np.uint32, 8: np.uint64}  # elements split by shifts: 3-4x faster than strided copies


def _grouped(data, group: int) -> np.ndarray:
    """The bytes of `data` (whole little-endian elements of `group` bytes) by position, the most
    significant byte of every element first."""
    flat = np.frombuffer(data, dtype=np.uint8)
    if group == 1:
        return flat
    out, n = np.empty(len(flat), dtype=np.uint8), len(flat) // group
    word = _WORDS.get(group)
    for k in range(group):
        if word is not None:
            out[k * n:(k + 1) * n] = flat.view(word) >> word(8 * (group - 1 - k))
        else:
            out[k * n:(k + 1) * n] = flat[group - 1 - k::group]
    return out


def _interleaved(grouped: np.ndarray, group: int) -> memoryview:
    if group == 1:
        return memoryview(grouped)
    n, word = len(grouped) // group, _WORDS.get(group)
    if word is not None:
        out = np.zeros(n, dtype=word)
        for k in range(group):
            out |= grouped[k * n:(k + 1) * n].astype(word) << word(8 * (group - 1 - k))
        return memoryview(out.view(np.uint8))
    out = np.empty(len(grouped), dtype=np.uint8)
    for k in range(group):
        out[group - 1 - k::group] = grouped[k * n:(k + 1) * n]
    return memoryview(out)


class Packer:
    """Compresses chunks (one per thread: a zstd context is not shared)."""

    def __init__(self):
        z = zstd()
        # zstd's fastest strategy with the smallest match finder: exponent bytes repeat little, so
        # their entropy coding is the gain; on trained bf16 weights this ran 2.6x faster than
        # level 1 and stored 2% less
        params = z.ZstdCompressionParameters(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
                                             target_length=0, strategy=z.STRATEGY_FAST, write_content_size=True)
        self._ctx = z.ZstdCompressor(compression_params=params)

    def pack(self, chunk, group: int, head: int) -> Optional[bytes]:
        """`chunk` grouped by `group` bytes, its first `head` bytes of each element (by significance)
        compressed; None when that does not make it smaller by `MIN_SAVING` (then it is stored as
        it is)."""
        grouped = _grouped(chunk, group)
        cut = len(grouped) // group * head
        frame = self._ctx.compress(grouped[:cut]) + grouped[cut:].tobytes()
        return frame if len(frame) <= len(grouped) * (1 - MIN_SAVING) else None


def head_bytes(dtype_is_float: bool, group: int) -> int:
    """How many of an element's bytes (most significant first) are worth compressing: a float's
    sign and exponent byte; every byte of an integer (small values leave the high ones zero)."""
    return 1 if dtype_is_float and group > 1 else group


def xor(data, delta) -> np.ndarray:
    """`data` with `delta` (bytes of the same length) XORed in; `data` as it is for no delta."""
    a = np.frombuffer(data, dtype=np.uint8)
    return a if delta is None else np.bitwise_xor(a, np.frombuffer(delta, dtype=np.uint8))


def unpack(frame, nbytes: int, group: int, where: str) -> memoryview:
    """The `nbytes` bytes a stored chunk holds; `frame` is them as they are when it is that long."""
    if len(frame) == nbytes:
        return memoryview(frame).cast("B")
    z = zstd()
    data = bytes(frame)
    try:
        size = z.get_frame_parameters(data).content_size
        if not 0 < size <= nbytes or (nbytes - size) % (nbytes // group or 1):
            raise CorruptCheckpointError(f"{where}: a compressed chunk declares {size} bytes, which no chunk of "
                                         f"{nbytes} holds; the checkpoint is corrupt")
        inflater = z.ZstdDecompressor().decompressobj()
        head = inflater.decompress(data)
        complete, tail = inflater.eof, inflater.unused_data
    except z.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: a compressed chunk does not decompress ({exc}); "
                                     "the checkpoint is corrupt") from None
    if not complete or len(head) != size or len(head) + len(tail) != nbytes or nbytes % group:
        raise CorruptCheckpointError(f"{where}: a compressed chunk does not hold its {nbytes} bytes; "
                                     "the checkpoint is corrupt")
    return _interleaved(np.frombuffer(head + tail, dtype=np.uint8), group)
