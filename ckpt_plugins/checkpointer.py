"""The Checkpointer: one per process group; runs saves (sync, async, overlapped) and loads.

It owns what outlives one save: the staging pool, the plan cache, the background thread that
writes and commits saves in order, and the two gloo groups it coordinates on (see
`coordinator.checkpoint_groups`). Each save and load is an object of its own (`saving.Save`,
`loading.Load`) that owns what it takes.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

from .coordinator import Coordinator, checkpoint_groups
from .loading import load
from .plan_cache import PlanCache
from .results import LoadResult, SaveHandle, SaveInfo
from .saving import Save
from .staging import StagingPool
from .storage import storage_for

log = logging.getLogger("ckpt_plugins")


class Checkpointer:
    """Saves and loads for the ranks of one process group (every rank calls every method).

    `threads`: writer threads (and data files) per rank. `read_threads`: concurrent reads per rank;
    more than the cores, since reads mostly wait on the device and it serves deeper queues faster
    (1 -> 4 threads took a 1 GiB cold load from 2.1-2.6 s to 1.2-1.6 s here). `shared_memory`:
    ranks on one host pass read-once ranges through /dev/shm rather than the process group.
    `telemetry`: record every save's and load's phases (SaveInfo/LoadResult, `telemetry.json`).
    """

    def __init__(self, process_group=None, *, threads: int = 2, read_threads: int = 4,
                 staging_cap_bytes: Optional[int] = None, direct_io: bool = True, shared_memory: bool = True,
                 timeout: timedelta = timedelta(minutes=10), telemetry: bool = True):
        self.process_group = process_group
        self.shared_memory = shared_memory
        self.threads = threads
        self.read_threads = read_threads
        self.direct_io = direct_io
        self.timeout = timeout
        self.telemetry = telemetry
        self.pool = StagingPool(staging_cap_bytes)
        self.cache = PlanCache(threads)
        self._fg: Optional[Coordinator] = None
        self._bg: Optional[Coordinator] = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")  # saves commit in order
        self._last: Optional[SaveHandle] = None
        self._warming: Optional[threading.Thread] = None

    def _groups(self) -> Coordinator:
        """Foreground coordinator, once any warm-up using it is over; creates the checkpoint's own
        gloo groups on first use."""
        self._finish_warm_up()
        if self._fg is None:
            self._fg, self._bg = checkpoint_groups(self.process_group, self.timeout)
        return self._fg

    def _finish_warm_up(self) -> None:
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    def warm_up(self, state: Dict[str, Any], *, base=None, background: bool = True) -> None:
        """Pay the first save's one-time costs now, so that it stalls no longer than any later one:
        the checkpoint groups, the save plan (cached for the next save of the same structure) and a
        staging slot of the size that save needs, allocated and touched. Faulting in fresh memory
        was most of a first save here (1.4 s of its 2.1 s for 552 MiB per rank: bench/save_load.py).

        Every rank calls it, after the first optimizer step (optimizer state exists only then) and
        with the state its saves will pass (`base` as they will). By default the plan and the slot
        are made in a background thread at low priority, beside the next training steps; the next
        save or load waits for it. The slot is the one saves reuse, within `staging_cap_bytes`. A
        failure only logs: the first save then does the work itself.
        """
        coord = self._groups()
        warm = Save(None, state, coord, self.pool, self.cache, meta_extra={}, overwrite=False, on_commit=None,
                    telemetry=False, base=base)
        warm.what = "warm-up"
        warm.collect()  # here: only the caller's thread may read a framework's state

        def run() -> None:
            if background:  # a thread's own niceness on Linux: training keeps the cores it needs
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
                except (AttributeError, OSError):
                    pass
            try:
                warm.plan(copy_early=False)
                self.pool.acquire(warm.job.nbytes, pin=warm.job.pinned).release()
            except Exception as exc:
                log.warning("checkpoint warm-up failed (the first save will plan and stage itself): %s: %s",
                            type(exc).__name__, exc)
            finally:
                warm.release()

        if background:
            self._warming = threading.Thread(target=run, name="ckpt-warm-up", daemon=True)
            self._warming.start()
        else:
            run()

    def _after_last(self, storage) -> None:
        if self._last is not None and self._last.path == str(storage):
            self._last.wait_quietly()  # never clean up or read under a save still writing here

    def save(self, path, state: Dict[str, Any], *, async_: bool = False, overlap: bool = False,
             framework: str = "torch", layout: Optional[Dict[str, Any]] = None, step: Optional[int] = None,
             overwrite: bool = False, on_commit: Optional[Callable[[], None]] = None,
             on_summary: Optional[Callable[[Dict[str, Any]], None]] = None, base=None,
             then: Optional[Callable[[Coordinator, SaveInfo], None]] = None):
        """Save `state` to `path`. Sync: returns SaveInfo once committed. `async_=True`: returns a
        SaveHandle once the snapshot is taken. `overlap=True`: returns a SaveHandle at once, the
        snapshot running in the background; call `wait_snapshot()` before the next optimizer step.
        `on_commit()` runs on the coordinating rank right after the commit, before the save counts
        as done (a "latest" pointer, retention); its failure is the save's error. `on_summary(figures)`
        runs there too, just before, with the save's telemetry summary (a run's history); its
        failure only logs. `base`: a committed checkpoint this state was built on (a PEFT run's
        frozen base): frozen parameters it holds alike are left to it (see `base_ref`).
        `then(coordinator, info)`: a step every rank runs after the commit, on the background
        group, before the save counts as done (the memory tier replicates and persists there);
        its failure is the save's error, so it must reach every rank through the coordinator.
        """
        coord = self._groups()
        storage = storage_for(path, direct_io=self.direct_io)
        self._after_last(storage)
        t0 = time.time()
        mode = "overlap" if overlap else "async" if async_ else "sync"
        save = Save(storage, state, coord, self.pool, self.cache, overwrite=overwrite, on_commit=on_commit,
                    meta_extra=dict(framework=framework, layout=dict(layout or {}), step=step), mode=mode,
                    telemetry=self.telemetry, on_summary=on_summary, base=base, then=then)
        save.recorder.record.start = t0
        save.prepare(copy_early=mode == "async")
        self._last = save.handle

        def returned() -> None:  # the stall: from the call until training may go on
            save.handle.info.timings["stall"] = save.recorder.record.info["stall"] = time.time() - t0

        def write() -> None:  # the writers follow the snapshot's progress piece by piece
            self._executor.submit(save.write_and_commit, self._bg, self.threads)

        if mode == "overlap":
            threading.Thread(target=save.snapshot, name="ckpt-snapshot", daemon=True).start()
            returned()
            write()
        elif mode == "async":
            save.snapshot()  # training waits for this alone: it gets the cores to itself
            returned()
            write()
        else:
            write()
            save.snapshot()  # writing starts while the later tensors are still being copied
        if mode != "sync":
            return save.handle
        info = save.handle.wait()
        returned()
        return info

    def wait(self) -> None:
        """Wait for the last save's commit (raising its error)."""
        if self._last is not None:
            self._last.wait()

    def close(self) -> None:
        """Let pending saves finish, then release the background thread and the checkpoint groups."""
        self._finish_warm_up()
        self._executor.shutdown(wait=True)
        self._fg = self._bg = None

    def load(self, path, state: Dict[str, Any], *, strict: bool = True) -> LoadResult:
        """Load a checkpoint into `state` in place, resharding to whatever layout `state` has.

        Every check the metadata allows (format, version, paths, keys, shapes, dtypes, coverage,
        file sizes) runs on every rank before any tensor is touched. A stored range several ranks
        need is read by one of them and passed to the others. Any rank's failure raises the same
        error on every rank.
        """
        coord = self._groups()
        storage = storage_for(path, direct_io=self.direct_io)
        self._after_last(storage)
        return load(storage, state, coord, strict=strict, read_threads=self.read_threads,
                    shared_memory=self.shared_memory, telemetry=self.telemetry)
