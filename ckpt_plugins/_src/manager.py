"""CheckpointManager: the checkpoints of one run under a root directory (or object-store prefix).

`root/<prefix><step>` per save; `root/latest` names the newest committed step and is updated only
after a commit (from the commit itself, so a crash at any point leaves it naming a whole
checkpoint); `keep_last=N` retention (never of a step a kept delta checkpoint is built on); listing of committed steps; cleanup of what crashed saves
left behind, and only that; `root/telemetry.jsonl`, the run's history (one line per save and load:
stall, commit time, size, throughput, slowest rank and phase), read by `bcp trace ROOT --history`.

With `memory_every` (the memory tier, `tier.MemoryTier`), saves go to the hosts' shared memory,
replicated to a peer host, and every `persist_every`-th step also to `root`, from the memory copy;
`load` then recovers the newest step complete in memory, else the newest one in `root`.
"""
from __future__ import annotations

import logging
import posixpath
import re
from typing import Any, Dict, List, Optional

from . import lock
from .api import checkpointer as default_checkpointer
from .committed import read_metadata
from .errors import CheckpointError, NotACheckpointError
from .format import METADATA_FILE
from .options import NO_HOOKS, SaveHooks
from .results import SaveHandle, SaveInfo
from .storage import storage_for
from .telemetry import append_history, summary
from .tier import MemoryTier

LATEST = "latest"
log = logging.getLogger("ckpt_plugins")


