"""The save plan, as a pure function of every rank's specs (no tensors, no processes, no I/O):
every distinct box is assigned to exactly one of the ranks holding it, balancing bytes; file
names and byte offsets are fixed here.

At scale there are millions of boxes, most of them held by one rank alone (optimizer shards):
all are planned on arrays (`SpecTable`'s columns); only the dealing of the boxes several ranks
hold (data-parallel replicas' weights) to the least loaded of them goes one by one. The plan
keeps its writes as columns too; each rank's `WriteItem`s and the metadata's `StoredBox`es are
built when asked for (a rank builds its own; the coordinator the metadata, at its first commit)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .format import (CAST_DTYPES, DATA_DIR, MODEL, STORABLE_DTYPES, Metadata, StoredBox, TensorMeta, chunk_bytes_for,
                     dtype_from_name, master_key)
from .fragment import Box
from .engine.write import PIECE
from .gcpause import gc_paused
from .hostmem import DIRECT_MIN, PAGE
from .packing import aligned, spans
from .plan import LeastLoaded, TensorSpec
from .runs import Run, RunGroups, distinct_rows, runs_of
from .sorting import distinct, firsts, lexsorted
from .spec_table import SpecTable

ITEM_ALIGN = 64  # every item starts 64-byte aligned: typed views stay aligned
PAGE_ITEM_BYTES = DIRECT_MIN  # items this big start page aligned: loads read them with O_DIRECT (<= 0.4% padding)
# a rank saving less than this in all writes one data file: its writers would each write less than
# one write call's piece, and more files cost only more opens and fsyncs
SPREAD_BYTES = PIECE
SPLIT_BYTES = 16 << 20  # replicated boxes are split into row ranges of at least this many bytes
_ITEMSIZE = np.array([dtype_from_name(name).itemsize for name in STORABLE_DTYPES], dtype=np.int64)


@dataclass(frozen=True)
class WriteItem:
    index: int  # position in the rank's list of tensor specs
    box: Box  # the part of that spec's box to write (all of it, or a row range)
    file: str
    offset: int


class Placement(NamedTuple):
    file: str
    offset: int


def data_file_names(rank: int, count: int) -> List[str]:
    return [f"{DATA_DIR}/r{rank}-{i}.bin" for i in range(count)]


def spec_runs(specs: Sequence[TensorSpec]) -> List[Run]:
    return runs_of([s.key for s in specs], specs)


def place(sizes: Sequence[int], names: Sequence[str]) -> Tuple[List[Placement], Dict[str, int]]:
    """Spread items over the files `names` (`placement`); their places, and each used file's size."""
    sizes = np.asarray(sizes, dtype=np.int64)
    order, file, offset = placement(np.zeros(len(sizes), dtype=np.int64), sizes, len(names), 0)
    placed: List[Placement] = [Placement("", 0)] * len(sizes)
    used: Dict[str, int] = {}
    for i, f, o in zip(order.tolist(), file.tolist(), offset.tolist()):
        placed[i] = Placement(names[f], o)
        used[names[f]] = o + int(sizes[i])
    return placed, used


