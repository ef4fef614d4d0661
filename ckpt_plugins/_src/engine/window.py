"""Where a rank's staged bytes sit in its staging buffer: the windows a save streams through.

A save whose bytes fit the buffer is one window, each data file at its own place (the whole
save staged at once). One that does not fit streams: the buffer's two halves take turns, each
holding the next part of every data file, so the snapshot copies a window into one half while the
writers write the previous window from the other. Pure: no I/O, no threads.
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
    spans: Optional[Dict[str, int]]  # each file's bytes per window when streaming (None: one window)

    def index(self, file: str, offset: int) -> int:
        """The window holding byte `offset` of `file`."""
        return 0 if self.spans is None else offset // self.spans[file]


def plan_windows(sizes: Dict[str, int], room: int) -> Windows:
    """The windows for data files of `sizes` in a buffer of `room` bytes. Each file's span is its
    share of a half, so every window holds the same fraction of every file and the writers free
    a half together. Raises MemoryError when `room` cannot give every file `MIN_SPAN` bytes in each
    of two halves."""
    names = sorted(sizes)
    total = sum(align_up(sizes[n]) for n in names)
    if room >= total:
        at, start = {}, 0
        for name in names:
            at[name] = start
            start += align_up(sizes[name])
        return Windows([Window({n: (0, sizes[n]) for n in names if sizes[n]}, at)], None)
    half, least = room // 2 // PAGE * PAGE, 2 * len(names) * MIN_SPAN
    if room < least:
        raise MemoryError(f"a host-memory budget of {room} bytes for staging is too small to stream this "
                          f"rank's {len(names)} data files through: give it at least {least} bytes")
    shared = half - len(names) * MIN_SPAN  # what is left once every file has its least
    spans = {n: max(MIN_SPAN, sizes[n] * shared // total // PAGE * PAGE) for n in names}
    windows = []
    for k in range(max(-(-sizes[n] // spans[n]) for n in names)):
        ranges = {n: (k * spans[n], min((k + 1) * spans[n], sizes[n])) for n in names if k * spans[n] < sizes[n]}
        at, start = {}, (k % 2) * half
        for name in names:
            at[name] = start
            start += spans[name]
        windows.append(Window(ranges, at))
    return Windows(windows, spans)
