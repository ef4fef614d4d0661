"""One load: agree on what to read, read it (once per stored range across the ranks), finish.

Two agreements carry every rank's failure: after the metadata, the handlers and the load plan
(nothing has been touched yet), and after the data, the objects and the handlers' finish steps.
Between them each rank keeps every promise of the read-once exchange even when its own part
failed, so every rank reaches the second agreement and raises the same error; and no rank starts
the handlers' finish steps, which may run the framework's collectives, once any rank has failed
(`Coordinator.agreed_steps`).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import numpy as np

from . import delta, shm
from .base_ref import BASE, reference, resolve
from .committed import read_object
from .coordinator import Coordinator
from .engine.exchange import ReadWork, read_items
from .foreign.view import ForeignMetadata, transformed
from .format import stored_entries
from .host_share import HostMetadata
from .fragment import Fragment
from .gcpause import gc_paused
from .errors import CheckpointError, LoadMismatchError
from .plan import LoadPlan, ReadItem, candidate_keys, plan_load, resolve_key, specs_of
from .load_request import ShareRequests, LoadRequest, LoadRequests, key_runs
from .packing import Joined
from .runs import RunGroups, runs_of
from .read_once import RankReads, StoredItem, Transfer, assign_transfers, read_request
from .results import LoadResult
from .state import LoadItems, root_handler
from .storage import Storage
from .telemetry import Recorder, backend_of
from .verify import Filled, check_live, filled

log = logging.getLogger("ckpt_plugins")


# Below this many read requests in all (its own, times the ranks), a rank sends its whole list with
# the rest of its request: one all-gather, where sending its runs first would cost a second.
INLINE_READS = 1 << 16


class Load:
    def __init__(self, storage: Storage, state: Dict[str, Any], coord: Coordinator, *, strict: bool,
                 read_threads: int, shared_memory: bool, telemetry: bool = True, verify: bool = False):
        self.storage, self.state, self.coord, self.strict, self.verify = storage, state, coord, strict, verify
        self.read_threads, self.shared_memory = read_threads, shared_memory
        self.what = f"load of {storage}"
        self.items: Optional[LoadItems] = None
        self.targets: List[Fragment] = []  # the handlers' destinations (a transform's fills one in a finish step)
        self.transforms = 0  # the first finish steps: the transforms'
        self.loaded: List[Filled] = []  # verify: what landed in them
        self.metadata, self.plan, self.before = None, None, 0
        self.request: Optional[LoadRequest] = None  # this rank's
        self.requests: Optional[LoadRequests] = None  # every rank's
        self.files: List[str] = []  # the checkpoint's file table, which read requests index
        self.keys: Optional[StoredKeys] = None  # its stored keys, which `LoadRequest.wanted` numbers
        self.reads = RankReads.of([], {})  # this rank's read requests, for the read-once assignment
        self.runs: Optional[RunGroups] = None  # every rank's request runs
        self.sent_reads = self.reads  # every rank's `reads_share`, one after the other
        self.shared = HostMetadata(storage)
        self.recorder = Recorder("load", backend_of(storage), coord.rank, enabled=telemetry)
        self.recorder.record.info["path"] = str(storage)

    def check(self, result: LoadResult) -> None:
        if self.strict and (result.missing_keys or result.unexpected_keys):
            report = _key_report(result)
            source = getattr(self.metadata, "source", "")
            if source and result.missing_keys:  # a model-only format into a job with more state
                held = ", ".join(sorted(stored_entries(self.metadata) - set(getattr(self.metadata, "descriptive", ()))))
                report += (f" The checkpoint is {source}, read in place; it holds {held} only: load those entries "
                           f"(e.g. {{'model': model}}), or use strict=False")
            raise LoadMismatchError(report)

    def prepare(self) -> LoadResult:
        """Metadata, handlers and the load plan on every rank, agreed; nothing touched yet. The
        result names the keys missing from the checkpoint and those nothing wanted."""
        coord, recorder = self.coord, self.recorder
        coord.begin()
        self.before = coord.collectives
        planned = []
        t0 = time.time()
        try:
            sent = coord.agreed_bytes(lambda: self._request(planned).packed(), what=self.what,
                                      then="Nothing was loaded")
        finally:  # every rank has read the metadata by now
            self.shared.release()
        self.requests = requests = LoadRequests.of(Joined.gathered(sent, coord.world_size, "a load request"))
        if len(requests.paths) > 1:  # every rank sees all of them: every rank raises this
            raise CheckpointError(f"{self.what} failed: the ranks of one load passed different paths "
                                  f"({', '.join(requests.paths)}); every rank must load the same checkpoint. "
                                  "Nothing was loaded")
        self.runs = requests.runs
        if requests.reads is not None:
            self.sent_reads, keys = requests.reads.take(self.runs.share_positions()), requests.used
        else:
            sent = coord.agreed_bytes(lambda: ShareRequests.mine(self.request, self.reads, requests, coord.rank).packed(),
                                      what=self.what, then="Nothing was loaded")
            shares = ShareRequests.of(Joined.gathered(sent, coord.world_size, "read requests"), requests)
            self.sent_reads, keys = shares.reads, shares.keys
        recorder.add("agree", planned[0] if planned else t0, time.time())
        return LoadResult(missing_keys=requests.missing, unexpected_keys=self.keys.unused(keys))

    def _request(self, planned: list) -> LoadRequest:
        """This rank's metadata, handlers' items and load plan, as what it tells the others
        (`planned` gets the time it was done)."""
        recorder = self.recorder
        self.request = request = LoadRequest(host=shm.host_key(), path=self.storage.identity)
        with recorder.phase("metadata"):
            self.metadata = metadata = self.shared.read()
            self.base = delta.opened(self.storage, metadata)  # a delta's base, there and unchanged
        t = time.time()
        self.items = items = root_handler(self.state).load_items("", metadata)
        self.targets, steps = items.fragments, len(items.finish)
        items.fragments = transformed(metadata, items.fragments, items.finish)
        self.transforms = len(items.finish) - steps
        found = [k for check in items.checks for k in check(lambda key: read_object(self.storage, metadata, key, None))
                 or ()]
        specs = specs_of(items.fragments)
        self.plan = plan = plan_load(metadata, specs)
        # every stored candidate of a wanted tensor counts as used: a bf16 weight is not left
        # over when its fp32 master filled the model
        wanted = ({resolve_key(metadata, k) for s in specs for k in candidate_keys(s)}
                  | {s.key for s in specs} | set(items.objects) | set(items.per_rank) | items.accepted)
        self.keys = StoredKeys.of(metadata)
        request.wanted = self.keys.of_keys(wanted)
        request.key_runs = key_runs(self.keys.names, request.wanted)
        request.missing = plan.missing + [k for k in items.objects if k not in metadata.objects] + found
        reads = [read_request(r) for r in plan.reads]
        request.runs = runs_of([r.key for r in plan.reads], reads)
        self.files, numbers = file_table(metadata)
        self.reads = RankReads.of(reads, numbers)
        if len(reads) * self.coord.world_size <= INLINE_READS:
            request.reads = self.reads
        planned.append(time.time())
        recorder.add("plan", t, planned[0])
        return request

    def execute(self, result: LoadResult) -> LoadResult:
        """The data, the objects and the handlers' finish steps; agreed again. With `verify`, the
        live state is then compared with what landed (`verify`), agreed once more: a save's
        description of the state may run collectives, so every rank must reach it."""
        coord, recorder, plan, metadata = self.coord, self.recorder, self.plan, self.metadata

        def finished():
            recorder.record.info["checkpoint_bytes"] = metadata.total_bytes
            result.telemetry = recorder.finish()

        def data():
            result.read_bytes = self._read(plan, metadata, self.requests.hosts)
            if isinstance(metadata, ForeignMetadata):
                result.unverified_bytes = result.read_bytes
            with recorder.phase("objects"):
                self._objects(metadata, result)
            with recorder.phase("finish"):
                for finish in self.items.finish[:self.transforms]:
                    finish()
            if self.verify:  # before the handlers' finish steps, which must not change what landed
                with recorder.phase("verify"):
                    missing = set(plan.missing)
                    self.loaded = filled([f for f in self.targets if f.key not in missing and not f.recomputed],
                                         metadata)

        def handlers():  # may run the framework's collectives: only once every rank's data is in
            with recorder.phase("finish"):
                for finish in self.items.finish[self.transforms:]:
                    finish()
            if not self.verify:
                finished()

        def compare():
            with recorder.phase("verify"):
                result.verified_bytes = check_live(self.loaded, root_handler(self.state).save_items("").fragments,
                                                   coord.rank)
            finished()

        touched = self._touched(plan)
        coord.agreed_steps([data, handlers], what=self.what, then=f"On rank {coord.rank}, " + (
            f"these tensors may hold partly loaded data: {_shown(touched)}" if touched else "no tensor was written"))
        if self.verify:
            coord.agreed(compare, what=f"verification of the {self.what}",
                         then="The live state differs from the checkpoint there: do not train on it")
        # every rank's record on the coordinating rank alone, as a save's: at 100,000 ranks each
        # rank would otherwise receive and unpickle every rank's
        result.ranks = coord.gather(result.telemetry) or [result.telemetry]
        result.collectives = coord.collectives - self.before
        return result

    def _read(self, plan: LoadPlan, metadata, hosts: List[Optional[str]]) -> int:
        coord = self.coord
        readers = self.storage.readers if self.storage.restricted else None
        assignment = assign_transfers(self.sent_reads, self.runs, self.files, coord.rank, readers=readers)
        shared = assignment.transfers
        mine = {StoredItem(r.stored.file, r.stored.offset) for r in plan.reads}
        reads = plan.reads + _passed_on(metadata, shared, mine, coord.rank)
        transfers = {i: t for i, r in enumerate(reads)
                     for t in [shared.get(StoredItem(r.stored.file, r.stored.offset))] if t is not None}
        named = [h for h in hosts if h is not None]
        if not (assignment.shared and self.shared_memory and len(set(named)) < len(named)):  # some host holds two
            hosts = None
        work = ReadWork(reads, self.items.fragments, {r.key: metadata.tensors[r.key].dtype for r in reads},
                        metadata.chunk_bytes, transfers, hosts, self.base)
        return read_items(self.storage, work, coord, self.storage.read_parallelism(self.read_threads), self.recorder)

    def _objects(self, metadata, result: LoadResult) -> None:
        for key, setter in self.items.objects.items():
            if key in metadata.objects:
                setter(read_object(self.storage, metadata, key, None))
        for key, setter in self.items.per_rank.items():
            if any(o.rank == self.coord.rank for o in metadata.objects.get(key, [])):
                setter(read_object(self.storage, metadata, key, self.coord.rank))
            else:
                result.kept_per_rank.append(key)
                log.warning("%s: the checkpoint has no value saved by rank %d; keeping the current one",
                            key, self.coord.rank)

    def _touched(self, plan: LoadPlan) -> List[str]:
        """Keys of this rank's live tensors the data phase may have written."""
        frags = self.items.fragments
        return sorted({frags[c.target].key for r in plan.reads for c in r.copies})


