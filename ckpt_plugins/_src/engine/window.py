"""Where a rank's staged bytes sit in its staging buffer: the windows a save streams through.

A save whose bytes fit the buffer is one window, each data file at its own place (the whole
save staged at once). One that does not fit streams: the buffer's two halves take turns, each
holding the next `span` bytes of every data file, so the snapshot copies a window into one half
while the writers write the previous window from the other. Pure: no I/O, no threads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..hostmem import PAGE, align_up

MIN_SPAN = PAGE  # bytes of one file per window: page aligned, as direct writes need


@dataclass
class Window:
    """File ranges staged together: `ranges[file]` = (start, end) in the file, stored in the
    buffer from `at[file]` on."""
    ranges: Dict[str, Tuple[int, int]]
    at: Dict[str, int]

    def place(self, file: str, offset: int) -> int:
        """Where byte `offset` of `file` sits in the buffer (within this window's range)."""
        return self.at[file] + offset - self.ranges[file][0]


@dataclass
class Windows:
    windows: List[Window]
    span: Optional[int]  # each file's bytes per window when streaming (None: one window)

    def index(self, offset: int) -> int:
        """The window holding byte `offset` of any file."""
        return 0 if self.span is None else offset // self.span


def plan_windows(sizes: Dict[str, int], room: int) -> Windows:
    """The windows for data files of `sizes` in a buffer of `room` bytes. Raises MemoryError when
    `room` cannot give every file `MIN_SPAN` bytes in each of two halves."""
    names = sorted(sizes)
    total = sum(align_up(sizes[n]) for n in names)
    if room >= total:
        at, start = {}, 0
        for name in names:
            at[name] = start
            start += align_up(sizes[name])
        return Windows([Window({n: (0, sizes[n]) for n in names if sizes[n]}, at)], None)
    span = room // 2 // len(names) // PAGE * PAGE
    if span < MIN_SPAN:
        least = 2 * len(names) * MIN_SPAN
        raise MemoryError(f"a host-memory budget of {room} bytes for staging is too small to stream this "
                          f"rank's {len(names)} data files through: give it at least {least} bytes")
    half = span * len(names)
    windows = []
    for k in range(-(-max(sizes.values()) // span)):
        ranges = {n: (k * span, min((k + 1) * span, sizes[n])) for n in names if k * span < sizes[n]}
        windows.append(Window(ranges, {n: (k % 2) * half + i * span for i, n in enumerate(names)}))
    return Windows(windows, span)
