"""The save plan, as a pure function of every rank's specs (no tensors, no processes, no I/O):
every distinct box is assigned to exactly one of the ranks holding it, balancing bytes; file
names and byte offsets are fixed here.

At scale there are millions of boxes, most of them held by one rank alone (optimizer shards):
those are planned on arrays (`SpecTable`'s columns), and only the boxes several ranks hold
(data-parallel replicas' weights) one by one. The plan keeps its writes as columns too; each
rank's `WriteItem`s and the metadata's `StoredBox`es are built when asked for (a rank builds its
own; the coordinator the metadata, at its first commit)."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .format import (CAST_DTYPES, DATA_DIR, MODEL, STORABLE_DTYPES, Metadata, StoredBox, TensorMeta, chunk_bytes_for,
                     dtype_from_name, master_key)
from .fragment import Box
from .gcpause import gc_paused
from .hostmem import DIRECT_MIN, PAGE
from .packing import aligned, spans
from .plan import LeastLoaded, TensorSpec
from .runs import Run, RunGroups, distinct_rows, runs_of
from .sorting import firsts, lexsorted
from .spec_table import SpecTable

ITEM_ALIGN = 64  # every item starts 64-byte aligned: typed views stay aligned
PAGE_ITEM_BYTES = DIRECT_MIN  # items this big start page aligned: loads read them with O_DIRECT (<= 0.4% padding)
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
    order, file, offset = placement(np.zeros(len(sizes), dtype=np.int64), sizes, len(names))
    placed: List[Placement] = [Placement("", 0)] * len(sizes)
    used: Dict[str, int] = {}
    for i, f, o in zip(order.tolist(), file.tolist(), offset.tolist()):
        placed[i] = Placement(names[f], o)
        used[names[f]] = o + int(sizes[i])
    return placed, used


def placement(rank: np.ndarray, nbytes: np.ndarray, files: int) -> Tuple[np.ndarray, ...]:
    """Each rank's items over its `files` files: biggest first, dealt out back and forth (0, 1,
    .., files - 1, files - 1, .., 0, ...), one after the other in each file, 64-byte aligned
    (page aligned from `PAGE_ITEM_BYTES`). Returns the items' order (rank by rank, file by file,
    offset by offset), and in that order their file (index among the rank's) and offset."""
    by_size = lexsorted((-nbytes, rank))
    ranks = rank[by_size]
    nth = np.arange(len(ranks)) - firsts(ranks)  # each item's place among its rank's
    turn, seat = np.divmod(nth, files)
    dealt = np.where(turn % 2 == 0, seat, files - 1 - seat)
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
    shared = _shared(table, rows, runs, keys, live, box, np.flatnonzero(kept & ~alone), nbytes)
    assigned: Dict[int, _RankWrites] = defaultdict(_RankWrites)
    _assign(_pieces(shared, assigned, load), assigned, load)
    every = Writes.joined([single, _RankWrites.table(assigned, table.offsets.shape[1])])
    order, file, offset = placement(every.rank, every.nbytes, files_per_rank)
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
        _, first, of = np.unique(table.digest[:, 0], return_index=True, return_inverse=True)
        of = of.reshape(-1)
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


class _Holding(NamedTuple):
    """A distinct box as one run holds it: the run's start in each holding rank's list, and the
    box's index in the run."""
    starts: Dict[int, int]
    index: int


class _Box:
    """A distinct stored box that several ranks hold (or one holds twice): its bytes and the runs
    holding it."""
    __slots__ = ("nbytes", "holdings")

    def __init__(self, nbytes: int, holdings: List[_Holding]):
        self.nbytes, self.holdings = nbytes, holdings


def _shared(table: SpecTable, rows: _Rows, runs: RunGroups, keys: _Keys, live: np.ndarray, box: np.ndarray,
            shared: np.ndarray, nbytes: np.ndarray) -> Dict[Tuple[int, Box], _Box]:
    """The distinct boxes `shared` (numbers among `box`'s, the rows `live`'s), one by one, each
    with the runs holding it (a run holding it twice: the first)."""
    order, bounds = runs.holders
    starts: Dict[int, Dict[int, int]] = {}

    def held(g: int) -> Dict[int, int]:
        out = starts.get(g)
        if out is None:
            group = order[bounds[g]:bounds[g + 1]]
            out = starts[g] = dict(zip(runs.rank[group].tolist(), runs.start[group].tolist()))
        return out

    wanted = np.zeros(len(nbytes), dtype=bool)
    wanted[shared] = True
    mine = np.flatnonzero(wanted[box])
    by_box = mine[np.argsort(box[mine], kind="stable")]
    lows, highs = np.searchsorted(box[by_box], np.stack([shared, shared + 1])).tolist()
    at = live[by_box]
    group, index, key, ndim = (a[at].tolist() for a in (rows.group, rows.index, keys.number, table.ndim))
    offsets, lengths = table.offsets[at].tolist(), table.lengths[at].tolist()
    out: Dict[Tuple[int, Box], _Box] = {}
    for b, lo, hi in zip(nbytes[shared].tolist(), lows, highs):
        if hi - lo == 1:
            holdings = [_Holding(held(group[lo]), index[lo])]
        else:
            holdings, seen = [], set()
            for i in range(lo, hi):
                if group[i] not in seen:
                    seen.add(group[i])
                    holdings.append(_Holding(held(group[i]), index[i]))
        n = ndim[lo]
        out[key[lo], (tuple(offsets[lo][:n]), tuple(lengths[lo][:n]))] = _Box(b, holdings)
    return out


class _Piece(NamedTuple):
    """What one writer writes: a box, or a row range of a big replicated one."""
    key: int
    box: Box
    nbytes: int
    holdings: List[_Holding]  # those of the box it is (a part of)
    ranks: Tuple[int, ...]
    holders: int  # a number naming the set `ranks` (`LeastLoaded.deal`)


def _pieces(boxes: Dict[Tuple[int, Box], _Box], assigned: Dict[int, "_RankWrites"], load: LeastLoaded) -> List[_Piece]:
    """The replicated boxes as writers write them: those big enough are cut into row ranges, so
    several holders write them in parallel. A box one rank alone holds goes to that rank here."""
    holder_sets: Dict[Tuple[int, ...], Tuple[Tuple[int, ...], int]] = {}  # by the runs holding a box
    pieces: List[_Piece] = []
    for box, entry in boxes.items():
        nbytes, holdings = entry.nbytes, entry.holdings
        by_runs = tuple(id(h.starts) for h in holdings)
        held = holder_sets.get(by_runs)
        if held is None:
            held = holder_sets[by_runs] = tuple(r for h in holdings for r in h.starts), len(holder_sets)
        ranks, holders = held
        if len(ranks) == 1:
            rank, (starts, index) = ranks[0], holdings[0]
            assigned[rank].add(starts[rank] + index, box[0], box[1], nbytes)
            load.add(rank, nbytes)
            continue
        key, (offs, lens) = box
        n = min(len(ranks), nbytes // SPLIT_BYTES, lens[0] if lens else 1)
        if n < 2:
            pieces.append(_Piece(key, box[1], nbytes, holdings, ranks, holders))
            continue
        row_bytes = nbytes // lens[0]
        for i in range(n):
            lo, hi = lens[0] * i // n, lens[0] * (i + 1) // n
            pieces.append(_Piece(key, ((offs[0] + lo,) + offs[1:], (hi - lo,) + lens[1:]), (hi - lo) * row_bytes,
                                 holdings, ranks, holders))
    return pieces


@dataclass
class _RankWrites:
    """What one rank writes of the replicated boxes: its spec index, key, box and size per write."""
    indices: List[int] = field(default_factory=list)
    keys: List[int] = field(default_factory=list)
    boxes: List[Box] = field(default_factory=list)
    sizes: List[int] = field(default_factory=list)

    def add(self, index: int, key: int, box: Box, nbytes: int) -> None:
        self.indices.append(index)
        self.keys.append(key)
        self.boxes.append(box)
        self.sizes.append(nbytes)

    @staticmethod
    def table(assigned: Dict[int, "_RankWrites"], width: int) -> Writes:
        """Every rank's, by column (boxes padded to `width` dimensions)."""
        ranks = [r for r, w in assigned.items() for _ in w.sizes]
        boxes = [b for w in assigned.values() for b in w.boxes]
        offsets, lengths = np.zeros((len(boxes), width), dtype=np.int64), np.ones((len(boxes), width), dtype=np.int64)
        for i, (offs, lens) in enumerate(boxes):
            offsets[i, :len(offs)], lengths[i, :len(lens)] = offs, lens
        column = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
        return Writes(column(ranks), column([i for w in assigned.values() for i in w.indices]),
                      column([k for w in assigned.values() for k in w.keys]), np.zeros(len(boxes), dtype=np.int64),
                      np.zeros(len(boxes), dtype=np.int64), column([s for w in assigned.values() for s in w.sizes]),
                      offsets, lengths)


def _assign(pieces: List[_Piece], assigned: Dict[int, _RankWrites], load: LeastLoaded) -> None:
    """Each piece to the least-loaded rank holding it, biggest first (into `assigned` and `load`)."""
    pieces = sorted(pieces, key=lambda p: (-p.nbytes, p.key, p.box))
    ranks = load.deal([p.holders for p in pieces], [p.nbytes for p in pieces], {p.holders: p.ranks for p in pieces})
    for piece, rank in zip(pieces, ranks):
        index = next(h.starts[rank] + h.index for h in piece.holdings if rank in h.starts)
        assigned[rank].add(index, piece.key, piece.box, piece.nbytes)
