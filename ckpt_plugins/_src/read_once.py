"""The read-once assignment (pure; the same on every rank): one reader for every stored item that
several ranks read, which reads the union of their ranges and sends each its regions.

Every rank makes it from every rank's read requests, each distinct run of them once (sent by its
holders in equal shares: `reads_share`): at scale, millions (`bench/plan_scale.py`). A rank's
requests therefore travel as columns (`RankReads`), files by their index in the checkpoint's file
table, and the pass that finds which items are shared runs on arrays; only the shared items, few
beside the optimizer shards each rank reads alone, are handled one by one.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .errors import LoadMismatchError
from .fragment import Box
from .gcpause import gc_paused
from .packing import Joined, aligned, padded, spans
from .plan import LeastLoaded, ReadItem
from .runs import RunGroups
from .sorting import lexsorted


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
    `data[start[i]:end[i]]`, each region as its number of dimensions, offsets, lengths; requests
    taken from a list, or joined from what every rank sent, share its values."""
    data: np.ndarray  # int32 where every value fits, else int64
    start: np.ndarray  # int64, per request
    end: np.ndarray

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
        return cls.packed(np.array(flat, dtype=np.int64), np.diff(ptr))

    @classmethod
    def packed(cls, values: np.ndarray, lengths: np.ndarray) -> "Regions":
        """`values` one request's after the other, `lengths[i]` of them request i's; in int32
        where every value fits (half the bytes sent, mostly)."""
        if not len(values) or (-2**31 <= values.min() and values.max() < 2**31):
            values = values.astype(np.int32)
        end = np.cumsum(lengths, dtype=np.int64)
        return cls(values, end - lengths, end)

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, i: int) -> Tuple[Box, ...]:
        return _boxes(self.data[self.start[i]:self.end[i]].tolist())

    def many(self, rows: Sequence[int]) -> List[Tuple[Box, ...]]:
        """`self[i]` for each of `rows`, each distinct list decoded once: an item's needers
        mostly want alike (at scale, thousands of lists per rank)."""
        data, decoded, out = memoryview(self.data), {}, []
        for a, b in zip(self.start[rows].tolist(), self.end[rows].tolist()):
            raw = data[a:b].tobytes()
            boxes = decoded.get(raw)
            if boxes is None:
                boxes = decoded[raw] = _boxes(self.data[a:b].tolist())
            out.append(boxes)
        return out

    @property
    def lengths(self) -> np.ndarray:
        return self.end - self.start

    def values(self) -> np.ndarray:
        """Every request's values, one after the other."""
        return self.data[spans(self.start, self.lengths)]

    def take(self, rows: np.ndarray) -> "Regions":
        """The regions of requests `rows`, in that order."""
        return Regions(self.data, self.start[rows], self.end[rows])

    @classmethod
    def joined(cls, parts: Sequence["Regions"]) -> "Regions":
        """Several lists' regions, one after the other."""
        return cls.packed(np.concatenate([p.values() for p in parts] + [np.zeros(0, dtype=np.int64)]),
                          np.concatenate([p.lengths for p in parts] + [np.zeros(0, dtype=np.int64)]))


def _boxes(values: List[int]) -> Tuple[Box, ...]:
    """Regions from their values: each its number of dimensions, offsets, lengths."""
    out, at = [], 0
    while at < len(values):
        n = values[at]
        out.append((tuple(values[at + 1:at + 1 + n]), tuple(values[at + 1 + n:at + 1 + 2 * n])))
        at += 1 + 2 * n
    return tuple(out)


