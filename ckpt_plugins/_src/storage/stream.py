"""Streaming writers' help: sequential writes of any size through page-aligned pieces."""
from __future__ import annotations

import numpy as np

from ..hostmem import PAGE as ALIGN
from .base import Writer, durable

DIRECT = 1 << 20  # aligned data this long goes to the writer as it is, not through the buffer


class AlignedStream:
    """Sequential writes of any size and alignment through `writer`, staged in a reusable
    page-aligned buffer so that every piece but the last qualifies for O_DIRECT (streaming tools
    write safetensors headers and tensors of arbitrary sizes)."""

    def __init__(self, writer: Writer, piece: int = 16 << 20):
        self.writer = writer
        raw = np.empty(piece + ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        self.buffer = memoryview(raw[start:start + piece])
        self.fill = 0

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        if not self.fill and len(data) >= DIRECT and address(data) % ALIGN == 0:
            n = len(data) // ALIGN * ALIGN  # aligned already (a staged tensor's bytes): no copy
            self.writer.write(data[:n])
            data = data[n:]
        while len(data):
            n = min(len(data), len(self.buffer) - self.fill)
            self.buffer[self.fill:self.fill + n] = data[:n]
            self.fill += n
            data = data[n:]
            if self.fill == len(self.buffer):
                self.writer.write(self.buffer)
                self.fill = 0

    def close(self) -> None:
        """Write what is left, make everything durable, release the file."""
        with durable(self.writer):
            if self.fill:
                self.writer.write(self.buffer[:self.fill])


def address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
