"""The memory tier: checkpoints kept in the hosts' shared memory, each rank's files replicated to
another host, recoverable (and reshardable) after the loss of any one host.

A memory save is an async save into the host's tier directory (`HostDir`), in the on-disk format;
after its commit, on the background group and before it counts as done: the metadata goes to
every host, each rank's files to its replica rank on the next host (`replicate`), older steps are
dropped, and every `persist_every`-th step is written to durable storage from the memory copy
(`persist`). Recovery (`recover`) agrees on the newest step complete on the surviving hosts, else
the newest durable one, and loads it through the ordinary planner: any number of ranks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from .. import shm
from ..coordinator import Coordinator
from ..errors import NotACheckpointError
from ..format import METADATA_FILE
from ..options import NO_HOOKS, SaveHooks
from ..results import LoadResult, SaveHandle, SaveInfo
from ..storage import Storage
from .hostdir import HostDir
from .layout import Choice, HostReport, Hosts, choose
from .persist import persist
from .replicate import replicate
from .step_storage import TierStorage

log = logging.getLogger("ckpt_plugins")


@dataclass
class Located:
    """The step recovery loads: from `storage` (memory), or durable when storage is None."""
    step: int
    source: str  # "memory" or "storage"
    storage: Optional[TierStorage] = None


class MemoryTier:
    """`keep`: committed memory steps each host keeps (the newest; the step being saved comes on
    top until it commits). `directory`: this host's tier directory (default: one per run in the
    shared-memory directory, `shm.shm_dir()`)."""

    def __init__(self, checkpointer, root: str, *, keep: int = 1, directory: Optional[str] = None):
        if keep < 1:
            raise ValueError("memory_keep must be at least 1")
        self.checkpointer, self.keep = checkpointer, keep
        self.host = HostDir(root, directory)
        self.hosts: Optional[Hosts] = None
        self.timings: Dict[str, float] = {}  # the last recovery's agreement and load seconds

    def _start(self, coord: Coordinator, fresh: bool) -> Hosts:
        """Learn the hosts (once). A job that saves before any recovery starts afresh: what an
        earlier run left in memory is dropped, or a later recovery could take its newer steps."""
        if self.hosts is None:
            what = "starting the memory tier"
            hosts = Hosts(tuple(coord.agreed(lambda: shm.host_key() or f"rank-{coord.rank}", what=what)))

            def drop_stale() -> None:  # nobody writes a step before its host dropped the stale ones
                if fresh and hosts.leader(coord.rank):
                    self.host.drop(())

            coord.agreed(drop_stale, what=what)
            if len(hosts.groups) == 1:
                log.warning("memory tier: every rank is on one host, so there is no replica: memory "
                            "steps survive a restart of the job's processes, not the loss of the host")
            self.hosts = hosts
        return self.hosts

    # ------------------------------------------------------------ save

    def save_async(self, step: int, state: Dict[str, Any], *, persist_to: Optional[Storage] = None,
                   overwrite: bool = False, hooks: SaveHooks = NO_HOOKS, **options) -> SaveHandle:
        """Save `step` to memory; returns the SaveHandle once the snapshot is taken. With
        `persist_to`, also to that storage, from the memory copy, before the handle is done (and
        `hooks.on_commit` after that commit; `hooks.on_summary` gets the memory save's figures)."""
        hosts = self._start(self.checkpointer.coordinator(), fresh=True)
        step = int(step)

        def then(bg: Coordinator, info: SaveInfo) -> None:
            self._after_commit(bg, hosts, step, info, persist_to, overwrite, hooks.on_commit)

        return self.checkpointer.save_async(self.host.storage(step), state, step=step, overwrite=True,
                                            hooks=SaveHooks(on_summary=hooks.on_summary, then=then), **options)

    def _after_commit(self, bg: Coordinator, hosts: Hosts, step: int, info: SaveInfo, persist_to, overwrite,
                      on_commit) -> None:
        what = f"replicating memory step {step}"
        gathered = bg.agreed(lambda: (info.files, self.host.storage(step).read_bytes(METADATA_FILE)
                                      if bg.is_coordinator else None), what=what)
        files, metadata = [g[0] for g in gathered], gathered[0][1]

        def replicated() -> None:
            replicate(bg, hosts, files, self.host, step)
            if hosts.leader(bg.rank) and not bg.is_coordinator:
                self.host.write_metadata(step, metadata)

        bg.agreed(replicated, what=what, then="The previous memory step is kept")
        if hosts.leader(bg.rank):  # the new step is whole on every host: older ones can go
            try:
                older = sorted(s for s in self.host.steps() if s <= step)  # newer ones: saves in flight
                self.host.drop(older[-self.keep:] + [s for s in self.host.steps() if s > step])
            except OSError as exc:  # housekeeping the next save retries; raising would strand the others
                log.warning("memory tier: could not drop old steps in %s: %s", self.host, exc)
        if persist_to is not None:
            persist(bg, self.host, step, info.files, metadata, persist_to, overwrite=overwrite, on_commit=on_commit)

    # ------------------------------------------------------------ recovery

    def recover(self, state: Dict[str, Any], durable: Optional[int],
                load_durable: Callable[[int], LoadResult], step: Optional[int] = None, **options) -> LoadResult:
        """Load the newest step complete in the memory of the surviving hosts, else durable step
        `durable` (through `load_durable`); every rank agrees on the choice, which is logged.
        `step`: that step only (memory when it is complete there). `options`: `Checkpointer.load`'s."""
        found = self.locate(durable, step)
        t = time.time()
        result = (self.checkpointer.load(found.storage, state, **options) if found.storage
                  else load_durable(found.step))
        self.timings["load"] = time.time() - t
        result.step, result.source = found.step, found.source
        self.settle(found)
        return result

    def locate(self, durable: Optional[int], step: Optional[int] = None) -> Located:
        """Agree on the step to load (collective; logged on rank 0): `storage` reads it from memory,
        or it is durable step `step` (storage None). Raises NotACheckpointError when there is none.
        A framework's loader reads the metadata and loads from it, then calls `settle`."""
        coord = self.checkpointer.coordinator()
        t0 = time.time()
        self.checkpointer.wait_idle()  # a memory save still replicating: its step must not be dropped
        hosts = self._start(coord, fresh=False)
        reports = coord.agreed(lambda: HostReport({s: f for s, f in self.host.inventory().items()
                                                   if step is None or s == int(step)}, durable),
                               what="memory-tier recovery", then="Nothing was loaded")
        choice = choose(hosts, reports, METADATA_FILE)
        if step is not None and choice.step != int(step):
            choice = Choice(int(step), "storage", why=choice.why)
        if choice.step is None:  # what memory holds is incomplete: the run starts afresh
            self.settle(Located(0, ""))
            raise NotACheckpointError(f"nothing to recover: {choice.why} (memory tier {self.host}, "
                                      f"{len(hosts.groups)} host(s))")
        if coord.is_coordinator:
            log.info("recovery: loading step %d from %s%s%s", choice.step,
                     "memory" if choice.source == "memory" else "storage",
                     f"; newest durable step: {durable}" if choice.source == "memory" else "",
                     f" ({choice.why})" if choice.why else "")
        found = Located(choice.step, choice.source, self._storage(coord, choice) if choice.source == "memory" else None)
        self.timings["agree"] = time.time() - t0
        return found

    def settle(self, found: Located) -> None:
        """After the load (collective): only the step loaded stays in memory, so the next saves'
        steps start clean."""
        coord = self.checkpointer.coordinator()

        def drop_others() -> None:
            if self.hosts.leader(coord.rank):
                self.host.drop([found.step] if found.source == "memory" else [])

        coord.agreed(drop_others, what="memory-tier recovery", then="The step was loaded")

    def _storage(self, coord: Coordinator, choice: Choice) -> TierStorage:
        """The chosen step as this rank loads it; the metadata and object files go to every rank."""
        def mine() -> Dict[str, bytes]:
            storage = self.host.storage(choice.step)
            return {name: storage.read_bytes(name) for name, rank in choice.small.items() if rank == coord.rank}

        small = {}
        for part in coord.agreed(mine, what="memory-tier recovery", then="Nothing was loaded"):
            small.update(part)
        return TierStorage(self.host.storage(choice.step), choice.sizes, choice.holders, small,
                           f"memory step {choice.step} ({self.host})")
