"""One save, as an object that owns everything it takes for its whole life: its handle, target,
plan, staging slot and (on the coordinating rank) the commit and its save lock.

Steps: `capture` (state -> `Contents`, in the caller's thread), `prepare` (the lock, the plan;
collective), `snapshot` (copy into a staging slot; what training waits for), `write_and_commit`
(in the background: write the files, report to the coordinator, which commits; then every rank
learns the outcome). Each step passes failures on rather than stopping halfway, so every rank
reaches the next agreement and raises the same error. The Checkpointer decides when each step
runs (sync, async, overlap).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Union

import torch

from . import codec, delta
from .base_ref import leave_to_base
from .casts import masters_cast_exactly
from .commit import Commit, generation_file
from .coordinator import Coordinator
from .engine.write import StagedWrite, StageItem
from .errors import CheckpointError, SaveError
from .failure import RankFailure, collect, failure_error
from .format import DATA_DIR, DeltaRef, Metadata, ObjectMeta, StoredItem
from .fragment import Fragment, sub_view
from .objects import Encoded, encode_object
from .options import SaveHooks, SaveOptions
from .plan import specs_of
from .save_plan import Placement, place
from .plan_cache import CachedPlan, PlanCache, Structure
from .results import SaveHandle
from .staging import StagingPool, StagingSlot
from .state import root_handler
from .storage import Storage
from .telemetry import TELEMETRY_FILE, RankTelemetry, Recorder, backend_of, checkpoint_file, summary

log = logging.getLogger("ckpt_plugins")


class SavedObject(NamedTuple):
    """An object of the state as this rank stores it (`rank` None: replicated, stored once)."""
    key: str
    encoded: Encoded
    rank: Optional[int]


@dataclass
class WriteReport:
    """What one rank tells the coordinator after writing its files."""
    failure: Optional[RankFailure]
    written: List[StoredItem] = field(default_factory=list)  # per tensor write item: where it went
    objects: Dict[str, ObjectMeta] = field(default_factory=dict)
    sizes: Dict[str, int] = field(default_factory=dict)
    telemetry: Optional[RankTelemetry] = None  # this rank's phases so far (rides on the commit's gather)


@dataclass
class Outcome:
    """The coordinator's word on a save, to every rank."""
    failures: List[RankFailure]
    total_bytes: int = 0
    committed: bool = False  # failures after the commit (the on_commit step) leave it committed


@dataclass
class Contents:
    """One rank's part of a save as data: its fragments, the aliases of tied tensors, and its
    objects, encoded (replicated ones are written by one holder each, as the plan says; per-rank
    ones by their rank). Collected in the caller's thread, the only one that may read a framework's
    state."""
    rank: int = 0
    fragments: List[Fragment] = field(default_factory=list)
    aliases: Dict[str, str] = field(default_factory=dict)
    replicated: Dict[str, Encoded] = field(default_factory=dict)
    per_rank: Dict[str, Encoded] = field(default_factory=dict)
    casts: bool = False  # the weights are the masters' cast (`casts.masters_cast_exactly`)

    @classmethod
    def of(cls, state: Dict[str, Any], base, storage: Optional[Storage], rank: int) -> "Contents":
        items = root_handler(state).save_items("")
        if base is not None:
            leave_to_base(items, base, storage)
        return cls(rank, items.fragments, items.aliases, {k: encode_object(v) for k, v in items.objects.items()},
                   {k: encode_object(v) for k, v in items.per_rank.items()})

    def check_casts(self) -> None:
        """Whether the weights are their masters' cast, from the live tensors: in the caller's
        thread, or in an overlapped save's snapshot thread, which runs while training leaves them
        alone (until the optimizer's next step)."""
        self.casts = masters_cast_exactly(self.fragments)

    @property
    def structure(self) -> Structure:
        return Structure(specs_of(self.fragments), self.aliases, sorted(self.replicated), self.casts)

    def objects(self, replicated: List[str]) -> List[SavedObject]:
        """The objects this rank writes, the plan's `replicated` ones among them."""
        return ([SavedObject(k, self.replicated[k], None) for k in replicated] +
                [SavedObject(k, e, self.rank) for k, e in self.per_rank.items()])

    def staged(self, storage: Optional[Storage], cached: CachedPlan, compress: Union[bool, str] = False,
               base: Optional[delta.Base] = None) -> "Staged":
        """What this rank writes, as views of the live fragments and the encoded objects; with a
        delta's `base`, each box it holds alike as a delta against it (when its chunks are the
        plan's: chunks XOR with chunks of the same bytes; else the save stores everything)."""
        frags, objects = self.fragments, self.objects(cached.objects)
        if base is not None and base.metadata.chunk_bytes != cached.chunk:
            log.info("%s: its base %s has chunks of %d bytes, this save %d; storing everything instead", storage,
                     base.storage, base.metadata.chunk_bytes, cached.chunk)
            base = None
        placed, _ = place([len(o.encoded.data) for o in objects], [f"{DATA_DIR}/r{self.rank}-objects.bin"])

        def item(w) -> StageItem:
            frag = frags[w.index]
            view = sub_view(frag.local, frag.offsets, w.box)
            found = None if base is None else base.box(frag.key, *w.box, view.numel() * view.element_size())
            return StageItem(w.file, w.offset, view, None if found is None else functools.partial(base.chunk, frag.key, found))

        job = StagedWrite(storage, [item(w) for w in cached.writes] +
                          [StageItem(at.file, at.offset, o.encoded.data) for o, at in zip(objects, placed)],
                          compress=compress, chunk=cached.chunk)
        return Staged(job, objects, placed)