@gc_paused  # its many small objects (fragments, plans) die with it: a collection then would scan a job's whole heap
def load(storage: Storage, state: Dict[str, Any], coord: Coordinator, *, strict: bool, **options) -> LoadResult:
    """Load a checkpoint into `state` in place, following its base reference (`base_ref`) when it
    has one: the base's tensors for the state entries the checkpoint left to it, then its own; the
    keys of both are checked before any data moves. On any rank's failure every rank raises it,
    and the state the load created (optimizer moments) is dropped."""
    main = Load(storage, state, coord, strict=strict, **options)
    loads = [main]
    with undone_on_failure(loads):
        result = main.prepare()
        if BASE not in main.metadata.objects:
            main.check(result)
            return main.execute(result)
        def follow():
            ref = reference(read_object(storage, main.metadata, BASE, None))
            return ref, resolve(storage, ref)

        ref, base_storage = coord.agreed(follow, what=main.what, then="Nothing was loaded")[coord.rank]
        entries = sorted({k.split("/")[0] for k in ref.keys})
        base = Load(base_storage, {e: state[e] for e in entries if e in state}, coord, strict=False, **options)
        loads.append(base)
        below = base.prepare()
        leftover = set(below.missing_keys)
        result.missing_keys = [k for k in result.missing_keys if k in leftover or k.split("/")[0] not in entries]
        result.unexpected_keys = sorted([k for k in result.unexpected_keys if k != BASE] +
                                        [k for k in below.unexpected_keys if k.split("/")[0] in entries])
        main.check(result)
        read = base.execute(below).read_bytes
        result = main.execute(result)
        result.read_bytes += read
        return result


