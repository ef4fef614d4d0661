"""The Checkpointer: one per process group; runs saves (sync, async, overlapped) and loads.

It owns what outlives one save: the staging pool, the plan cache, the background threads that
copy overlapped saves and that write and commit saves in order, and the two gloo groups it
coordinates on (see `coordinator.checkpoint_groups`). Each save and load is an object of its
own (`saving.Save`, `loading.Load`) that owns what it takes.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Dict, Optional, Union

from . import own_threads
from .coordinator import Coordinator, checkpoint_groups
from .loading import load
from .plan_cache import PlanCache
from .results import LoadResult, SaveHandle, SaveInfo
from .options import NO_HOOKS, SaveHooks, SaveOptions, byte_size, compress_mode
from .saving import Save
from .warmup import WarmUp
from .staging import StagingPool
from .storage import storage_for

log = logging.getLogger("ckpt_plugins")


class Checkpointer:
    """Saves and loads for the ranks of one process group (every rank calls every method).

    `threads`: writer threads (and data files) per rank; a rank saving under 8 MiB in all writes
    one file. `read_threads`: concurrent reads per rank; more than the cores, since reads mostly
    wait on the device and it serves deeper queues faster (`bench/save_load.py`); a rank reading
    under 8 MiB in all reads on the loading thread. `shared_memory`:
    ranks on one host pass read-once ranges through /dev/shm rather than the process group.
    `telemetry`: record every save's and load's phases (SaveInfo/LoadResult, `telemetry.json`).
    `host_memory`: the most host memory this rank stages saves in (bytes, or a size such as
    "8GiB"; None: as much as a save needs, twice over so that one save can snapshot while the
    previous one writes). A save bigger than it streams through it: snapshot a part, write it,
    reuse the memory; the snapshot then also waits for the writes of what did not fit.
    `compress`: saves store each tensor compressed where that shrinks it (True), or only where that
    also shortens the commit ("auto"), unless a save says otherwise (`save(..., compress=False)`;
    the framework hooks' switches set it).
    """

    def __init__(self, process_group=None, *, threads: int = 2, read_threads: int = 4,
                 host_memory: Union[int, str, None] = None, direct_io: bool = True, shared_memory: bool = True,
                 timeout: timedelta = timedelta(minutes=10), telemetry: bool = True, compress: Union[bool, str] = False):
        self.process_group = process_group
        self.compress = compress
        self.shared_memory = shared_memory
        self.threads = threads
        self.read_threads = read_threads
        self.direct_io = direct_io
        self.timeout = timeout
        self.telemetry = telemetry
        self.pool = StagingPool(byte_size(host_memory))
        self.cache = PlanCache(threads)
        self._fg: Optional[Coordinator] = None
        self._bg: Optional[Coordinator] = None
        self._executor = own_threads.executor(1, "ckpt-commit")  # saves commit in order
        # overlapped saves plan and copy here, one at a time: a thread started per save cost its
        # caller a wait for the new thread to run (a millisecond on busy cores)
        self._snapshots = own_threads.executor(1, "ckpt-snapshot")
        self._last: Optional[SaveHandle] = None
        self._warming: Optional[threading.Thread] = None

    @property
    def compress(self) -> Union[bool, str]:
        return self._compress

    @compress.setter
    def compress(self, value: Union[bool, str]) -> None:
        """For the framework hooks' switches too: True, False or "auto", checked here."""
        self._compress = compress_mode(value)

    @property
    def host_memory(self) -> Optional[int]:
        return self.pool.cap_bytes

    @host_memory.setter
    def host_memory(self, value: Union[int, str, None]) -> None:
        """For the framework hooks' switches; the next save stages within it."""
        self.pool.cap_bytes = byte_size(value)

    def coordinator(self) -> Coordinator:
        """The foreground coordinator of the checkpoint's own gloo groups (created on first use),
        once any warm-up or overlapped snapshot using it is over: for collective steps of
        components built on saves and loads (the memory tier). Every rank calls it."""
        self._foreground_idle()
        if self._fg is None:
            self._fg, self._bg = checkpoint_groups(self.process_group, self.timeout)
        return self._fg

    def _foreground_idle(self) -> None:
        """Wait for the background users of the foreground group: a warm-up, and an overlapped
        save, which agrees on its plan in its snapshot thread (and then queues its writes)."""
        if self._warming is not None:
            self._warming.join()
            self._warming = None
        if self._last is not None:
            self._last.wait_snapshot_quietly()

    def warm_up(self, state: Dict[str, Any], *, base=None, background: bool = True) -> None:
        """Pay the first save's one-time costs now, so that it stalls no longer than any later one
        (`warmup.WarmUp`). Every rank calls it, after the first optimizer step (optimizer state
        exists only then) and with the state its saves will pass (`base` as they will). By
        default the work runs in a background thread at low priority, beside the next training
        steps; the next save or load waits for it. The slot is the one saves reuse, within
        `host_memory`."""
        warm = WarmUp(state, self.coordinator(), self.pool, self.cache, base)
        if background:
            self._warming = own_threads.thread(warm.run, "ckpt-warm-up", True)
            self._warming.start()
        else:
            warm.run(False)

    def _after_last(self, storage) -> None:
        if self._last is None:
            return
        self._last.wait_snapshot_quietly()  # an overlapped snapshot may still be copying the state
        if self._last.path == str(storage):
            self._last.wait_quietly()  # never clean up or read under a save still writing here

    @own_threads.working()  # its snapshot runs on the caller's thread
    def save(self, path, state: Dict[str, Any], *, hooks: SaveHooks = NO_HOOKS, **options) -> SaveInfo:
        """Save `state` to `path`; returns once committed. `options`: the fields of `SaveOptions`
        (framework, layout, step, overwrite, base, compress); `hooks`: steps around the commit (`SaveHooks`).
        Writing starts while the later tensors are still being copied."""
        save = self._start(path, state, "sync", options, hooks)
        self._executor.submit(save.write_and_commit, self._bg)
        save.snapshot()
        info = save.handle.wait()
        self._returned(save)
        return info

    @own_threads.working()
    def save_async(self, path, state: Dict[str, Any], *, overlap: bool = False, hooks: SaveHooks = NO_HOOKS,
                   **options) -> SaveHandle:
        """Save `state` to `path` in the background; returns a SaveHandle once the snapshot is taken
        (training may then change the state; `handle.wait()` for the commit). `overlap=True`:
        returns once the state is captured, the plan's agreement and the snapshot running beside
        the next forward and backward (any failure is raised by `handle.wait()`); call
        `handle.wait_snapshot()` before the next optimizer step."""
        save = self._start(path, state, "overlap" if overlap else "async", options, hooks)
        if overlap:  # the lock and the plan's agreement too: training waits only for the state's capture
            write = functools.partial(self._executor.submit, save.write_and_commit, self._bg)
            self._snapshots.submit(save.planned_snapshot, write)
            self._returned(save)
            return save.handle
        streams = not self.pool.fits(save.job.nbytes)  # its snapshot waits for its writes
        if streams:
            self._executor.submit(save.write_and_commit, self._bg)
        save.snapshot()  # training waits for this alone: it gets the cores to itself
        self._returned(save)
        if not streams:
            self._executor.submit(save.write_and_commit, self._bg)  # following the snapshot
        return save.handle

    def _start(self, path, state: Dict[str, Any], mode: str, options: Dict[str, Any], hooks: SaveHooks) -> Save:
        coord = self.coordinator()
        storage = storage_for(path, direct_io=self.direct_io)
        self._after_last(storage)
        t0 = time.time()
        options = SaveOptions(**{"compress": self.compress, **options})
        save = Save(storage, state, coord, self.pool, self.cache, options, hooks, mode=mode, telemetry=self.telemetry)
        save.recorder.record.start = t0
        save.capture()
        if hooks.captured is not None:
            hooks.captured()
        if mode != "overlap":  # an overlapped save prepares in its snapshot thread
            save.prepare(copy_early=mode == "async")
        self._last = save.handle
        return save

    @staticmethod
    def _returned(save: Save) -> None:
        """The stall: from the call until training may go on."""
        stall = time.time() - save.recorder.record.start
        save.handle.info.timings["stall"] = save.recorder.record.info["stall"] = stall

    def wait_idle(self) -> None:
        """Wait until no save is in flight, leaving its error to its own handle."""
        if self._last is not None:
            self._last.wait_quietly()

    def wait(self) -> None:
        """Wait for the last save's commit (raising its error)."""
        if self._last is not None:
            self._last.wait()

    def close(self) -> None:
        """Let pending saves finish, then release the background threads and the checkpoint groups."""
        self._foreground_idle()
        self._snapshots.shutdown(wait=True)
        self._executor.shutdown(wait=True)
        self._fg = self._bg = None

    def load(self, path, state: Dict[str, Any], *, strict: bool = True, verify: bool = False) -> LoadResult:
        """Load a checkpoint into `state` in place, resharding to whatever layout `state` has.

        Every check the metadata allows (format, version, paths, keys, shapes, dtypes, coverage,
        file sizes) runs on every rank before any tensor is touched. A stored range several ranks
        need is read by one of them and passed to the others. Any rank's failure raises the same
        error on every rank. `verify=True`: then compare every live region the load filled, as a save
        would describe it, with what landed there (`VerificationError` naming the key, box and rank
        on any difference; `result.verified_bytes`).
        """
        coord = self.coordinator()
        storage = storage_for(path, direct_io=self.direct_io)
        self._after_last(storage)
        return load(storage, state, coord, strict=strict, verify=verify, read_threads=self.read_threads,
                    shared_memory=self.shared_memory, telemetry=self.telemetry)
