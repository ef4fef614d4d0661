"""Runs: stretches of a rank's specs or read requests named by a digest of their content, so that
what several ranks hold alike (the weights of data-parallel replicas, whose optimizer shards
differ) is planned once. Pure; the save plan and the read-once assignment group them alike.
"""
from __future__ import annotations

import hashlib
import itertools
import pickle
from dataclasses import dataclass
from functools import cached_property
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .packing import spans
from .sorting import distinct, first_met

DIGEST_BYTES = 32


class Run(NamedTuple):
    """`count` consecutive specs or read requests of one rank under one top-level key (`model/`,
    `optim/`, ...), by a digest of their content."""
    digest: bytes
    count: int


def runs_of(keys: Sequence[str], items: Sequence) -> List[Run]:
    """`items` (a rank's specs or read requests, `keys` their tensor keys) as runs."""
    out: List[Run] = []
    start = 0
    for i in range(1, len(items) + 1):
        if i == len(items) or keys[i].split("/", 1)[0] != keys[start].split("/", 1)[0]:
            out.append(Run(hashlib.sha256(pickle.dumps(list(items[start:i]))).digest(), i - start))
            start = i
    return out


def packed_runs(runs: Sequence[Run]) -> Tuple[bytes, bytes]:
    """`runs` as two message sections (`packing`): their counts (int64), and their digests
    (`RunGroups.unpacked` joins every rank's)."""
    return np.array([r.count for r in runs], dtype=np.int64).tobytes(), b"".join(r.digest for r in runs)


