"""The staging pool: reusable host buffers that snapshots copy into.

Allocated once, touched, page aligned, and reused: copying into touched memory is several times
faster than cloning into fresh memory (page faults; `bench/snapshot_copy.py`), and aligned buffers
let the local backend write with O_DIRECT. Two slots alternate so a save can snapshot while the previous one writes;
the total never exceeds the cap (a save bigger than the cap streams through one slot). Pinned when tensors live on a GPU.
"""
from __future__ import annotations

import threading
from typing import List, Optional

import torch

from .hostmem import PAGE, advise_huge_pages, align_up, aligned_empty


class StagingSlot:
    def __init__(self, pool: "StagingPool", index: int):
        self.pool, self.index = pool, index
        self.buffer: Optional[torch.Tensor] = None  # uint8, page aligned
        self.fresh_bytes = 0  # what the last acquire allocated and touched (0: reused)

    def ensure(self, nbytes: int, pin: bool, limit: Optional[int] = None) -> torch.Tensor:
        """A buffer of at least `nbytes`; grows (reallocates and touches) only when too small, then
        with room for objects that grow between saves (RNG states, schedulers, client state): a
        slot that grows is faulted in again, the cost a warm-up took off the first save."""
        self.fresh_bytes = 0
        if (self.buffer is None or self.buffer.numel() < nbytes or (pin and not self.buffer.is_pinned())
                or (limit is not None and self.buffer.numel() > limit)):  # the budget was lowered
            self.buffer = None  # release before allocating: the cap counts both
            room = nbytes + nbytes // 64
            self.buffer = aligned_empty(room if limit is None else max(nbytes, min(room, limit)), pin)
            if not pin:
                advise_huge_pages(self.buffer)  # a 512th of the page faults to take
            self.buffer.zero_()  # touch every page now, not during a snapshot
            self.fresh_bytes = self.buffer.numel()
        return self.buffer

    def release(self) -> None:
        self.pool._release(self)


class StagingPool:
    """Two alternating slots, at most `cap_bytes` in all (None: no cap)."""

    def __init__(self, cap_bytes: Optional[int] = None):
        self.cap_bytes = cap_bytes
        self._slots: List[StagingSlot] = [StagingSlot(self, 0), StagingSlot(self, 1)]
        self._free = list(self._slots)
        self._cond = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        return sum(s.buffer.numel() for s in self._slots if s.buffer is not None)

    def fits(self, nbytes: int) -> bool:
        """Whether a save of `nbytes` is staged whole (otherwise it streams through the cap)."""
        return self.cap_bytes is None or align_up(nbytes) <= self.cap_bytes

    def acquire(self, nbytes: int, pin: bool = False) -> StagingSlot:
        """A slot for a save of `nbytes`, waiting for one to be released if both are busy.

        When two slots of this size would exceed the cap, only one is used (the next save then
        waits for the previous one's writes); when one would, that one holds the cap and the save
        streams through it (`engine.window`).
        """
        need = align_up(nbytes)
        single = self.cap_bytes is not None and 2 * need > self.cap_bytes
        with self._cond:
            while True:
                candidates = [s for s in self._free if not single or s.index == 0]
                if candidates and (not single or len(self._free) == len(self._slots)):
                    slot = max(candidates, key=lambda s: s.buffer.numel() if s.buffer is not None else -1)
                    self._free.remove(slot)
                    break
                self._cond.wait()
        if single:
            self._slots[1].buffer = None
        limit = None if self.cap_bytes is None else self.cap_bytes // (1 if single else 2) // PAGE * PAGE
        slot.ensure(nbytes if self.fits(nbytes) else limit, pin, limit)
        return slot

    def _release(self, slot: StagingSlot) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()
