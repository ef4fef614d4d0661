"""The read-once assignment (pure; the same on every rank): one reader for every stored item that
several ranks read, which reads the union of their ranges and sends each its regions.

Every rank makes it from every rank's read requests, each distinct run of them once (sent by its
first holder: `led_reads`): at scale, millions (`bench/plan_scale.py`). A rank's requests therefore
travel as columns (`RankReads`), files by their index in the checkpoint's file table, and the pass
that finds which items are shared runs on arrays; only the shared items, few beside the optimizer
shards each rank reads alone, are handled one by one.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .errors import LoadMismatchError
from .fragment import Box
from .gcpause import gc_paused
from .plan import LeastLoaded, ReadItem
from .runs import RunGroups, run_groups


class StoredItem(NamedTuple):
    """A stored box, by where it lies: what the read-once exchange keys its transfers by."""
    file: str
    offset: int


class ReadRequest(NamedTuple):
    """What a rank tells the others about one of its reads: the stored item, the byte range of it
    the rank reads, and the regions it copies out (the layout of a payload another rank sends)."""
    file: str
    offset: int
    start: int
    end: int
    regions: Tuple[Box, ...]

    @property
    def item(self) -> StoredItem:
        return StoredItem(self.file, self.offset)


def read_regions(read: ReadItem) -> Tuple[Box, ...]:
    """The distinct regions a read feeds, in the order of its copies: the layout of its payload
    when another rank reads it (each region row-major, one after the other)."""
    return tuple(dict.fromkeys(c.region for c in read.copies))


def read_request(read: ReadItem) -> ReadRequest:
    return ReadRequest(read.stored.file, read.stored.offset, read.start, read.end, read_regions(read))


@dataclass
class Regions:
    """Each read request's regions, packed into arrays (what every rank receives of every run:
    at scale, millions of regions, which unpickle as tuples in seconds). Request i's are
    `data[ptr[i]:ptr[i + 1]]`, each region as its number of dimensions, offsets, lengths."""
    data: np.ndarray  # int32 where every value fits, else int64
    ptr: np.ndarray  # int64, one more than the requests

    @classmethod
    def of(cls, regions: Sequence[Tuple[Box, ...]]) -> "Regions":
        flat: List[int] = []
        ptr = [0]
        for boxes in regions:
            for offsets, lengths in boxes:
                flat.append(len(offsets))
                flat.extend(offsets)
                flat.extend(lengths)
            ptr.append(len(flat))
        data = np.array(flat, dtype=np.int64)
        if len(data) and -2**31 <= data.min() and data.max() < 2**31:  # half the bytes sent, mostly
            data = data.astype(np.int32)
        return cls(data, np.array(ptr, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def __getitem__(self, i: int) -> Tuple[Box, ...]:
        values = self.data[self.ptr[i]:self.ptr[i + 1]].tolist()
        out, at = [], 0
        while at < len(values):
            n = values[at]
            out.append((tuple(values[at + 1:at + 1 + n]), tuple(values[at + 1 + n:at + 1 + 2 * n])))
            at += 1 + 2 * n
        return tuple(out)

    def take(self, rows: np.ndarray) -> "Regions":
        """The regions of requests `rows`, in that order."""
        starts, counts = self.ptr[rows], self.ptr[rows + 1] - self.ptr[rows]
        ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return Regions(self.data[np.repeat(starts - ptr[:-1], counts) + np.arange(ptr[-1], dtype=np.int64)], ptr)


@dataclass
class RankReads:
    """A rank's read requests by column: `columns` (int64) holds each request's file (its index
    in the file table every rank shares: the checkpoint's), offset, start and end."""
    columns: np.ndarray  # (4, requests)
    regions: Regions

    @classmethod
    def of(cls, requests: Sequence[ReadRequest], files: Dict[str, int]) -> "RankReads":
        """`requests` by column; `files`: the file table, each name's index."""
        missing = sorted({r.file for r in requests} - files.keys())
        if missing:
            raise LoadMismatchError(f"reads of {missing[0]}, which the checkpoint's file table lacks")
        columns = np.array([(files[r.file], r.offset, r.start, r.end) for r in requests], dtype=np.int64)
        return cls(columns.reshape(-1, 4).T.copy(), Regions.of([r.regions for r in requests]))

    def __len__(self) -> int:
        return self.columns.shape[1]

    def request(self, i: int, files: Sequence[str]) -> ReadRequest:
        file, offset, start, end = self.columns[:, i].tolist()
        return ReadRequest(files[file], offset, start, end, self.regions[i])


@dataclass(frozen=True)
class Transfer:
    """A stored range that several ranks need: `reader` reads it once and sends every other needer
    just the regions it wants (`wants`, aligned with `needers`), packed one after the other."""
    reader: int
    needers: Tuple[int, ...]
    wants: Tuple[Tuple[Box, ...], ...]
    start: int
    end: int
    tag: int


@dataclass
class Assignment:
    """The read-once assignment: `transfers` (all, or those one rank reads or needs), and how many
    shared items there are in all (the same on every rank)."""
    transfers: Dict[StoredItem, Transfer]
    shared: int


@dataclass
class _Groups:
    """Runs of requests that ranks hold alike, each looked at once (`runs`), and per group: its
    first holder (`leader`), how many requests it has, and how many ranks hold it."""
    runs: RunGroups
    leader: np.ndarray
    count: np.ndarray
    size: np.ndarray

    @classmethod
    def of(cls, runs: RunGroups) -> "_Groups":
        return cls(runs, runs.rank[runs.first], runs.count[runs.first],
                   np.bincount(runs.group, minlength=len(runs.first)))

    def ranks(self, groups: Sequence[int]) -> Tuple[int, ...]:
        """The ranks holding `groups`, group by group."""
        order, bounds = self._holders
        return tuple(r for g in groups for r in self.runs.rank[order[bounds[g]:bounds[g + 1]]].tolist())

    @cached_property
    def _holders(self) -> Tuple[np.ndarray, np.ndarray]:
        return self.runs.holders()


@dataclass
class _Rows:
    """Every group's requests, one row each, in the groups' order: a row's group, its index in its
    group leader's requests (those it sent: `led_reads`), and the request's columns (`file`: an
    index into the file table)."""
    group: np.ndarray
    index: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    start: np.ndarray
    end: np.ndarray


def led_reads(reads: RankReads, runs: RunGroups, rank: int) -> RankReads:
    """What `rank` sends for the assignment: its requests in the runs it is the first holder of."""
    led = runs.led(rank)
    if len(led) == len(reads):
        return reads
    return RankReads(reads.columns[:, led], reads.regions.take(led))


@gc_paused
def assign_transfers(requests: Sequence[RankReads], files: Sequence[str], runs: Optional[RunGroups] = None,
                     rank: Optional[int] = None,
                     readers: Optional[Callable[[str], Optional[Sequence[int]]]] = None) -> Assignment:
    """Pick one reader for every stored item that several ranks read (`files`: the file table
    the requests index).

    The reader is one of the ranks needing the item, balancing bytes read across ranks; it reads
    the union of the needed ranges. Items only one rank needs, or whose needers want disjoint
    ranges of it, are left to those ranks. `runs`: every rank's request runs (`run_groups` of
    their `runs_of`), which runs several ranks request alike are handled once by; `requests[r]`
    is then rank r's `led_reads`. Without, each rank's whole list is its own run. With `rank`,
    only the transfers that rank reads or needs are built. `readers(file)`: the ranks that can
    read a file (None: all); an item no needer can read is read by one that can, which passes it
    on to every needer.
    """
    groups = _Groups.of(runs if runs is not None else run_groups(None, [len(r) for r in requests]))
    rows = _rows(requests, groups)
    able = {f: None if found is None else tuple(sorted(found))
            for f, found in ((files[i], readers(files[i])) for i in np.unique(rows.file).tolist())} \
        if readers is not None else {}
    load = LeastLoaded(len(requests))
    order, item_of = _by_item(rows)
    apart = _alone(rows, groups, files, order, item_of, able)[item_of]
    if apart.any():
        got = np.bincount(groups.leader[rows.group[order[apart]]], weights=(rows.end - rows.start)[order[apart]],
                          minlength=len(requests))
        load.load = [int(x) for x in got.tolist()]
    return _assign(rows, groups, requests, files, order[~apart], item_of[~apart], able, load, rank)


def _rows(requests: Sequence[RankReads], groups: _Groups) -> _Rows:
    """Each group's requests as rows: the leaders' lists, one after the other (groups are
    numbered in the order first met, rank by rank)."""
    sent = np.fromiter(map(len, requests), dtype=np.int64, count=len(requests))
    due = np.bincount(groups.leader, weights=groups.count, minlength=len(requests)).astype(np.int64)
    wrong = np.flatnonzero(sent != due)
    if len(wrong):
        raise ValueError(f"rank {wrong[0]} sent {sent[wrong[0]]} read requests for runs of {due[wrong[0]]}")
    columns = np.concatenate([r.columns for r in requests] + [np.zeros((4, 0), dtype=np.int64)], axis=1)
    group = np.repeat(np.arange(len(groups.count), dtype=np.int64), groups.count)
    index = np.arange(columns.shape[1], dtype=np.int64) - (np.cumsum(sent) - sent)[groups.leader[group]]
    return _Rows(group, index, *columns)


def _by_item(rows: _Rows) -> Tuple[np.ndarray, np.ndarray]:
    """The rows sorted by stored item (`order`), and each sorted row's item, numbered in order."""
    width = int(rows.offset.max()).bit_length() if len(rows.offset) else 0
    if int(rows.file.max(initial=0)).bit_length() + width < 63:
        key = (rows.file << width) | rows.offset
        order = np.argsort(key)
        key = key[order]
        first = key[1:] != key[:-1]
    else:
        order = np.lexsort((rows.offset, rows.file))
        file, offset = rows.file[order], rows.offset[order]
        first = (file[1:] != file[:-1]) | (offset[1:] != offset[:-1])
    return order, np.concatenate([[0], np.cumsum(first)]) if len(order) else order


def _alone(rows: _Rows, groups: _Groups, files: Sequence[str], order: np.ndarray, item_of: np.ndarray,
           able: Dict[str, Optional[Tuple[int, ...]]]) -> np.ndarray:
    """Per item: whether each of its needers reads its own bytes: one rank per request, ranges
    disjoint (row shards of one stored box), every needer able to read the file. Nothing is then
    sent."""
    solo = (groups.size == 1)[rows.group]
    if any(v is not None for v in able.values()):
        leader = groups.leader[rows.group]
        solo &= np.array([able[files[f]] is None or r in able[files[f]]
                          for f, r in zip(rows.file.tolist(), leader.tolist())], dtype=bool)
    items = int(item_of[-1]) + 1 if len(item_of) else 0
    bad = np.bincount(item_of, weights=~solo[order], minlength=items) > 0
    several = (np.bincount(item_of, minlength=items) > 1)[item_of]
    if several.any():  # the rows of items several rows need, by range: an overlap makes one shared
        sub, its = order[several], item_of[several]
        by = np.lexsort((rows.end[sub], rows.start[sub], its))
        sub, its = sub[by], its[by]
        overlap = (rows.end[sub][:-1] > rows.start[sub][1:]) & (its[1:] == its[:-1])
        bad |= np.bincount(its[1:], weights=overlap, minlength=items) > 0
    return ~bad


def _assign(rows: _Rows, groups: _Groups, requests: Sequence[RankReads], files: Sequence[str],
            shared_rows: np.ndarray, shared_item: np.ndarray, able: Dict[str, Optional[Tuple[int, ...]]], load: LeastLoaded,
            rank: Optional[int]) -> Assignment:
    """Readers for the shared items (`shared_rows`, of items `shared_item`), largest first, then
    by item: each the least loaded of its needers (able to read it)."""
    by = np.lexsort((shared_rows, shared_item))  # each item's rows in the groups' order
    users, item = shared_rows[by], shared_item[by]
    cut = np.flatnonzero(np.diff(item, prepend=-1)) if len(item) else np.zeros(0, dtype=np.int64)
    starts = np.minimum.reduceat(rows.start[users], cut).tolist() if len(cut) else []
    ends = np.maximum.reduceat(rows.end[users], cut).tolist() if len(cut) else []
    head = users[cut]
    spans = sorted(zip([s - e for s, e in zip(starts, ends)], [files[f] for f in rows.file[head].tolist()],
                       rows.offset[head].tolist(), starts, ends, cut.tolist(), [*cut[1:].tolist(), len(users)]))
    group, index = rows.group[users].tolist(), rows.index[users].tolist()
    leader, size = groups.leader.tolist(), groups.size.tolist()
    out: Dict[StoredItem, Transfer] = {}
    needer_sets: Dict[Tuple[int, ...], Tuple[Tuple[int, ...], frozenset]] = {}  # by the groups needing an item
    for tag, (_, file, offset, start, end, at, stop) in enumerate(spans):
        by_groups = tuple(group[at:stop])
        cached = needer_sets.get(by_groups)
        if cached is None:
            needers = groups.ranks(by_groups)
            cached = needer_sets[by_groups] = (needers, frozenset(needers) if rank is not None else frozenset())
        needers = cached[0]
        can = able.get(file) if able else None
        if can is not None:
            if not can:
                raise LoadMismatchError(f"{file} is needed but no rank of this job can read it")
            reader = load.pick(tuple(r for r in needers if r in can) or can)
        else:
            reader = load.pick(needers)
        load.add(reader, end - start)
        if rank is None or rank in cached[1] or rank == reader:
            wants = tuple(w for g, i in zip(by_groups, index[at:stop])
                          for w in [requests[leader[g]].regions[i]] * size[g])
            out[StoredItem(file, offset)] = Transfer(reader, needers, wants, start, end, tag)
    return Assignment(out, len(spans))
