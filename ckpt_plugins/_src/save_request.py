"""What each rank tells the coordinator for a new save plan, as plain bytes, every rank's joined
there in one pass on arrays (see `packing`): at scale the coordinator receives a message from
each of hundreds of thousands of ranks, which take seconds to rebuild as pickled objects. First
a rank's runs (`runs_message`; the coordinator answers each rank with its share of the specs of
each run it holds, `shares_asked`), then those specs with its aliases, objects and `casts`
(`PlanRequest`; joined, `PlanRequests`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .packing import Joined, aligned, padded
from .runs import DIGEST_BYTES, Run, RunGroups, packed_runs
from .spec_table import SpecTable

_FIELDS = 4  # a request's header: casts, bytes of its aliases, of its objects, of its specs


def runs_message(runs: Sequence[Run]) -> bytes:
    return aligned(np.int64(len(runs)).tobytes(), *packed_runs(runs))


def joined_runs(joined: Joined) -> RunGroups:
    """Every rank's `runs_message` (in `joined`), grouped."""
    n = joined.header(1)[:, 0]
    counts = joined.start + 8
    wrong = np.flatnonzero((n < 0) | (counts + (8 + DIGEST_BYTES) * n != joined.start + joined.size))
    if len(wrong):
        raise ValueError(f"rank {wrong[0]} sent {joined.size[wrong[0]]} bytes that do not hold its run digests")
    return RunGroups.unpacked(joined, counts, counts + 8 * n, n)


def shares_asked(groups: RunGroups) -> List[bytes]:
    """Each rank's answer: the stretches of its specs it sends, as (first, count) int64 pairs, its
    share of each of its runs (`RunGroups.share`). Every holder of a run sends a part of it, not the
    first alone: a gather pads every rank's message to the largest (`Coordinator.gather_bytes`),
    and the first replica of each model-parallel rank would send all its weights' specs."""
    first, count = groups.shares
    sent = np.flatnonzero(count)
    pairs = np.column_stack([groups.start[sent] + first[sent], count[sent]]).astype(np.int64)
    cuts = np.searchsorted(groups.rank[sent], np.arange(groups.world + 1)).tolist()
    return [pairs[a:b].tobytes() for a, b in zip(cuts[:-1], cuts[1:])]


def stretches_asked(answer: bytes) -> List[Tuple[int, int]]:
    """`shares_asked`'s answer to one rank: (first, count) pairs of positions in its specs."""
    return [(a, n) for a, n in np.frombuffer(answer, dtype=np.int64).reshape(-1, 2).tolist()]


@dataclass
class PlanRequest:
    """What one rank tells the coordinator when some rank's cached plan is stale, after its runs:
    the specs asked for (`packed_specs`, its shares of its runs), its aliases and objects, and its
    `Structure.casts`."""
    specs: bytes
    aliases: Dict[str, str]
    objects: List[str]
    casts: bool = False

    def packed(self) -> bytes:
        aliases = json.dumps(self.aliases).encode() if self.aliases else b""
        objects = json.dumps(self.objects).encode() if self.objects else b""
        header = np.array([int(self.casts), len(aliases), len(objects), len(self.specs)], dtype=np.int64)
        return aligned(header.tobytes(), aliases, objects, self.specs)


@dataclass
class PlanRequests:
    """Every rank's `PlanRequest`, joined: the specs rank by rank, every rank's aliases, each
    rank's objects, and whether every rank vouched for `casts`."""
    specs: SpecTable
    aliases: Dict[str, str]
    objects: List[List[str]]
    casts: bool

    @classmethod
    def of(cls, joined: Joined) -> "PlanRequests":
        """Every rank's `packed` request, in `joined`."""
        casts, aliases, objects, specs = joined.header(_FIELDS).T
        at = joined.start + 8 * _FIELDS
        aliased, at = at, at + padded(aliases)
        held, at = at, at + padded(objects)
        wrong = np.flatnonzero((np.minimum.reduce([aliases, objects, specs]) < 0)
                               | (at + padded(specs) != joined.start + joined.size))
        if len(wrong):
            raise ValueError(f"rank {wrong[0]} sent {joined.size[wrong[0]]} bytes that do not hold its plan request")

        def parsed(starts, lengths):  # the ranks that sent some, by rank
            return {r: json.loads(joined.buffer[starts[r]:starts[r] + lengths[r]])
                    for r in np.flatnonzero(lengths).tolist()}

        named, objects = parsed(aliased, aliases), parsed(held, objects)
        return cls(SpecTable.unpacked(joined, at, specs), {k: v for r in sorted(named) for k, v in named[r].items()},
                   [objects.get(r, []) for r in range(len(joined))], bool(casts.all()))