def placement(rank: np.ndarray, nbytes: np.ndarray, files: int, spread: int) -> Tuple[np.ndarray, ...]:
    """Each rank's items over its `files` files: biggest first, dealt out back and forth (0, 1,
    .., files - 1, files - 1, .., 0, ...), or all in its first file when they add up to less than
    `spread` bytes; one after the other in each file, 64-byte aligned (page aligned from
    `PAGE_ITEM_BYTES`). Returns the items' order (rank by rank, file by file, offset by offset),
    and in that order their file (index among the rank's) and offset."""
    by_size = lexsorted((-nbytes, rank))
    ranks = rank[by_size]
    nth = np.arange(len(ranks)) - firsts(ranks)  # each item's place among its rank's
    turn, seat = np.divmod(nth, files)
    dealt = np.where(turn % 2 == 0, seat, files - 1 - seat)
    if len(ranks):
        dealt[np.bincount(rank, weights=nbytes)[ranks] < spread] = 0
    within = lexsorted((nth, dealt, ranks))
    order, file = by_size[within], dealt[within]
    sizes = nbytes[order]
    align = np.where(sizes >= PAGE_ITEM_BYTES, PAGE, ITEM_ALIGN)
    padded = -(-sizes // align) * align
    ends = np.cumsum(padded)
    segment = rank[order] * files + file
    first = firsts(segment)  # each item's file's first item
    return order, file, ends - padded - (ends - padded)[first]


def assign_objects(held: Sequence[Sequence[str]]) -> List[List[str]]:
    """Which replicated objects each rank writes (`held[rank]`: the keys it holds): each key once,
    by the first rank holding it (a pipeline stage's objects are held by its ranks alone)."""
    taken, out = set(), []
    for keys in held:
        mine = [k for k in keys if k not in taken]
        taken.update(mine)
        out.append(mine)
    return out


@dataclass
class Writes:
    """Every write by column, rank by rank, each rank's file by file and offset by offset: its
    spec index in its rank's list, tensor key (index in `SavePlan.keys`), file (index among its
    rank's `data_file_names`), offset, bytes and box ((writes, dims) arrays, padded)."""
    rank: np.ndarray
    index: np.ndarray
    key: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    def take(self, rows: np.ndarray) -> "Writes":
        return Writes(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))

    @classmethod
    def joined(cls, parts: Sequence["Writes"]) -> "Writes":
        """`parts` one after the other (their boxes padded alike)."""
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls.__dataclass_fields__))


@dataclass
class SavePlan:
    """The global plan: every write (`table`), the tensors' keys, shapes and dtypes (by key
    index), the bytes each rank writes; the data files' sizes (`files`), each rank's `WriteItem`s
    (`writes`, `packed`) and the metadata with a `StoredBox` per write (`stored`, `metadata`:
    checksums are added at commit) are built when first asked for."""
    table: Writes
    keys: List[str]
    shapes: List[Tuple[int, ...]]
    dtypes: List[str]
    rank_bytes: List[int]
    files_per_rank: int
    aliases: Dict[str, str] = field(default_factory=dict)
    casts: Dict[str, str] = field(default_factory=dict)

    @cached_property
    def balance(self) -> float:
        """max / mean bytes written per rank (1.0 is perfect). Cached, as `chunk_bytes`: each
        rank's reply carries both."""
        mean = sum(self.rank_bytes) / len(self.rank_bytes)
        return max(self.rank_bytes) / mean if mean else 1.0

    @cached_property
    def files(self) -> Dict[str, int]:
        """Each data file's size."""
        t = self.table
        segment = t.rank * self.files_per_rank + t.file
        last = np.flatnonzero(np.append(segment[1:] != segment[:-1], True)) if len(segment) else segment
        return {f"{DATA_DIR}/r{r}-{f}.bin": e for r, f, e in zip(t.rank[last].tolist(), t.file[last].tolist(),
                                                                 (t.offset[last] + t.nbytes[last]).tolist())}

    @cached_property
    def chunk_bytes(self) -> int:
        """The checkpoint's checksum chunk (`format.chunk_bytes_for`)."""
        return chunk_bytes_for(sum(self.rank_bytes))

    @cached_property
    def _bounds(self) -> np.ndarray:
        return np.searchsorted(self.table.rank, np.arange(len(self.rank_bytes) + 1))

    @cached_property
    def _rows(self) -> np.ndarray:
        """Every write as `packed` sends it: spec index, file, offset, dimensions, box."""
        t = self.table
        ndim = np.array([len(s) for s in self.shapes], dtype=np.int64)[t.key]
        return np.ascontiguousarray(np.column_stack([t.index, t.file, t.offset, ndim, t.offsets, t.lengths]),
                                    dtype=np.int64)

    def packed(self, rank: int) -> bytes:
        """`rank`'s writes, as its plan reply carries them (`writes_of` reads them)."""
        lo, hi = self._bounds[rank:rank + 2].tolist()
        header = np.array([hi - lo, self.table.offsets.shape[1], self.files_per_rank], dtype=np.int64)
        return aligned(header.tobytes(), self._rows[lo:hi].tobytes())

    @cached_property
    def writes(self) -> List[List[WriteItem]]:
        """Each rank's writes."""
        return [writes_of(self.packed(rank), rank) for rank in range(len(self.rank_bytes))]

    @property
    def stored(self) -> List[List[StoredBox]]:
        """Per rank, the metadata entry of each of its writes (in `writes` order)."""
        return self._built[0]

    @property
    def metadata(self) -> Metadata:
        """Tensors and files; objects and checksums are added at commit."""
        return self._built[1]

    @cached_property
    @gc_paused  # millions of objects, which live on: collections while they are made would scan them all
    def _built(self) -> Tuple[List[List[StoredBox]], Metadata]:
        t, names = self.table, {}
        tensors = {k: TensorMeta(self.shapes[i], self.dtypes[i]) for i, k in enumerate(self.keys)}
        metas = [tensors[k] for k in self.keys]
        ndims = [len(s) for s in self.shapes]
        stored: List[List[StoredBox]] = [[] for _ in self.rank_bytes]
        entries = []
        keys = t.key.tolist()
        for rank, key, file, offset, nbytes, offsets, lengths in zip(
                t.rank.tolist(), keys, (t.rank * self.files_per_rank + t.file).tolist(), t.offset.tolist(),
                t.nbytes.tolist(), t.offsets.tolist(), t.lengths.tolist()):
            name = names.get(file)
            if name is None:
                name = names[file] = f"{DATA_DIR}/r{rank}-{file % self.files_per_rank}.bin"
            n = ndims[key]
            entry = StoredBox(name, offset, nbytes, [], 0, [], False, tuple(offsets[:n]), tuple(lengths[:n]))
            stored[rank].append(entry)
            entries.append(entry)
        for i in lexsorted([t.offsets[:, d] for d in reversed(range(t.offsets.shape[1]))] + [t.key]).tolist():
            metas[keys[i]].boxes.append(entries[i])
        metadata = Metadata(tensors=dict(sorted(tensors.items())), objects={}, files=dict(sorted(self.files.items())),
                            aliases=dict(self.aliases), world_size=len(self.rank_bytes),
                            chunk_bytes=self.chunk_bytes, casts=dict(sorted(self.casts.items())))
        return stored, metadata