@dataclass
class RankReads:
    """A rank's read requests by column: `columns` (int64) holds each request's file (its index
    in the file table every rank shares: the checkpoint's), offset, start and end."""
    columns: np.ndarray  # (4, requests)
    regions: Regions

    @classmethod
    def of(cls, requests: Sequence[ReadRequest], files: Dict[str, int]) -> "RankReads":
        """`requests` by column; `files`: the file table, each name's index."""
        # not `set - files.keys()`: that walks the whole table (262,144 files at 131,072 ranks)
        missing = sorted(f for f in {r.file for r in requests} if f not in files)
        if missing:
            raise LoadMismatchError(f"reads of {missing[0]}, which the checkpoint's file table lacks")
        columns = np.array([(files[r.file], r.offset, r.start, r.end) for r in requests], dtype=np.int64)
        return cls(columns.reshape(-1, 4).T.copy(), Regions.of([r.regions for r in requests]))

    @classmethod
    def joined(cls, parts: Sequence["RankReads"]) -> "RankReads":
        """Several ranks' lists, one after the other."""
        return cls(np.concatenate([p.columns for p in parts] + [np.zeros((4, 0), dtype=np.int64)], axis=1),
                   Regions.joined([p.regions for p in parts]))

    def packed(self) -> bytes:
        """What a rank sends of its requests (`packing`; `unpacked` joins every rank's): the
        regions' width in 4-byte words (1: int32, 2: int64) and the columns, as int64s; each
        request's number of region values and the values, as 4-byte words."""
        regions = self.regions
        return aligned(np.int64(regions.data.itemsize // 4).tobytes()
                       + np.ascontiguousarray(self.columns, dtype=np.int64).tobytes(),
                       regions.lengths.astype(np.int32).tobytes() + regions.values().tobytes())

    @classmethod
    def unpacked(cls, joined: Joined, at: np.ndarray, nbytes: np.ndarray, counts: Sequence[int]) -> "RankReads":
        """Every rank's `packed` requests: `counts[k]` of them in the `nbytes[k]` bytes from byte
        `at[k]` of `joined`, one rank after the other, in one pass on arrays."""
        n, nbytes = np.asarray(counts, dtype=np.int64), np.asarray(nbytes, dtype=np.int64)
        short = np.flatnonzero(nbytes < 8 + 36 * n)
        if len(short):
            raise ValueError(f"rank {short[0]} sent {nbytes[short[0]]} bytes for {n[short[0]]} read requests")
        head = at // 8
        width = joined.longs[head]
        columns = np.stack([joined.longs[spans(head + 1 + j * n, n)] for j in range(4)])
        lengths = joined.words[spans(2 * (head + 1 + 4 * n), n)].astype(np.int64)
        values = np.bincount(np.repeat(np.arange(len(n)), n), weights=lengths, minlength=len(n)).astype(np.int64)
        wrong = np.flatnonzero(((width != 1) & (width != 2)) | (nbytes != 8 + 32 * n + padded(4 * n + 4 * values * width)))
        if len(wrong):
            raise ValueError(f"rank {wrong[0]} sent {nbytes[wrong[0]]} bytes that do not hold its {n[wrong[0]]} "
                             f"read requests")
        first = 2 * (head + 1 + 4 * n) + n  # each rank's first region word
        if (width == 1).all():  # in place: each request's values where its rank's message holds them
            before = np.cumsum(lengths) - lengths  # values before each request, of every rank
            rank = np.repeat(np.arange(len(n)), n)
            start = first[rank] + before - before[(np.cumsum(n) - n)[rank]]
            return cls(columns, Regions(joined.words, start, start + lengths))
        # some rank's values need int64: those come as pairs of words
        data, wide, at_value = np.empty(values.sum(), dtype=np.int64), width == 2, np.cumsum(values) - values
        data[spans(at_value[~wide], values[~wide])] = joined.words[spans(first[~wide], values[~wide])]
        data[spans(at_value[wide], values[wide])] = joined.words[spans(first[wide], 2 * values[wide])].view(np.int64)
        return cls(columns, Regions.packed(data, lengths))

    def __len__(self) -> int:
        return self.columns.shape[1]

    def take(self, rows: np.ndarray) -> "RankReads":
        """Requests `rows`, in that order."""
        return RankReads(self.columns[:, rows], self.regions.take(rows))

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
        return tuple(self.runs.ranks_holding(groups).tolist())


@dataclass
class _Rows:
    """Every group's requests, one row each, as the ranks sent them (each its `reads_share`, one
    rank after the other): a row's group and the request's columns (`file`: an index into the
    file table)."""
    group: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    start: np.ndarray
    end: np.ndarray

    @classmethod
    def of(cls, reads: "RankReads", groups: _Groups) -> "_Rows":
        if len(reads) != int(groups.count.sum()):
            raise ValueError(f"{len(reads)} read requests were sent for runs of {int(groups.count.sum())}")
        return cls(groups.runs.share_groups(), *reads.columns)


def reads_share(reads: RankReads, runs: RunGroups, rank: int) -> RankReads:
    """What `rank` sends for the assignment: its share of the requests in its runs (`RunGroups.share`)."""
    mine = runs.share(rank)
    return reads if len(mine) == len(reads) else reads.take(mine)


@gc_paused
def assign_transfers(reads: RankReads, runs: RunGroups, files: Sequence[str], rank: Optional[int] = None,
                     readers: Optional[Callable[[str], Optional[Sequence[int]]]] = None) -> Assignment:
    """Pick one reader for every stored item that several ranks read (`files`: the file table
    the requests index).

    The reader is one of the ranks needing the item, balancing bytes read across ranks; it reads
    the union of the needed ranges. Items only one rank needs, or whose needers want disjoint
    ranges of it, are left to those ranks. `runs`: every rank's request runs (`run_groups` of
    their `runs_of`; of None and their lengths: each rank's whole list its own run), which runs
    several ranks request alike are handled once by; `reads`: every rank's `reads_share`, one rank
    after the other. With `rank`, only the transfers that rank reads or needs are built.
    `readers(file)`: the ranks that can read a file (None: all); an item no needer can read is
    read by one that can, which passes it on to every needer.
    """
    groups = _Groups.of(runs)
    rows = _Rows.of(reads, groups)
    used = np.flatnonzero(np.bincount(rows.file, minlength=len(files))).tolist() if readers is not None else []
    found = {files[i]: readers(files[i]) for i in used}  # files counted, not sorted: at scale, millions of rows
    able = {f: tuple(sorted(r)) for f, r in found.items() if r is not None}  # the files only some ranks can read
    load = LeastLoaded(runs.world)
    order, item_of = _by_item(rows, np.flatnonzero(_maybe_shared(rows, groups, files, able)))
    apart = _alone(rows, groups, files, order, item_of, able)[item_of]
    alone = np.ones(len(rows.group), dtype=bool)
    alone[order[~apart]] = False
    if alone.any():
        got = np.bincount(groups.leader[rows.group[alone]], weights=(rows.end - rows.start)[alone], minlength=runs.world)
        load.load = got.astype(np.int64).tolist()
    return _assign(rows, groups, reads.regions, files, order[~apart], item_of[~apart], able, load, rank)


def _maybe_shared(rows: _Rows, groups: _Groups, files: Sequence[str], able: Dict[str, Tuple[int, ...]]) -> np.ndarray:
    """Per row: whether another rank may need its item, or its rank may be unable to read it: its
    group has several holders, or its file is read by several groups, or only by some ranks. The
    other rows (at scale, most: each rank's optimizer shards) are read alone without sorting
    them: a rank reads a stored item once (`plan_load`), so no other row names theirs."""
    count = np.bincount(rows.file, minlength=len(files))
    # a file's rows are of one group exactly when each row's group is their mean (exact in float64)
    mean = np.bincount(rows.file, weights=rows.group, minlength=len(files)) / np.maximum(count, 1)
    mixed = np.bincount(rows.file, weights=mean[rows.file] != rows.group, minlength=len(files)) > 0
    maybe = (groups.size > 1)[rows.group] | mixed[rows.file]
    if able:
        maybe |= np.isin(rows.file, [i for i, f in enumerate(files) if f in able])
    return maybe


def _by_item(rows: _Rows, among: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Rows `among` sorted by stored item (`order`), and each sorted row's item, numbered in order."""
    file, offset = rows.file[among], rows.offset[among]
    by = lexsorted((offset, file))
    file, offset = file[by], offset[by]
    first = (file[1:] != file[:-1]) | (offset[1:] != offset[:-1])
    return among[by], np.concatenate([[0], np.cumsum(first)]) if len(by) else by


def _alone(rows: _Rows, groups: _Groups, files: Sequence[str], order: np.ndarray, item_of: np.ndarray,
           able: Dict[str, Tuple[int, ...]]) -> np.ndarray:
    """Per item: whether each of its needers reads its own bytes: one rank per request, ranges
    disjoint (row shards of one stored box), every needer able to read the file. Nothing is then
    sent."""
    solo = (groups.size == 1)[rows.group]
    if able:
        leader = groups.leader[rows.group]
        solo &= np.array([files[f] not in able or r in able[files[f]]
                          for f, r in zip(rows.file.tolist(), leader.tolist())], dtype=bool)
    items = int(item_of[-1]) + 1 if len(item_of) else 0
    bad = np.bincount(item_of, weights=~solo[order], minlength=items) > 0
    several = (np.bincount(item_of, minlength=items) > 1)[item_of]
    if several.any():  # the rows of items several rows need, by range: an overlap makes one shared
        sub, its = order[several], item_of[several]
        by = lexsorted((rows.end[sub], rows.start[sub], its))
        sub, its = sub[by], its[by]
        overlap = (rows.end[sub][:-1] > rows.start[sub][1:]) & (its[1:] == its[:-1])
        bad |= np.bincount(its[1:], weights=overlap, minlength=items) > 0
    return ~bad


def _assign(rows: _Rows, groups: _Groups, regions: Regions, files: Sequence[str], shared_rows: np.ndarray,
            shared_item: np.ndarray, able: Dict[str, Tuple[int, ...]], load: LeastLoaded,
            rank: Optional[int]) -> Assignment:
    """Readers for the shared items (`shared_rows`, of items `shared_item`), largest first, then
    by item (file, offset): each the least loaded of its needers (able to read it)."""
    by = lexsorted((shared_rows, rows.group[shared_rows], shared_item))  # each item's rows in the groups' order
    users, item = shared_rows[by], shared_item[by]
    cut = np.flatnonzero(np.diff(item, prepend=-1)) if len(item) else np.zeros(0, dtype=np.int64)
    stop = np.append(cut[1:], len(users)).astype(np.int64)
    starts = np.minimum.reduceat(rows.start[users], cut) if len(cut) else cut
    ends = np.maximum.reduceat(rows.end[users], cut) if len(cut) else cut
    file, offset = rows.file[users[cut]], rows.offset[users[cut]]
    tags = lexsorted((offset, file, starts - ends))  # the items, largest first
    group = rows.group[users]
    needed, pick_from = _needer_sets(group, cut, stop, groups)
    sets = _able_sets(needed, pick_from, file, files, able) if able else needed
    readers = np.full(len(tags), -1, dtype=np.int64)
    dealt = tags
    if rank is not None:  # only the items whose picks can change those it reads or needs
        wanted = np.isin(needed, pick_from.holding(rank))
        dealt = tags[_linked(sets, pick_from, rank, wanted)[tags]]
    readers[dealt] = load.deal(sets[dealt].tolist(), (ends - starts)[dealt].tolist(), pick_from)
    tag_of = np.empty_like(tags)
    tag_of[tags] = np.arange(len(tags))
    if rank is not None:  # only the transfers it reads or needs
        tags = tags[wanted[tags] | (readers[tags] == rank)]
    group, bounds, size = group.tolist(), stop.tolist(), groups.size.tolist()
    kept = [(k, bounds[k - 1] if k else 0, bounds[k]) for k in tags.tolist()]
    asked = iter(regions.many(np.concatenate([users[a:b] for _, a, b in kept] + [users[:0]])))
    out: Dict[StoredItem, Transfer] = {}
    for k, a, b in kept:
        wants = []
        for g in group[a:b]:  # a group's holders want alike
            wants += [next(asked)] * size[g]
        out[StoredItem(files[int(file[k])], int(offset[k]))] = Transfer(
            int(readers[k]), pick_from[int(needed[k])], tuple(wants), int(starts[k]), int(ends[k]), int(tag_of[k]))
    return Assignment(out, len(readers))


def _linked(sets: np.ndarray, pick_from: "_NeederSets", rank: int, wanted: np.ndarray) -> np.ndarray:
    """Per item: whether its pick can change the pick of an item `rank` may read (its set, `sets`,
    holds the rank) or needs (`wanted`). Picks change each other only through the loads of ranks
    their sets share, so those are the items of the components (sets linked by a shared rank,
    directly or through others) of such items: at scale, a pipeline stage's, not every stage's."""
    numbers = np.unique(sets)
    of, member = pick_from.members(numbers.tolist())
    label = np.arange(len(numbers))
    while True:  # each set takes the least label of the sets it shares a rank with, until none changes
        least = np.full(pick_from.groups.runs.world, len(numbers))
        np.minimum.at(least, member, label[of])
        linked = label.copy()
        np.minimum.at(linked, of, least[member])
        if (linked == label).all():
            break
        label = linked
    component = label[np.searchsorted(numbers, sets)]
    return np.isin(component, np.append(component[wanted], least[rank]))


def _able_sets(needed: np.ndarray, pick_from: "_NeederSets", file: np.ndarray, files: Sequence[str],
               able: Dict[str, Tuple[int, ...]]) -> np.ndarray:
    """Each item's set to pick its reader from where some ranks cannot read some files: of an
    item of such a file, those of its needers that can (`needed`: their set), else every rank
    that can. The new sets are added to `pick_from`, numbered after the others."""
    sets, numbers = needed.copy(), {}
    for k, (f, s) in enumerate(zip(file.tolist(), needed.tolist())):
        can = able.get(files[f])
        if can is None:
            continue
        if not can:
            raise LoadMismatchError(f"{files[f]} is needed but no rank of this job can read it")
        ranks = tuple(r for r in pick_from[s] if r in can) or can
        if ranks not in numbers:
            numbers[ranks] = pick_from.add(ranks)
        sets[k] = numbers[ranks]
    return sets


def _needer_sets(group: np.ndarray, cut: np.ndarray, stop: np.ndarray, groups: _Groups
                 ) -> Tuple[np.ndarray, "_NeederSets"]:
    """Each item's needer set, by number (its group's where one group needs it, as mostly), and
    the sets."""
    one = stop - cut == 1
    sets = np.where(one, group[cut], -1)
    numbers: Dict[Tuple[int, ...], int] = {}
    for k in np.flatnonzero(~one).tolist():
        sets[k] = numbers.setdefault(tuple(group[cut[k]:stop[k]].tolist()), len(groups.count) + len(numbers))
    return sets, _NeederSets(groups, {number: key for key, number in numbers.items()})


class _NeederSets(dict):
    """The ranks of each needer set by number, made when first asked (a rank deals the sets linked
    to its own alone): group g's holders are set g; sets of several groups (`several`: their
    groups) are numbered after the groups, and sets of ranks added later (`_able_sets`) after those."""

    def __init__(self, groups: _Groups, several: Dict[int, Tuple[int, ...]]):
        super().__init__()
        self.groups, self.several = groups, several
        self.grouped = self.numbered = len(groups.count) + len(several)  # the sets of groups; all

    def __missing__(self, number: int) -> Tuple[int, ...]:
        ranks = self[number] = self.groups.ranks(self.several.get(number, (number,)))
        return ranks

    def add(self, ranks: Tuple[int, ...]) -> int:
        """A set of ranks, numbered after the others: its number."""
        self[self.numbered] = ranks
        self.numbered += 1
        return self.numbered - 1

    def holding(self, rank: int) -> List[int]:
        """The numbers of the sets of groups that `rank` is in."""
        runs = self.groups.runs
        mine = set(runs.group[runs.spans_of(rank)].tolist())
        return sorted(mine) + [n for n, groups in self.several.items() if not mine.isdisjoint(groups)]

    def members(self, numbers: List[int]) -> Tuple[np.ndarray, np.ndarray]:
        """Every rank of sets `numbers` (ascending), on arrays: each one's position in `numbers`,
        and the rank."""
        grouped = int(np.searchsorted(numbers, self.grouped))  # the sets of groups come first
        lists = [self.several.get(n, (n,)) for n in numbers[:grouped]]
        of = np.repeat(np.arange(grouped), [len(g) for g in lists])
        group = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=len(of))
        added = [self[n] for n in numbers[grouped:]]
        of = np.concatenate([np.repeat(of, self.groups.size[group]),
                             np.repeat(np.arange(grouped, len(numbers)), list(map(len, added)))])
        ranks = np.concatenate([self.groups.runs.ranks_holding(group),
                                np.fromiter(itertools.chain.from_iterable(added), dtype=np.int64)])
        return of, ranks
