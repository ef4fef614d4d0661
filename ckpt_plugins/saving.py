"""One save, as an object that owns everything it takes for its whole life: its handle, target,
plan, staging slot and (on the coordinating rank) the commit and its save lock.

Steps: `prepare` (state -> fragments and objects, the lock, the plan; collective), `snapshot`
(copy into a staging slot; what training waits for), `write_and_commit` (in the background: write
the files, report to the coordinator, which commits; then every rank learns the outcome). Each
step passes failures on rather than stopping halfway, so every rank reaches the next agreement
and raises the same error. The Checkpointer decides when each step runs (sync, async, overlap).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .commit import Commit
from .coordinator import Coordinator
from .engine.write import StagedWrite, StageItem
from .errors import SaveError
from .failure import RankFailure, collect, failure_error
from .format import DATA_DIR, Metadata, ObjectMeta
from .fragment import sub_view
from .objects import encode_object
from .plan import place, specs_of
from .plan_cache import CachedPlan, PlanCache
from .results import SaveHandle
from .staging import StagingPool, StagingSlot
from .state import root_handler
from .storage import Storage

log = logging.getLogger("ckpt_plugins")


@dataclass
class WriteReport:
    """What one rank tells the coordinator after writing its files."""
    failure: Optional[RankFailure]
    checksums: List[List[int]] = field(default_factory=list)  # per tensor write item
    objects: List[Tuple[str, ObjectMeta]] = field(default_factory=list)
    sizes: Dict[str, int] = field(default_factory=dict)


@dataclass
class Outcome:
    """The coordinator's word on a save, to every rank."""
    failures: List[RankFailure]
    total_bytes: int = 0
    committed: bool = False  # failures after the commit (the on_commit step) leave it committed