@dataclass
class Staged:
    """A rank's write job for one plan, and the objects it writes and where."""
    job: StagedWrite
    objects: List[SavedObject]
    placed: List[Placement]


class Save:
    def __init__(self, storage: Storage, state: Dict[str, Any], coord: Coordinator, pool: StagingPool,
                 cache: PlanCache, options: SaveOptions, hooks: SaveHooks, *, mode: str, telemetry: bool = True):
        self.storage, self.state, self.coord, self.pool, self.cache = storage, state, coord, pool, cache
        self.options, self.hooks = options, hooks
        self.handle = SaveHandle(str(storage))
        self.what = f"save to {storage}"
        self.contents = Contents(coord.rank)
        self._failure: Optional[RankFailure] = None  # capture's, passed on by the plan's agreement
        self.commit: Optional[Commit] = None
        self.slot: Optional[StagingSlot] = None
        self.staged: Optional[Staged] = None
        self.job: Optional[StagedWrite] = None
        self.cached: Optional[CachedPlan] = None
        self._copied_early = False
        self.generation = 0  # the coordinator's choice of file names, agreed with the plan
        self.base: Optional[delta.Base] = None  # a delta save's base, and what the metadata records of it
        self.delta: Optional[DeltaRef] = None
        self._copy_over = threading.Event()  # the snapshot has stopped using the slot
        self.recorder = Recorder("save", backend_of(storage), coord.rank, enabled=telemetry)
        self.recorder.record.info.update(mode=mode, path=str(storage), step=options.step)

    # ------------------------------------------------------------ prepare (collective)

    def capture(self) -> None:
        """The state as `Contents`, in the caller's thread (the only one that may read a
        framework's state); a failure waits for the plan's agreement, which every rank must learn
        it from."""
        self._t0 = time.time()
        try:
            self.contents = Contents.of(self.state, self.options.base, self.storage, self.coord.rank)
        except Exception as exc:
            self._failure = RankFailure.of(self.coord.rank, exc)

    def prepare(self, copy_early: bool) -> None:
        """The cast check, the lock and the plan, after `capture`: in the caller's thread, or in an
        overlapped save's snapshot thread (nothing here calls into the framework; the cast check
        reads the captured tensors, as the snapshot does). `copy_early`: copy with this
        rank's cached plan while the ranks agree that every cached plan still holds (an async
        save's stall then pays no agreement). Raises on every rank if any rank failed; nothing is
        then held."""
        coord = self.coord
        coord.begin()
        self._collectives_before = coord.collectives
        failure = self._failure
        if failure is None:
            try:  # a failure is passed on by the plan's agreement: every rank must learn of it
                self.contents.check_casts()
                if self.options.compress or self.options.delta_from is not None:
                    codec.zstd()  # missing, it fails the save here, every rank told, before any write
                if self.options.delta_from is not None:
                    self.base, self.delta = delta.start(self.storage, self.options.delta_from, self.options.max_chain)
                if coord.is_coordinator:
                    with self.recorder.phase("lock"):
                        self.commit = Commit.open(self.storage, self.options.overwrite)
            except Exception as exc:
                failure = RankFailure.of(coord.rank, exc)
        self._plan(failure, copy_early)

    def _plan(self, failure: Optional[RankFailure], copy_early: bool) -> None:
        """Agree on the plan (collective; cached while the fragments' structure holds)."""
        info, coord, contents = self.handle.info, self.coord, self.contents

        def early(cached: CachedPlan) -> None:
            self.staged = contents.staged(self.storage, cached, self.options.compress, self.base)
            self.job = self.staged.job
            if self.pool.fits(self.job.nbytes):  # a save streaming through the pool copies beside its writes
                self._copy()

        try:
            agreed = self.cache.plan(coord, contents.structure, failure, self.what,
                                     generation=self.commit.generation if self.commit is not None else 0,
                                     target=self.storage.identity, meanwhile=early if copy_early else None)
            self.cached, info.plan_cached, self.generation = agreed.plan, agreed.cached, agreed.generation
        except CheckpointError as exc:  # every failed save is a SaveError (a lost rank's PeerLost inside)
            self.release()
            if isinstance(exc, SaveError):
                raise
            raise self._error(exc) from exc
        except BaseException:
            self.release()
            raise
        self._copied_early = self.slot is not None and info.plan_cached
        if not self._copied_early:
            self._release_slot()  # copied for a plan another rank's change made stale: copy again
            self.staged = contents.staged(self.storage, self.cached, self.options.compress, self.base)
            self.job = self.staged.job
        self.job.stored_as = functools.partial(generation_file, generation=self.generation)
        info.rank_bytes, info.balance = sum(item.nbytes for item in self.job.items), self.cached.balance
        info.collectives = coord.collectives - self._collectives_before
        end = time.time()
        copying = self.recorder.record.phase("snapshot") if self._copied_early else None
        self.recorder.add("plan", self._t0, end, busy=end - self._t0 - (copying.wall if copying else 0.0),
                          cached=info.plan_cached)

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

    def planned_snapshot(self, write: Callable[[], Any]) -> None:
        """An overlapped save's thread, beside the next forward and backward: `prepare`, then
        `write()` (which queues the writes and the commit), then the snapshot. A failed plan fails
        the handle: every rank's `wait()` raises it."""
        try:
            self.prepare(copy_early=False)
        except BaseException as exc:
            self.handle.fail(exc)
            log.error("%s", exc)
            return
        write()
        self.snapshot()

    def _copy(self) -> None:
        job = self.job
        try:
            t = time.time()  # may wait for an earlier save's slot, or allocate and touch one
            self.slot = self.pool.acquire(job.nbytes, pin=job.pinned)
            self.recorder.add("staging", t, time.time(), self.slot.fresh_bytes)
            with self.recorder.phase("snapshot", sum(i.nbytes for i in job.items)):
                job.snapshot(self.slot.buffer, threads=torch.get_num_threads())
        except BaseException as exc:
            job.fail(exc)
            log.error("snapshot for %s failed: %s: %s", self.storage, type(exc).__name__, exc)

    # ------------------------------------------------------------ write and commit (background)

    def write_and_commit(self, bg: Coordinator) -> None:
        """Write this rank's files as the snapshot progresses, then agree on the outcome over
        `bg`; the coordinator commits when every rank succeeded. Releases everything the save
        holds, whatever happens."""
        error: Optional[BaseException] = None
        try:
            bg.begin()
            report = self._write(bg)
            self._agree(bg, report)
            if self.hooks.then is not None:
                self.hooks.then(bg, self.handle.info)
        except BaseException as exc:
            error = exc if isinstance(exc, SaveError) else self._error(exc)
        finally:
            self.release()  # before the save counts as done: the next save to this path takes the lock
        if error is None:
            self.handle.succeed()
        else:
            self.handle.fail(error)
            log.error("%s", error)

    def _error(self, exc: BaseException) -> SaveError:
        """`exc` as the save's error, keeping what it says failed where (a lost rank's PeerLost:
        `error.failures` lets a caller tell that the job cannot go on)."""
        error = SaveError(f"{self.what} failed: {exc}")
        error.__cause__ = exc
        error.failures = list(getattr(exc, "failures", []))
        return error

    def _write(self, bg: Coordinator) -> WriteReport:
        """Write this rank's files; what it tells the coordinator (a failure too)."""
        job, info = self.job, self.handle.info
        try:
            result = job.write(self.recorder)
            n = len(self.cached.writes)
            info.files = {job.stored_as(name): size for name, size in result.sizes.items()}
            return WriteReport(None, result.items[:n], {
                key: ObjectMeta(file=at.file, offset=out.offset, nbytes=len(data), crc32c=out.crc32c, encoding=enc,
                                rank=rank)
                for (key, (enc, data), rank), at, out in zip(self.staged.objects, self.staged.placed,
                                                             result.items[n:])}, result.sizes)
        except Exception as exc:
            failure = RankFailure.of(bg.rank, exc)
            files = ", ".join(sorted(job.sizes)) or "nothing"
            return WriteReport(dataclasses.replace(failure, message=f"{failure.message} (writing {files})"))
        finally:
            self._copy_over.wait()  # the snapshot has taken its slot (or failed) and stopped copying
            self._release_slot()

    def _agree(self, bg: Coordinator, report: WriteReport) -> None:
        """Every rank's report to the coordinator, which commits; its outcome to every rank (raised
        as one SaveError on each when any rank failed)."""
        info, recorder = self.handle.info, self.recorder
        t = time.time()
        report.telemetry = recorder.finish()
        reports = bg.gather(report)
        outcome = bg.broadcast(self._commit(reports, t) if bg.is_coordinator else None)
        if not bg.is_coordinator:  # the coordinator's wait was recorded before it kept the telemetry
            recorder.add("commit_wait", t, time.time())
        info.total_bytes = outcome.total_bytes
        info.telemetry = recorder.finish()
        info.ranks = [r.telemetry for r in reports] if bg.is_coordinator else [info.telemetry]
        info.timings.update({p.name: p.wall for p in info.telemetry.phases})
        if outcome.failures:
            then = ("It is committed, but the step after the commit failed" if outcome.committed else
                    "Nothing was committed; the previous checkpoint is still the latest")
            raise failure_error(outcome.failures, self.what, then, SaveError)

    def _commit(self, reports: List[WriteReport], waited_since: float) -> Outcome:
        """On the coordinator: write the metadata if every rank succeeded; then the telemetry of
        every rank beside it (never needed to load: a failure there only logs)."""
        failures = collect(r.failure for r in reports)
        if failures:
            return Outcome(failures)
        plan = self.cached.plan
        try:
            # Commits run one at a time on one thread, so the cached plan's entries can take this
            # save's checksums (and a compressed one's places) in place; objects and file sizes are
            # this save's own.
            objects, files, deltas = {}, dict(plan.metadata.files), False
            for rank, report in enumerate(reports):
                for entry, out in zip(plan.stored[rank], report.written):
                    entry.offset, entry.crc32c, entry.group, entry.packed = out.offset, out.crc32c, out.group, out.packed
                    entry.delta = out.delta
                    deltas = deltas or out.delta
                for key, entry in report.objects.items():
                    objects.setdefault(key, []).append(entry)
                files.update(report.sizes)
            metadata = Metadata(tensors=plan.metadata.tensors, objects=dict(sorted(objects.items())),
                                files=dict(sorted(files.items())), aliases=plan.metadata.aliases,
                                casts=plan.metadata.casts, world_size=plan.metadata.world_size,
                                delta=self.delta if deltas else None,
                                chunk_bytes=plan.metadata.chunk_bytes,
                                **self.options.recorded)
            with self.recorder.phase("metadata_write"):
                self.commit.commit(metadata)
        except Exception as exc:
            return Outcome([RankFailure.of(self.coord.rank, exc)])
        self.recorder.add("commit_wait", waited_since, time.time())
        reports[0].telemetry = self.recorder.finish()
        self._keep_telemetry([r.telemetry for r in reports], metadata.total_bytes)
        if self.hooks.on_commit is not None:
            try:
                self.hooks.on_commit()
            except Exception as exc:
                return Outcome([RankFailure.of(self.coord.rank, exc)], committed=True)
        return Outcome([], metadata.total_bytes, committed=True)

    def _keep_telemetry(self, ranks: List[RankTelemetry], total_bytes: int) -> None:
        """Every rank's records beside the checkpoint, and the summary to `on_summary` (a run's
        history); neither is needed to load, so a failure here only logs."""
        if not self.recorder.enabled:
            return
        figures = summary(ranks, total_bytes)
        try:
            self.storage.put_atomic(TELEMETRY_FILE, checkpoint_file(
                ranks, "save", str(self.storage), self.options.step, {"summary": figures}))
            if self.hooks.on_summary is not None:
                self.hooks.on_summary(figures)
        except Exception as exc:
            log.warning("%s: the save committed, but its telemetry could not be kept: %s: %s",
                        self.storage, type(exc).__name__, exc)

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
