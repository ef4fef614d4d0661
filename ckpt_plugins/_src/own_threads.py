"""The checkpointer's own threads, made here and marked, and callers marked while a save runs on
them: there, a framework's teardown that waits for the last save (`step_gate.committed_first`)
must not wait. Garbage collection runs finalisers on whichever thread allocates (DeepSpeed's
`DeepSpeedEngine.__del__` calls `destroy`), and the save that teardown would wait for may be
waiting for that very thread: a commit thread waited for itself here, forever."""
from __future__ import annotations

import contextlib
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

_local = threading.local()


def at_work() -> bool:
    """Whether this thread is running checkpoint work (a save, or one of our threads)."""
    return getattr(_local, "working", False)


def _mark() -> None:
    _local.working = True


@contextlib.contextmanager
def working() -> Iterator[None]:
    """Mark the calling thread while a save runs on it."""
    before = at_work()
    _local.working = True
    try:
        yield
    finally:
        _local.working = before


def executor(workers: int, name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=_mark)


def thread(target: Callable, name: str, *args) -> threading.Thread:
    """A daemon thread running `target(*args)`, marked; not started."""
    @functools.wraps(target)
    def run() -> None:
        _mark()
        target(*args)
    return threading.Thread(target=run, name=name, daemon=True)