class Save:
    def __init__(self, storage: Storage, state: Dict[str, Any], coord: Coordinator, pool: StagingPool,
                 cache: PlanCache, *, meta_extra: Dict[str, Any], overwrite: bool,
                 on_commit: Optional[Callable[[], None]]):
        self.storage, self.state, self.coord, self.pool, self.cache = storage, state, coord, pool, cache
        self.meta_extra, self.overwrite, self.on_commit = meta_extra, overwrite, on_commit
        self.handle = SaveHandle(str(storage))
        self.what = f"save to {storage}"
        self.commit: Optional[Commit] = None
        self.slot: Optional[StagingSlot] = None
        self.job: Optional[StagedWrite] = None
        self.cached: Optional[CachedPlan] = None
        self._copied_early = False
        self._copy_over = threading.Event()  # the snapshot has stopped using the slot

    # ------------------------------------------------------------ prepare (collective)

    def prepare(self, copy_early: bool) -> None:
        """Fragments, the lock and the plan. `copy_early`: copy with this rank's cached plan while
        the ranks agree that every cached plan still holds (an async save's stall then pays no
        agreement). Raises on every rank if any rank failed; nothing is then held."""
        t0 = time.perf_counter()
        info, coord = self.handle.info, self.coord
        coord.begin()
        before = coord.collectives
        failure, fragments, aliases, self.objects = None, [], {}, []
        try:
            items = root_handler(self.state).save_items("")
            fragments, aliases = items.fragments, items.aliases
            mine = [(kv, None) for kv in items.objects.items()] if coord.is_coordinator else []
            for (key, value), rank in mine + [(kv, coord.rank) for kv in items.per_rank.items()]:
                self.objects.append((key, *encode_object(value), rank))
            if coord.is_coordinator:
                self.commit = Commit.open(self.storage, self.overwrite)
        except Exception as exc:  # every rank must learn of it, or the others would wait forever
            failure = RankFailure.of(coord.rank, exc)
        self.fragments = fragments
        self.placed, _ = place([len(o[2]) for o in self.objects], [f"{DATA_DIR}/r{coord.rank}-objects.bin"])

        def early(cached: CachedPlan) -> None:
            self.job = self._staged(cached)
            self._copy()

        try:
            self.cached, info.plan_cached = self.cache.plan(coord, specs_of(fragments), aliases, failure, self.what,
                                                            meanwhile=early if copy_early else None)
        except BaseException:
            self.release()
            raise
        self._copied_early = self.job is not None and info.plan_cached
        if not self._copied_early:
            self._release_slot()  # copied for a plan another rank's change made stale: copy again
            self.job = self._staged(self.cached)
        info.rank_bytes, info.balance = sum(item.nbytes for item in self.job.items), self.cached.balance
        info.collectives = coord.collectives - before
        info.timings["plan"] = time.perf_counter() - t0

    def _staged(self, cached: CachedPlan) -> StagedWrite:
        frags = self.fragments
        return StagedWrite(self.storage,
                           [StageItem(w.file, w.offset, sub_view(frags[w.index].local, frags[w.index].offsets, w.box))
                            for w in cached.writes] +
                           [StageItem(f, off, o[2]) for o, (f, off) in zip(self.objects, self.placed)])

    # ------------------------------------------------------------ snapshot (training waits)

    def snapshot(self) -> None:
        """Copy this rank's bytes into a staging slot (unless done early); then training may
        change the state. A failure reaches every rank through the writes and the commit."""
        try:
            if not self._copied_early:
                self._copy()
        finally:
            self._copy_over.set()
            self.handle.snapshot_taken()

    def _copy(self) -> None:
        t = time.perf_counter()
        job = self.job
        try:
            pin = any(isinstance(i.source, torch.Tensor) and i.source.device.type == "cuda" for i in job.items)
            self.slot = self.pool.acquire(job.nbytes, pin=pin)  # may wait for an earlier save's slot
            job.snapshot(self.slot.buffer, threads=torch.get_num_threads())
        except BaseException as exc:
            job.fail(exc)
            log.error("snapshot for %s failed: %s: %s", self.storage, type(exc).__name__, exc)
        finally:
            self.handle.info.timings["snapshot"] = time.perf_counter() - t

    # ------------------------------------------------------------ write and commit (background)

    def write_and_commit(self, bg: Coordinator, threads: int) -> None:
        """Write this rank's files as the snapshot progresses, then agree on the outcome over
        `bg`; the coordinator commits when every rank succeeded. Releases everything the save
        holds, whatever happens."""
        info, job = self.handle.info, self.job
        try:
            bg.begin()
            t = time.perf_counter()
            report = WriteReport(None)
            try:
                checksums = job.write(threads)
                n = len(self.cached.writes)
                report = WriteReport(None, checksums[:n], [
                    (key, ObjectMeta(file=f, offset=off, nbytes=len(data), crc32c=crc, encoding=enc, rank=rank))
                    for (key, enc, data, rank), (f, off), crc in zip(self.objects, self.placed, checksums[n:])],
                    job.sizes)
            except Exception as exc:
                files = ", ".join(sorted(job.sizes)) or "nothing"
                report = WriteReport(RankFailure(bg.rank, type(exc).__name__, f"{exc} (writing {files})"))
            finally:
                self._copy_over.wait()  # the snapshot has taken its slot (or failed) and stopped copying
                self._release_slot()
            info.timings["write"] = time.perf_counter() - t
            t = time.perf_counter()
            reports = bg.gather(report)
            outcome = self._commit(reports) if bg.is_coordinator else None
            outcome = bg.broadcast(outcome)
            info.total_bytes = outcome.total_bytes
            info.timings["commit"] = time.perf_counter() - t
            if outcome.failures:
                then = ("It is committed, but the step after the commit failed" if outcome.committed else
                        "Nothing was committed; the previous checkpoint is still the latest")
                raise failure_error(outcome.failures, self.what, then, SaveError)
            self.handle.succeed()
        except BaseException as exc:
            error = exc if isinstance(exc, SaveError) else SaveError(f"{self.what} failed: {exc}")
            self.handle.fail(error)
            log.error("%s", error)
        finally:
            self.release()

    def _commit(self, reports: List[WriteReport]) -> Outcome:
        """On the coordinator: write the metadata if every rank succeeded."""
        failures = collect(r.failure for r in reports)
        if failures:
            return Outcome(failures)
        plan = self.cached.plan
        try:
            # Commits run one at a time on one thread, so the cached plan's entries can take this
            # save's checksums in place; objects and file sizes are this save's own.
            objects, files = {}, dict(plan.metadata.files)
            for rank, report in enumerate(reports):
                for entry, crc in zip(plan.stored[rank], report.checksums):
                    entry.crc32c = crc
                for key, entry in report.objects:
                    objects.setdefault(key, []).append(entry)
                files.update(report.sizes)
            metadata = Metadata(tensors=plan.metadata.tensors, objects=dict(sorted(objects.items())),
                                files=dict(sorted(files.items())), aliases=plan.metadata.aliases,
                                world_size=plan.metadata.world_size, chunk_bytes=plan.metadata.chunk_bytes,
                                **self.meta_extra)
            self.commit.commit(metadata)
        except Exception as exc:
            return Outcome([RankFailure.of(self.coord.rank, exc)])
        if self.on_commit is not None:
            try:
                self.on_commit()
            except Exception as exc:
                return Outcome([RankFailure.of(self.coord.rank, exc)], committed=True)
        return Outcome([], metadata.total_bytes, committed=True)

    # ------------------------------------------------------------ resources

    def _release_slot(self) -> None:
        if self.slot is not None:
            self.slot.release()
            self.slot = None

    def release(self) -> None:
        """Give back the staging slot and the save lock (each once)."""
        self._release_slot()
        if self.commit is not None:
            self.commit.close()