def writes_of(packed: bytes, rank: int) -> List[WriteItem]:
    """A rank's `WriteItem`s from `SavePlan.packed`."""
    count, width, files = np.frombuffer(packed, dtype=np.int64, count=3).tolist()
    rows = np.frombuffer(packed, dtype=np.int64, offset=24, count=count * (4 + 2 * width)).reshape(
        count, 4 + 2 * width).tolist()
    names = data_file_names(rank, files)
    return [WriteItem(r[0], (tuple(r[4:4 + r[3]]), tuple(r[4 + width:4 + width + r[3]])), names[r[1]], r[2])
            for r in rows]


@gc_paused
def plan_save(table: SpecTable, runs: RunGroups, files_per_rank: int = 1,
              aliases: Optional[Dict[str, str]] = None, casts: bool = False) -> SavePlan:
    """The global save plan of every rank's specs: `runs` groups every rank's runs (`spec_runs`;
    runs several ranks hold alike, such as data-parallel replicas', are planned once), and
    `table` holds each group's specs once, dealt over its holders (`RunGroups.share`), rank by rank.
    Which holder sent a spec does not change the plan: a rank's own specs keep their order, a rank
    holds a box in one run at most, and choices between holders break ties by rank. Steps: the
    distinct boxes, checked to lie in their tensors, whose shape and dtype every rank agrees on; a
    box one rank alone holds is its to write; big replicated boxes are cut into row ranges, each
    piece assigned to the least-loaded rank holding it (biggest first); then all are placed in
    files. `casts`: every rank found its weights equal to its fp32 masters' cast
    (`casts.masters_cast_exactly`), so the weights whose masters cover them are not written."""
    rows = _Rows.of(table, runs)
    keys = _Keys.of(table, rows)
    count = np.prod(table.lengths, axis=1)  # elements
    live = np.flatnonzero(count > 0)
    box, first = distinct_rows(np.column_stack([keys.number[live], table.offsets[live], table.lengths[live]]))
    first = live[first]  # each distinct box's first row
    nbytes = count[first] * _ITEMSIZE[table.dtype[first]]
    derived = _cast_weights(keys, keys.number[first], count[first]) if casts else {}
    kept = ~np.isin(keys.number[first], list(derived))
    holders = np.bincount(runs.group, minlength=len(runs.first))
    rows_of_box = np.bincount(box, minlength=len(first))
    alone = kept & (rows_of_box == 1) & (holders[rows.group[first]] == 1)
    mine = first[alone]  # boxes one rank alone holds, once: that rank writes them
    single = Writes(rank=rows.rank[mine], index=runs.start[rows.span[mine]] + rows.index[mine], key=keys.number[mine],
                    file=np.zeros(len(mine), dtype=np.int64), offset=np.zeros(len(mine), dtype=np.int64),
                    nbytes=nbytes[alone], offsets=table.offsets[mine], lengths=table.lengths[mine])
    load = LeastLoaded(runs.world, np.bincount(single.rank, weights=single.nbytes,
                                               minlength=runs.world).astype(np.int64))
    shared = _Shared.of(table, rows, runs, keys, live, box, np.flatnonzero(kept & ~alone), nbytes)
    every = Writes.joined([single, shared.writes(load)])
    order, file, offset = placement(every.rank, every.nbytes, files_per_rank, SPREAD_BYTES)
    every = every.take(order)
    every.file, every.offset = file, offset
    return SavePlan(every, keys.names, keys.shapes, keys.dtypes, load.load, files_per_rank,
                    dict(aliases or {}), {keys.names[w]: keys.names[m] for w, m in derived.items()})


