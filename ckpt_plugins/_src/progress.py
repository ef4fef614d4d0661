"""Progress bars for the command-line tools (tqdm), on stderr and only on a terminal."""
from __future__ import annotations

import sys


def progress_bar(total: int, label: str):
    """A byte-counting progress bar on stderr (tqdm), shown only when stderr is a terminal;
    `total` 0 when unknown. `.update(n)` as bytes land, `.close()` at the end."""
    from tqdm import tqdm
    return tqdm(total=total or None, desc=label, unit="B", unit_scale=True, leave=False,
                disable=not sys.stderr.isatty())
