"""The save plan, cached across saves: while every rank's fragment structure is unchanged, a save
costs one all-reduce of two flags (stale? failed?) instead of gathering specs and scattering a
new plan. A new plan gathers each distinct run of specs once: the ranks send their runs'
digests, and the holders of each run its specs in equal shares, as columns (`spec_table`:
data-parallel replicas send their weights' specs once between them); each rank gets its writes
back as columns too (`SavePlan.packed`)."""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .coordinator import Coordinator
from .errors import SaveError
from .failure import RankFailure, failure_error
from .format import CHUNK_BYTES
from .plan import TensorSpec
from .packing import Joined
from .save_plan import SavePlan, WriteItem, assign_objects, plan_save, spec_runs, writes_of
from .save_request import PlanRequest, PlanRequests, joined_runs, runs_message, shares_asked, stretches_asked
from .spec_table import packed_specs


@dataclass
class Structure:
    """What one rank's save is made of, for planning: its tensors' specs, the aliases of tied
    tensors, the keys of the replicated objects it holds (each is written by one holder), and
    whether its weights are its fp32 masters' cast (`casts.masters_cast_exactly`)."""
    specs: List[TensorSpec]
    aliases: Dict[str, str]
    objects: List[str]
    casts: bool = False


@dataclass
class CachedPlan:
    key: bytes
    writes: List[WriteItem]  # this rank's
    objects: List[str]  # the replicated objects this rank writes
    plan: Optional[SavePlan]  # the coordinator's global plan (None elsewhere)
    balance: float
    chunk: int = CHUNK_BYTES  # the checkpoint's checksum chunk (`format.chunk_bytes_for`)


@dataclass
class Agreed:
    """What the ranks agreed on for one save: this rank's plan, whether it was the cached one, and
    the file generation the coordinator chose (see `commit.generation_file`)."""
    plan: CachedPlan
    cached: bool
    generation: int


@dataclass
class PlanReply:
    """The coordinator's answer to one rank's request."""
    failure: Optional[RankFailure]
    writes: bytes  # `SavePlan.packed`
    objects: List[str] = field(default_factory=list)
    balance: float = 1.0
    chunk: int = CHUNK_BYTES


class PlanCache:
    def __init__(self, files_per_rank: int):
        self.files_per_rank = files_per_rank
        self.cached: Optional[CachedPlan] = None

    def plan(self, coord: Coordinator, structure: Structure, failure: Optional[RankFailure], what: str, *,
             generation: int = 0, target: str = "", meanwhile: Optional[Callable[[CachedPlan], None]] = None) -> Agreed:
        """This rank's plan, agreed. Every rank's `failure` reaches every rank as one SaveError,
        and so does a `target` (the path saved to) that differs between ranks. `generation`: the
        coordinator's choice of file names (others pass 0); it rides on the same all-reduce, as
        the target's digest does. `meanwhile(cached)` runs while the ranks agree, when this
        rank's own cached plan holds (the caller may start copying with it)."""
        runs = spec_runs(structure.specs)
        key = hashlib.sha256(pickle.dumps((runs, sorted(structure.aliases.items()), sorted(structure.objects),
                                           structure.casts, self.files_per_rank))).digest()
        stale = self.cached is None or self.cached.key != key
        run = None
        if meanwhile is not None and not stale and failure is None:
            run = lambda: meanwhile(self.cached)  # noqa: E731
        digest = int.from_bytes(hashlib.sha256(target.encode()).digest()[:8], "little") >> 2
        any_stale, any_failed, generation, most, least = coord.any_flags(
            [int(stale), int(failure is not None), generation, digest, -digest], meanwhile=run)
        then = "Nothing was saved"
        if most != -least and failure is None:  # max != min: the ranks name different paths
            failure = RankFailure.of(coord.rank, SaveError(
                f"the ranks of one save passed different paths (this rank: {target}); every rank must save to "
                "the same path"))
        if any_failed or most != -least:
            coord.agree(failure, what=what, then=then, default=SaveError)
        if not any_stale:
            return Agreed(self.cached, True, generation)
        digests = coord.gather_bytes(runs_message(runs))
        groups, answers, error = None, None, None
        if coord.is_coordinator:
            try:
                groups = joined_runs(Joined.gathered(digests, coord.world_size, "run digests"))
                answers = shares_asked(groups)
            except Exception as exc:  # every rank asked for nothing, then told
                answers, error = [b""] * coord.world_size, exc
        gathered = coord.gather_bytes(_request(structure, stretches_asked(coord.scatter(answers))).packed())
        plan, replies = None, None
        if coord.is_coordinator:
            try:
                if error is not None:
                    raise error
                requests = PlanRequests.of(Joined.gathered(gathered, coord.world_size, "a plan request"))
                plan = plan_save(requests.specs, groups, files_per_rank=self.files_per_rank,
                                 aliases=requests.aliases, casts=requests.casts)
                objects = assign_objects(requests.objects)
                replies = [PlanReply(None, plan.packed(rank), o, plan.balance, plan.chunk_bytes)
                           for rank, o in enumerate(objects)]
            except Exception as exc:
                replies = [PlanReply(RankFailure.of(coord.rank, exc), b"")] * coord.world_size
        reply: PlanReply = coord.scatter(replies)
        if reply.failure is not None:
            raise failure_error([reply.failure], f"planning {what}", then, SaveError)
        self.cached = CachedPlan(key, writes_of(reply.writes, coord.rank), reply.objects, plan, reply.balance,
                                 reply.chunk)
        return Agreed(self.cached, False, generation)


def _request(structure: Structure, asked: List[Tuple[int, int]]) -> PlanRequest:
    """A rank's request: the stretches of its specs the coordinator asked it for (`shares_asked`)."""
    return PlanRequest(packed_specs([s for a, n in asked for s in structure.specs[a:a + n]]),
                       structure.aliases, structure.objects, structure.casts)