@contextlib.contextmanager
def undone_on_failure(loads: List["Load"]):
    """On any failure, drop the state the loads created (optimizer moments) and stale segments."""
    try:
        yield
    except BaseException:
        for load in loads:
            for undo in load.items.undo if load.items is not None else []:
                undo()
        shm.remove_stale()  # a reader that was killed left its segment
        raise


def file_table(metadata) -> Tuple[List[str], Mapping[str, int]]:
    """The checkpoint's file table, which read requests index, and the number of each file its
    tensors' boxes lie in: the decoded table's own, where it keeps them, of the files of the
    boxes built so far (a load's reads')."""
    numbers = getattr(metadata.tensors, "file_numbers", None)
    if numbers is not None:
        return numbers()
    files = list(metadata.files)
    return files, dict(zip(files, range(len(files))))


@dataclass
class StoredKeys:
    """The keys a load may leave unused, numbered alike on every rank, which read the same
    metadata: its tensors' in its order, then its objects' and aliases' (`LoadRequest.wanted`
    holds numbers into `names`)."""
    names: List[str]
    numbers: Mapping[str, int]  # the tensors': the tensor table's own index where it keeps one
    others: Dict[str, int]
    descriptive: Set[str]  # stored, but never reported unused

    @classmethod
    def of(cls, metadata) -> "StoredKeys":
        tensors = metadata.tensors
        positions = getattr(tensors, "positions", None)
        names, numbers = positions() if positions else (list(tensors), dict(zip(tensors, range(len(tensors)))))
        others = [k for k in dict.fromkeys(itertools.chain(metadata.objects, metadata.aliases)) if k not in numbers]
        return cls(names + others, numbers, dict(zip(others, range(len(names), len(names) + len(others)))),
                   set(getattr(metadata, "descriptive", ())))

    def of_keys(self, keys) -> np.ndarray:
        """The numbers of those of `keys` stored, sorted (int32)."""
        found = (n for k in keys for n in [self.numbers.get(k, self.others.get(k))] if n is not None)
        return np.array(sorted(found), dtype=np.int32)

    def unused(self, used: np.ndarray) -> List[str]:
        """Those no rank used (`used`: the numbers every rank sent, repeated), sorted."""
        hit = np.zeros(len(self.names), dtype=bool)
        hit[used] = True
        return sorted(k for k in itertools.compress(self.names, (~hit).tolist()) if k not in self.descriptive)


def _passed_on(metadata, shared: Dict[StoredItem, Transfer], mine: set, rank: int) -> List[ReadItem]:
    """Reads this rank makes only to pass the bytes on: stored items that no rank needing them
    can read (see `Storage.readers`); they feed no copy here."""
    wanted = {item: t for item, t in shared.items() if t.reader == rank and item not in mine}
    if not wanted:
        return []
    return [ReadItem(key, box, t.start, t.end) for key, meta in metadata.tensors.items() for box in meta.boxes
            for t in [wanted.get((box.file, box.offset))] if t is not None]


def _shown(keys: List[str]) -> str:
    return ", ".join(keys[:10]) + (f", ... ({len(keys)} in all)" if len(keys) > 10 else "")


def _key_report(result: LoadResult) -> str:
    parts = []
    for what, keys in (("missing from the checkpoint", result.missing_keys),
                       ("in the checkpoint but not in the state", result.unexpected_keys)):
        if keys:
            parts.append(f"keys {what}: {_shown(keys)}")
    return "; ".join(parts) + ". Pass strict=False to load the rest and get these back."
