"""Whether compressing shortens a save's commit (`compress="auto"`), judged from what this save's
writers measure as they go: how long storage takes per byte (the writers share it), and per kind
of element (its size and the bytes compressed) how much CPU time a writer takes to compress a
byte and how much that saves.

Each writer thread compresses and writes one after the other, while the others may be writing:
compressed, a save's bytes take storage's time for what is left and the writers' time to
compress them, overlapping as far as the writers do. Until storage has taken a piece's worth of
writes, chunks are written as they are; then the first chunk of a kind is compressed to measure
it, and written as the measure says.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

Kind = Tuple[int, int]  # an element's bytes, and how many of them are compressed


MEASURED = 8 << 20  # bytes storage takes before its pace is trusted (a file's first write is slow)
MARGIN = 0.95  # compressed only when that takes at most this share of the time: the measures are noisy


def worth_compressing(compress_s: float, saving: float, write_s: float, threads: int) -> bool:
    """Per byte, `write_s` of storage's time as it is. Compressed: storage's time for what is left
    and the writers' compressing (`compress_s` each, `threads` at once) overlap; one writer's not
    at all, several writers' the more, the more one outweighs the other (what is left of the
    shorter is its ratio to the longer: this fit the bench's links of 250 MB/s to 2 GB/s)."""
    left, cpu = (1 - saving) * write_s, compress_s / threads
    longer, shorter = max(left, cpu), min(left, cpu)
    took = longer + (shorter if threads == 1 else shorter * shorter / longer)
    return took < MARGIN * write_s


@dataclass
class _Sum:
    raw: int = 0  # bytes taken
    seconds: float = 0.0


@dataclass
class _Packed(_Sum):
    stored: int = 0  # what `raw` compressed to


@dataclass
class Pace:
    """One save's measurements, shared by its `threads` writer threads (those that run at once).
    Storage's time is shared among the writes in flight, as they share it: each is counted its
    share of every interval."""
    threads: int = 1
    written: _Sum = field(default_factory=_Sum)  # seconds: the finished writes' shares
    packed: Dict[Kind, _Packed] = field(default_factory=dict)
    _shares: Dict[int, float] = field(default_factory=dict)  # the writes in flight, by writer
    _last: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _advance(self) -> None:
        now = time.perf_counter()
        for k in self._shares:
            self._shares[k] += (now - self._last) / len(self._shares)
        self._last = now

    def writing(self, writer: int) -> None:
        """A write by `writer` begins."""
        with self._lock:
            self._advance()
            self._shares[writer] = 0.0

    def wrote(self, writer: int, nbytes: int) -> None:
        """`writer`'s write has taken `nbytes`."""
        with self._lock:
            self._advance()
            self.written.seconds += self._shares.pop(writer)
            self.written.raw += nbytes

    def compressed(self, kind: Kind, raw: int, stored: int, seconds: float) -> None:
        """A chunk of `raw` bytes was compressed to `stored` (`raw`: it did not shrink) in `seconds`."""
        with self._lock:
            s = self.packed.setdefault(kind, _Packed())
            s.raw, s.stored, s.seconds = s.raw + raw, s.stored + stored, s.seconds + seconds

    def known(self) -> bool:
        """Whether storage has taken enough to trust its pace."""
        return self.written.raw >= MEASURED

    def pays(self, kind: Kind) -> Optional[bool]:
        """Whether compressing a chunk of `kind` shortens the commit: False until storage has
        taken `MEASURED` bytes; None until a chunk of `kind` has been compressed (compress one to
        find out)."""
        with self._lock:
            s, w = self.packed.get(kind), self.written
            if not self.known():
                return False
            if s is None:
                return None
            return worth_compressing(s.seconds / s.raw, 1 - s.stored / s.raw, w.seconds / w.raw, self.threads)


class TimedWriter:
    """A storage writer whose writes are counted into `pace`."""

    def __init__(self, writer, pace: Pace):
        self.writer, self.pace = writer, pace

    def write(self, data) -> None:
        self.pace.writing(id(self))
        try:
            self.writer.write(data)
        finally:
            self.pace.wrote(id(self), len(memoryview(data).cast("B")))

    def close(self) -> None:
        self.writer.close()