@dataclass
class _Rows:
    """What each row of the table is: the span that sent it (a run of a rank holding it, as
    `RunGroups` numbers them), the span's group, its rank, and its index in the run."""
    span: np.ndarray
    group: np.ndarray
    rank: np.ndarray
    index: np.ndarray

    @classmethod
    def of(cls, table: SpecTable, runs: RunGroups) -> "_Rows":
        if len(table.count) != runs.world:
            raise ValueError(f"tensor specs of {len(table.count)} ranks for runs of {runs.world}")
        wanted = runs.share_counts()
        wrong = np.flatnonzero(table.count != wanted)
        if len(wrong):
            raise ValueError(f"rank {wrong[0]} sent {table.count[wrong[0]]} tensor specs for its share of "
                             f"{wanted[wrong[0]]}")
        first, count = runs.shares
        span = np.repeat(np.arange(len(count)), count)
        return cls(span, runs.group[span], runs.rank[span], spans(first, count))


@dataclass
class _Keys:
    """The distinct tensor keys, numbered by digest: each row's (`number`), and each key's name,
    shape and dtype, checked to agree across rows, as each row's box is to lie inside them."""
    number: np.ndarray
    names: List[str]
    shapes: List[Tuple[int, ...]]
    dtypes: List[str]

    @classmethod
    def of(cls, table: SpecTable, rows: _Rows) -> "_Keys":
        of, first = distinct(table.digest[:, 0])
        rep = first[of]
        clash = np.flatnonzero((table.digest[:, 1] != table.digest[rep, 1]) | (table.key_len != table.key_len[rep]))
        if len(clash):
            raise ValueError(f"tensor keys {table.key(clash[0])} and {table.key(rep[clash[0]])} share a digest")
        differ = np.flatnonzero((table.dtype != table.dtype[rep]) | (table.ndim != table.ndim[rep])
                                | (table.shape != table.shape[rep]).any(axis=1))
        if len(differ):
            i, j = int(differ[0]), int(rep[differ[0]])
            raise ValueError(f"{table.key(i)}: ranks disagree on the tensor: one holds shape {_shape(table, j)} "
                             f"{STORABLE_DTYPES[table.dtype[j]]}, rank {rows.rank[i]} holds shape "
                             f"{_shape(table, i)} {STORABLE_DTYPES[table.dtype[i]]}")
        outside = np.flatnonzero((table.box_ndim != table.ndim)
                                 | (table.offsets + table.lengths > table.shape).any(axis=1))
        if len(outside):
            i = int(outside[0])
            box = table.box(i) if table.box_ndim[i] == table.ndim[i] else f"of {table.box_ndim[i]} dimensions"
            raise ValueError(f"{table.key(i)}: rank {rows.rank[i]}'s box {box} lies outside shape {_shape(table, i)}")
        buffer = table.buffer
        return cls(of, [buffer[a:a + n].decode() for a, n in zip(table.key_at[first].tolist(),
                                                                 table.key_len[first].tolist())],
                   [tuple(s[:n]) for s, n in zip(table.shape[first].tolist(), table.ndim[first].tolist())],
                   [STORABLE_DTYPES[d] for d in table.dtype[first].tolist()])


