"""Pausing Python's cyclic garbage collector around allocation-heavy pure work (planning at scale,
decoding large metadata): millions of small, acyclic objects are made, and the collector's passes
over a large heap then cost more than the work itself (`bench/plan_scale.py --layout dsv3` shows
the plans and the metadata decoding with it)."""
from __future__ import annotations

import functools
import gc
import threading

_lock = threading.Lock()
_depth = 0
_was_enabled = False


def gc_paused(fn):
    """`fn` with the collector paused while any such call runs (in any thread); it is enabled again
    afterwards only if it was enabled before the first of them."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        global _depth, _was_enabled
        with _lock:
            if _depth == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _depth -= 1
                if _depth == 0 and _was_enabled:
                    gc.enable()
    return paused
