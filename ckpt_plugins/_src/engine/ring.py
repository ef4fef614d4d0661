"""Bounded, reusable memory for the ranges a load reads or receives before copying them out."""
from __future__ import annotations

from collections import deque
from typing import Callable, List, Optional, Sequence

import torch

from .. import hostmem
from ..hostmem import align_up, aligned_empty


class Ring:
    """Reusable memory for the ranges a load reads or receives before copying them out.

    Ranges are taken in order and retired oldest first (`retire` waits until a range is copied
    out and sent), so memory stays bounded and is touched once: fresh memory for every range of a
    1 GiB resharded load cost 2-5 s of page faults here, and twice its bytes in memory.
    """

    BYTES = 64 << 20  # unless one range needs more
    ALIGN = hostmem.PAGE  # ranges start page aligned: reads into them can bypass the page cache

    def __init__(self, sizes: Sequence[int], memory: Optional[torch.Tensor] = None):
        """`memory` (at least `size_for(sizes)` bytes, page aligned): the ring's, else allocated."""
        self.size = self.size_for(sizes)
        self.memory = memory if memory is not None or not self.size else aligned_empty(self.size)
        self.entries: deque = deque()  # (start, end, retire) in taking order

    @classmethod
    def size_for(cls, sizes: Sequence[int]) -> int:
        need = max([0] + [align_up(n, cls.ALIGN) for n in sizes])
        return max(need, min(cls.BYTES, sum(align_up(n, cls.ALIGN) for n in sizes)))

    def passes(self, sizes: Sequence[int], limit: int) -> List[int]:
        """Each range's pass, were ranges of `sizes` taken in that order from this (empty) ring: a
        new pass starts with the range whose placement retires one of the current pass, or that
        takes the pass past `limit` bytes (a pass's first range may be bigger). A pass's ranges
        are placed without retiring one another, so a reader may hold them all until the last
        is read."""
        entries: deque = deque()  # (start, end, pass), as `take` would place them
        out: List[int] = []
        filled = 0
        for nbytes in sizes:
            n, retired = align_up(nbytes, self.ALIGN), set()
            while (start := self._fit(n, entries)) is None:
                retired.add(entries.popleft()[2])
            current = out[-1] if out else 0
            if out and (current in retired or filled + n > limit):
                current, filled = current + 1, 0
            entries.append((start, start + n, current))
            out.append(current)
            filled += n
        return out

    def take(self, nbytes: int, retire: Callable[[], None]) -> torch.Tensor:
        n = align_up(nbytes, self.ALIGN)
        while True:
            start = self._fit(n, self.entries)
            if start is not None:
                self.entries.append((start, start + n, retire))
                return self.memory[start:start + nbytes] if n else torch.empty(0, dtype=torch.uint8)
            self._retire_oldest()

    def _fit(self, n: int, entries: deque) -> Optional[int]:
        """Where `n` bytes go after `entries` (the live ranges, oldest first); None: nowhere yet."""
        if not entries:
            return 0
        tail, head = entries[0][0], entries[-1][1]
        if entries[-1][0] >= tail:  # live memory is [tail, head): free after it, then before it
            if head + n <= self.size:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None  # wrapped: free is [head, tail)

    def _retire_oldest(self) -> None:
        self.entries[0][2]()
        self.entries.popleft()

    def drain(self) -> None:
        while self.entries:
            self._retire_oldest()