def _shape(table: SpecTable, i: int) -> List[int]:
    return table.shape[i, :table.ndim[i]].tolist()


def _cast_weights(keys: _Keys, box_key: np.ndarray, volume: np.ndarray) -> Dict[int, int]:
    """The 16-bit weights (`model/<name>`) stored as their fp32 master (`master_key(name)`) of the
    same shape, whose distinct boxes (keys `box_key`, `volume` elements each) cover it exactly:
    weight key -> master key, as key numbers."""
    number = {name: i for i, name in enumerate(keys.names)}
    pairs = {}
    for i, name in enumerate(keys.names):
        if name.startswith(MODEL + "/") and keys.dtypes[i] in CAST_DTYPES:
            m = number.get(master_key(name[len(MODEL) + 1:]))
            if m is not None and keys.dtypes[m] == "float32" and keys.shapes[m] == keys.shapes[i]:
                pairs[i] = m
    covered = np.bincount(box_key, weights=volume, minlength=len(keys.names))
    return {w: m for w, m in pairs.items() if covered[m] == math.prod(keys.shapes[m])}


class _HolderSets:
    """The sets of run groups holding a box, numbered as first met: each set's ranks (its groups'
    holders, group by group), and for each rank its first group in the set (`seat`)."""

    def __init__(self, runs: RunGroups):
        self._runs, self._numbers, self._starts = runs, {}, {}
        self.ranks: List[Tuple[int, ...]] = []
        self.seat: List[Dict[int, int]] = []

    def starts(self, group: int) -> Dict[int, int]:
        """Where the group's run starts in each holder's list."""
        out = self._starts.get(group)
        if out is None:
            order, bounds = self._runs.holders
            spans = order[bounds[group]:bounds[group + 1]]
            out = self._starts[group] = dict(zip(self._runs.rank[spans].tolist(), self._runs.start[spans].tolist()))
        return out

    def number(self, groups: Tuple[int, ...]) -> int:
        number = self._numbers.get(groups)
        if number is None:
            number = self._numbers[groups] = len(self.ranks)
            starts = [self.starts(g) for g in groups]
            self.ranks.append(tuple(r for s in starts for r in s))
            self.seat.append({r: j for j in reversed(range(len(starts))) for r in starts[j]})
        return number