class CheckpointManager:
    def __init__(self, root, keep_last: Optional[int] = None, prefix: str = "step_", checkpointer=None,
                 process_group=None, *, memory_every: Optional[int] = None, persist_every: Optional[int] = None,
                 memory_keep: int = 1, memory_dir: Optional[str] = None):
        """`memory_every=m`: steps that are multiples of m are saved to the memory tier (async: `save`
        returns the handle once the snapshot is taken); `persist_every=k`: multiples of k are also
        written to `root`, from memory; other steps are not saved. `memory_keep`: memory steps kept
        per host; `memory_dir`: this host's tier directory (default: in /dev/shm, one per root)."""
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1 (the newest committed checkpoint is always kept)")
        for name, every in (("memory_every", memory_every), ("persist_every", persist_every)):
            if every is not None and every < 1:
                raise ValueError(f"{name} must be at least 1")
        if persist_every is not None and memory_every is None:
            raise ValueError("persist_every needs the memory tier: set memory_every too")
        self.root = str(root).rstrip("/")
        self.storage = storage_for(self.root)
        self.keep_last, self.prefix = keep_last, prefix
        self.checkpointer = checkpointer or default_checkpointer(process_group)
        self._pattern = re.compile(re.escape(prefix) + r"(\d+)")
        self._protected: set = set()  # steps being loaded by this process: never deleted
        self._bases: Dict[int, Optional[str]] = {}  # committed step -> the path of its delta's base (read once)
        self.memory_every, self.persist_every = memory_every, persist_every
        self.tier = None if memory_every is None else MemoryTier(self.checkpointer, self.root, keep=memory_keep,
                                                                 directory=memory_dir)

    def name(self, step: int) -> str:
        """The step's directory: an existing one (e.g. Megatron's zero-padded iter_0001000), else
        `<prefix><step>`."""
        return self.entries().get(int(step), f"{self.prefix}{int(step)}")

    def path(self, step: int) -> str:
        return f"{self.root}/{self.name(step)}"

    def entries(self) -> Dict[int, str]:
        """Every step directory under the root (committed or not), by step."""
        found = {}
        for entry in self.storage.listdir():
            m = self._pattern.fullmatch(entry)
            if m:
                found[int(m.group(1))] = entry
        return found

    def steps(self) -> List[int]:
        """Committed steps, oldest first."""
        return sorted(s for s, entry in self.entries().items() if self.storage.exists(f"{entry}/{METADATA_FILE}"))

    def incomplete(self) -> List[str]:
        """Step directories whose save never committed."""
        return sorted(entry for s, entry in self.entries().items()
                      if not self.storage.exists(f"{entry}/{METADATA_FILE}"))

    def latest(self) -> Optional[int]:
        """The step `latest` names, when it is committed; else the newest committed step."""
        if self.storage.exists(LATEST):
            text = self.storage.read_bytes(LATEST).decode(errors="replace").strip()
            if text.isdigit() and self.storage.exists(f"{self.name(int(text))}/{METADATA_FILE}"):
                return int(text)
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Dict[str, Any], **options) -> Optional[SaveInfo]:
        """`Checkpointer.save` into `path(step)`, returning once committed; `latest` and retention
        follow its commit. With the memory tier: to memory (and `root` on persisted steps) when the
        step is due, else nothing (None)."""
        self._bases.pop(int(step), None)  # an overwrite may change what it is built on
        if self.tier is None:
            return self.checkpointer.save(self.path(step), state, step=int(step), hooks=self._hooks(step), **options)
        handle = self.save_async(step, state, **options)
        return handle.wait() if handle is not None else None

    def save_async(self, step: int, state: Dict[str, Any], **options) -> Optional[SaveHandle]:
        """`Checkpointer.save_async` into `path(step)` (see `save`); None when the memory tier's
        step is not due."""
        self._bases.pop(int(step), None)
        if self.tier is None:
            return self.checkpointer.save_async(self.path(step), state, step=int(step), hooks=self._hooks(step),
                                                **options)
        durable = self.persist_every is not None and int(step) % self.persist_every == 0
        if int(step) % self.memory_every and not durable:
            return None
        return self.tier.save_async(step, state, persist_to=storage_for(self.path(step)) if durable else None,
                                    hooks=self._hooks(step, persisted=True) if durable else NO_HOOKS, **options)

    def _hooks(self, step: int, persisted: bool = False) -> SaveHooks:
        """`latest` and retention after the commit; the run's history gets the save's figures."""
        def committed() -> None:
            self.storage.put_atomic(LATEST, str(int(step)).encode())
            self._retain(int(step))

        def history(figures: Dict[str, Any]) -> None:
            if persisted:  # the memory commit reports before the persisted copy made the root
                self.storage.prepare()
            self._append({**figures, "step": int(step), "op": "save"})

        return SaveHooks(on_commit=committed, on_summary=history)

    def load(self, state: Dict[str, Any], step: Optional[int] = None, **options):
        """Load `step` (default: latest) into `state`. With the memory tier, every rank calls it
        and they agree on the step: the newest complete in memory, else the newest in `root`
        (`result.step` and `result.source` say which)."""
        if self.tier is not None:
            return self.tier.recover(state, self.latest(), lambda s: self._load(state, s, **options), step, **options)
        step = self.latest() if step is None else int(step)
        if step is None:
            raise NotACheckpointError(f"{self.storage} holds no committed checkpoint")
        return self._load(state, step, **options)

    def _load(self, state: Dict[str, Any], step: int, **options):
        self._protected.add(step)
        try:
            result = self.checkpointer.load(self.path(step), state, **options)
        finally:
            self._protected.discard(step)
        if result.telemetry is not None and result.telemetry.rank == 0 and result.ranks:
            read = sum(r.phase("read").bytes for r in result.ranks if r.phase("read") is not None)
            self._append({**summary(result.ranks, read), "step": step, "op": "load"})
        result.step, result.source = step, "storage"
        return result

    def _append(self, row: Dict[str, Any]) -> None:
        try:
            append_history(self.storage, row)
        except OSError as exc:  # the history is never needed to load anything
            log.warning("%s: could not add step %s to the run's history: %s", self.storage, row["step"], exc)

    def _retain(self, newest: int) -> None:
        if self.keep_last is None:
            return
        steps = self.steps()
        keep = self._with_bases(set(steps[-self.keep_last:]) | {newest} | self._protected, steps)
        for step in steps:
            if step not in keep:
                self.storage.remove(self.name(step))
                self._bases.pop(step, None)

    def _with_bases(self, keep: set, steps: List[int]) -> set:
        """`keep` and every step under the root that one of them is a delta against, down the chains."""
        by_path = {posixpath.normpath(self.path(s)): s for s in steps}
        todo, keep = list(keep), set(keep)
        while todo:
            step = todo.pop()
            if step not in self._bases:  # a committed step's metadata, read once: not at every commit
                try:
                    ref = read_metadata(self.path(step)).delta
                except CheckpointError as exc:  # unreadable: nothing to follow (it is kept all the same)
                    log.warning("%s: retention could not read step %s: %s", self.storage, step, exc)
                    continue
                self._bases[step] = None if ref is None else posixpath.normpath(posixpath.join(self.path(step), ref.path))
            base = by_path.get(self._bases[step])
            if base is not None and base not in keep:
                keep.add(base)
                todo.append(base)
        return keep

    def cleanup(self) -> List[str]:
        """Remove what crashed saves left (step directories that never committed), except those a
        live save is writing (its lock). Returns the removed names."""
        removed = []
        for entry in self.incomplete():
            sub = storage_for(f"{self.root}/{entry}")
            owner = lock.holder(sub)
            if (owner is not None and lock.is_alive(owner)) or self._last_in_flight(entry):
                continue
            self.storage.remove(entry)
            removed.append(entry)
        return removed

    def _last_in_flight(self, entry: str) -> bool:
        last = getattr(self.checkpointer, "_last", None)
        return last is not None and last.path == str(storage_for(f"{self.root}/{entry}")) and not last.done()