@dataclass
class RunGroups:
    """Every rank's runs, grouped by digest. Span k is rank `rank[k]`'s items [start[k],
    start[k] + count[k]), planned as group `group[k]`; spans go rank by rank, groups are numbered
    in the order first met, and `first[g]` is group g's first span (its first holder's); `world`
    ranks in all."""
    group: np.ndarray
    rank: np.ndarray
    start: np.ndarray
    count: np.ndarray
    first: np.ndarray
    world: int

    @cached_property
    def holders(self) -> Tuple[np.ndarray, np.ndarray]:
        """Each group's spans, in rank order: group g's are `order[bounds[g]:bounds[g + 1]]`
        (kept: the shares and the read-once assignment both use them)."""
        order = np.argsort(self.group, kind="stable")
        return order, np.searchsorted(self.group[order], np.arange(len(self.first) + 1))

    def share(self, rank: int) -> np.ndarray:
        """The positions in `rank`'s list of the items it sends the others: its share of each of
        its runs (`shares`). All that others need of its list, since the other holders' runs
        are alike."""
        mine = self.spans_of(rank)
        first, count = self.shares
        return spans(self.start[mine] + first[mine], count[mine])

    def spans_of(self, rank: int) -> slice:
        """Rank `rank`'s spans."""
        return slice(*np.searchsorted(self.rank, [rank, rank + 1]).tolist())

    def ranks_holding(self, groups: np.ndarray) -> np.ndarray:
        """The ranks holding each of `groups`, in rank order, one group after the other."""
        order, bounds = self.holders
        groups = np.asarray(groups, dtype=np.int64)
        return self.rank[order[spans(bounds[groups], bounds[groups + 1] - bounds[groups])]]

    def held(self) -> np.ndarray:
        """How many items each rank holds."""
        return np.bincount(self.rank, weights=self.count, minlength=self.world).astype(np.int64)

    def share_counts(self) -> np.ndarray:
        """How many items each rank sends (`share` gives their positions)."""
        return np.bincount(self.rank, weights=self.shares[1], minlength=self.world).astype(np.int64)

    def share_groups(self) -> np.ndarray:
        """The group of each item every rank sends (`share`, one rank after the other)."""
        return np.repeat(self.group, self.shares[1])

    @cached_property
    def shares(self) -> Tuple[np.ndarray, np.ndarray]:
        """Per span, the first of its run's items it sends and how many: each group's items dealt
        over its holders in equal parts, holder j of m items [j c / m, (j + 1) c / m). Not the
        first holder's alone: a gather pads every rank's message to the largest
        (`Coordinator.all_gather_bytes`), and at scale the first replica of each model-parallel
        rank would send all its weights' specs and read requests."""
        order, bounds = self.holders
        j = np.empty(len(self.group), dtype=np.int64)
        j[order] = np.arange(len(order), dtype=np.int64) - bounds[self.group[order]]
        m = np.diff(bounds)[self.group]
        first = j * self.count // m
        return first, (j + 1) * self.count // m - first

    def share_positions(self) -> np.ndarray:
        """The positions, in every rank's list joined rank by rank, of what every rank's `share`
        gives, one rank after the other."""
        held = self.held()
        first, count = self.shares
        return spans((np.cumsum(held) - held)[self.rank] + self.start + first, count)

    @classmethod
    def unpacked(cls, joined, counts: np.ndarray, digests: np.ndarray, n: np.ndarray,
                 lengths: Optional[Sequence[int]] = None) -> "RunGroups":
        """Every rank's `packed_runs` in `joined` (`packing.Joined`): rank k's `n[k]` runs, their
        counts from byte `counts[k]` and their digests from byte `digests[k]`."""
        return cls.of(joined.longs[spans(digests // 8, DIGEST_BYTES // 8 * n)].view(f"S{DIGEST_BYTES}"),
                      joined.longs[spans(counts // 8, n)], n, lengths)

    @classmethod
    def of(cls, digests: np.ndarray, count: np.ndarray, per_rank: np.ndarray,
           lengths: Optional[Sequence[int]] = None) -> "RunGroups":
        """`run_groups` of every rank's runs as arrays: their digests (`S32`) and counts, rank by
        rank, `per_rank[r]` of them rank r's."""
        rank = np.repeat(np.arange(len(per_rank), dtype=np.int64), per_rank)
        covered = np.bincount(rank, weights=count, minlength=len(per_rank)).astype(np.int64)
        short = np.flatnonzero(covered != lengths) if lengths is not None else ()
        if len(short):
            r = int(short[0])
            raise ValueError(f"rank {r}'s run digests cover {covered[r]} of {lengths[r]} items")
        start = np.cumsum(count) - count - np.repeat(np.cumsum(covered) - covered, per_rank)  # in its rank's list
        group, first = distinct_rows(np.ascontiguousarray(digests).view(np.int64).reshape(-1, DIGEST_BYTES // 8))
        if (count != count[first][group]).any():
            raise ValueError("runs of one digest differ in length")
        return cls(group, rank, start, count, first, len(per_rank))


def distinct_rows(columns: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Each row's number among the distinct rows of `columns` (int64, as first met), and each
    distinct row's first. On a 64-bit hash of each row, checked: rows that share a hash and differ
    are sorted on all their columns instead (a hash sorts many times faster than wide rows)."""
    of, first = distinct(_row_hash(columns))
    if (columns != columns[first[of]]).any():
        rows = np.ascontiguousarray(columns, dtype=np.int64)
        _, first, of = np.unique(rows.view(f"V{rows.shape[1] * 8}").reshape(-1), return_index=True,
                                 return_inverse=True)
    return first_met(of.reshape(-1), first)  # the rows' order, rank by rank, is kept


def _row_hash(columns: np.ndarray) -> np.ndarray:
    mixed = np.zeros(len(columns), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in columns.T.astype(np.uint64):
            mixed = (mixed ^ column) * np.uint64(0x9E3779B97F4A7C15)
            mixed ^= mixed >> np.uint64(29)
    return mixed


def run_groups(runs: Optional[Sequence[Sequence[Run]]], lengths: Optional[Sequence[int]] = None) -> RunGroups:
    """Every rank's `runs[r]`, which must cover the `lengths[r]` items it holds where those are
    given; or (no runs) each rank's whole list of `lengths[r]` its own run. On arrays: at scale
    there are hundreds of thousands (`bench/plan_scale.py`)."""
    if runs is None:
        every = np.arange(len(lengths), dtype=np.int64)
        return RunGroups(every, every, np.zeros_like(every), np.asarray(lengths, dtype=np.int64), every, len(every))
    if lengths is not None and len(runs) != len(lengths):
        raise ValueError(f"runs of {len(runs)} ranks for {len(lengths)}")
    records = np.fromiter(itertools.chain.from_iterable(runs), dtype=[("digest", f"S{DIGEST_BYTES}"), ("count", "i8")])
    return RunGroups.of(records["digest"], records["count"], np.fromiter(map(len, runs), dtype=np.int64, count=len(runs)),
                        lengths)