@dataclass
class _Shared:
    """The distinct boxes several ranks hold (or one holds twice), by column: tensor key, box,
    bytes and the number of the set of run groups holding it (`_HolderSets`); and its holdings,
    box b's `bounds[b]:bounds[b + 1]`, one per group holding it in the order first met: the
    group, and the box's index in the group's run."""
    key: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    nbytes: np.ndarray
    holders: np.ndarray
    bounds: np.ndarray
    group: np.ndarray
    index: np.ndarray
    sets: _HolderSets

    @classmethod
    def of(cls, table: SpecTable, rows: _Rows, runs: RunGroups, keys: _Keys, live: np.ndarray, box: np.ndarray,
           shared: np.ndarray, nbytes: np.ndarray) -> "_Shared":
        """The distinct boxes `shared` (numbers among `box`'s, the rows `live`'s)."""
        wanted = np.zeros(len(nbytes), dtype=bool)
        wanted[shared] = True
        mine = np.flatnonzero(wanted[box])
        by_box = mine[np.argsort(box[mine], kind="stable")]
        _, first = distinct(box[by_box] * len(runs.first) + rows.group[live[by_box]])
        held = np.sort(first)  # each box's first row in each group holding it
        bounds = np.append(np.searchsorted(box[by_box[held]], shared), len(held))
        held = live[by_box[held]]
        top = held[bounds[:-1]]
        group = rows.group[held]
        sets, b = _HolderSets(runs), bounds.tolist()
        groups = group.tolist()
        holders = np.array([sets.number(tuple(groups[lo:hi])) for lo, hi in zip(b[:-1], b[1:])], dtype=np.int64)
        return cls(keys.number[top], table.offsets[top], table.lengths[top], nbytes[shared], holders, bounds, group,
                   rows.index[held], sets)

    def writes(self, load: LeastLoaded) -> Writes:
        """Each box to the least-loaded rank holding it, biggest first; cut in row ranges where
        big enough, so several holders write it in parallel; a box one rank alone holds to that
        rank, first. Their writes, which `load` counts."""
        count = np.array([len(r) for r in self.sets.ranks], dtype=np.int64)[self.holders]
        lone = np.flatnonzero(count == 1)
        lone_ranks = [self.sets.ranks[h][0] for h in self.holders[lone].tolist()]
        for rank, nbytes in zip(lone_ranks, self.nbytes[lone].tolist()):
            load.add(rank, nbytes)
        of, offsets, lengths, nbytes = self._pieces(np.flatnonzero(count > 1), count)
        order = lexsorted([*lengths.T[::-1], *offsets.T[::-1], self.key[of], -nbytes])
        of, offsets, lengths, nbytes = of[order], offsets[order], lengths[order], nbytes[order]
        names = self.holders[of].tolist()
        ranks = load.deal(names, nbytes.tolist(), self.sets.ranks)
        seats = [self.sets.seat[h][r] for h, r in zip(names, ranks)]
        column = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
        every = np.concatenate([lone, of])
        return Writes(column(lone_ranks + ranks), self._indices(every, lone_ranks + ranks, [0] * len(lone) + seats),
                      self.key[every], np.zeros(len(every), dtype=np.int64), np.zeros(len(every), dtype=np.int64),
                      np.concatenate([self.nbytes[lone], nbytes]), np.concatenate([self.offsets[lone], offsets]),
                      np.concatenate([self.lengths[lone], lengths]))

    def _pieces(self, boxes: np.ndarray, count: np.ndarray) -> Tuple[np.ndarray, ...]:
        """`boxes` as writers write them, each cut in as many row ranges as it has holders, where
        each is at least `SPLIT_BYTES`: each piece's box, offsets, lengths and bytes."""
        cuts = np.minimum(np.minimum(count[boxes], self.nbytes[boxes] // SPLIT_BYTES), self.lengths[boxes, 0])
        cuts = np.where(cuts < 2, 1, cuts)
        of, cut = np.repeat(boxes, cuts), np.repeat(cuts, cuts)
        nth = np.arange(len(of)) - np.repeat(np.cumsum(cuts) - cuts, cuts)
        rows = self.lengths[of, 0]
        lo, hi = rows * nth // cut, rows * (nth + 1) // cut
        offsets, lengths = self.offsets[of], self.lengths[of]
        offsets[:, 0] += lo
        lengths[:, 0] = hi - lo
        return of, offsets, lengths, np.where(cut == 1, self.nbytes[of], (hi - lo) * (self.nbytes[of] // rows))

    def _indices(self, boxes: np.ndarray, ranks: List[int], seats: List[int]) -> np.ndarray:
        """Each box's spec index in `ranks[i]`'s list, which holds it in its holding `seats[i]`."""
        at = self.bounds[boxes] + np.array(seats, dtype=np.int64)
        starts = [self.sets.starts(g)[r] for g, r in zip(self.group[at].tolist(), ranks)]
        return np.array(starts, dtype=np.int64) + self.index[at]
