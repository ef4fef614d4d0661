"""Planning, as pure functions of descriptions (no tensors, no processes, no I/O).

Save plan: every distinct box is assigned to exactly one of the ranks holding it, balancing
bytes; file names and byte offsets are fixed here. Load plan: each wanted box is intersected
with the stored boxes; every intersection becomes a byte-range read plus a copy.
"""
from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .errors import LoadMismatchError
from .gcpause import gc_paused
from .format import (CAST_DTYPES, DATA_DIR, MODEL, Metadata, StoredBox, TensorMeta, chunk_bytes_for,
                     dtype_from_name, dtype_name, master_key)
from .fragment import Box, Shape, flat_offset, intersect
from .hostmem import DIRECT_MIN, PAGE
from .runs import Run, run_groups, runs_of


@dataclass(frozen=True)
class TensorSpec:
    """What a fragment is, without its memory: the unit planning works on."""
    key: str
    shape: Shape  # global shape
    dtype: str
    offsets: Shape
    lengths: Shape
    sources: Tuple[str, ...] = ()  # load only: see Fragment
    cast: bool = False

    @property
    def box(self) -> Box:
        return self.offsets, self.lengths

    @property
    def nbytes(self) -> int:
        return math.prod(self.lengths) * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class WriteItem:
    index: int  # position in the rank's list of tensor specs
    box: Box  # the part of that spec's box to write (all of it, or a row range)
    file: str
    offset: int


@dataclass
class SavePlan:
    writes: List[List[WriteItem]]  # per rank
    stored: List[List[StoredBox]]  # per rank, the metadata entry of each write (checksums at commit)
    metadata: Metadata  # tensors and files; objects and checksums are added at commit
    rank_bytes: List[int]

    @property
    def balance(self) -> float:
        """max / mean bytes written per rank (1.0 is perfect)."""
        mean = sum(self.rank_bytes) / len(self.rank_bytes)
        return max(self.rank_bytes) / mean if mean else 1.0


ITEM_ALIGN = 64  # every item starts 64-byte aligned: typed views stay aligned
PAGE_ITEM_BYTES = DIRECT_MIN  # items this big start page aligned: loads read them with O_DIRECT (<= 0.4% padding)
SPLIT_BYTES = 16 << 20  # replicated boxes are split into row ranges of at least this many bytes


class Placement(NamedTuple):
    file: str
    offset: int


def place(sizes: Sequence[int], names: Sequence[str]) -> Tuple[List[Placement], Dict[str, int]]:
    """Spread items over files, biggest first onto the least-filled; fixes every byte offset."""
    heap = [(0, i) for i in range(len(names))]
    placed: List[Placement] = [Placement("", 0)] * len(sizes)
    used: Dict[str, int] = {}
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fill, f = heapq.heappop(heap)
        align = PAGE if sizes[index] >= PAGE_ITEM_BYTES else ITEM_ALIGN
        start = -(-fill // align) * align
        placed[index] = Placement(names[f], start)
        used[names[f]] = start + sizes[index]
        heapq.heappush(heap, (start + sizes[index], f))
    return placed, used


def assign_objects(held: Sequence[Sequence[str]]) -> List[List[str]]:
    """Which replicated objects each rank writes (`held[rank]`: the keys it holds): each key once,
    by the first rank holding it (a pipeline stage's objects are held by its ranks alone)."""
    taken, out = set(), []
    for keys in held:
        mine = [k for k in keys if k not in taken]
        taken.update(mine)
        out.append(mine)
    return out


def data_file_names(rank: int, count: int) -> List[str]:
    return [f"{DATA_DIR}/r{rank}-{i}.bin" for i in range(count)]


def spec_runs(specs: Sequence[TensorSpec]) -> List[Run]:
    return runs_of([s.key for s in specs], specs)


class _Holding(NamedTuple):
    """A distinct box as one run holds it: the run's start in each holding rank's list, and the
    box's index in the run."""
    starts: Dict[int, int]
    index: int


class _Box:
    """A distinct stored box: its bytes and the runs holding it."""
    __slots__ = ("nbytes", "holdings")

    def __init__(self, nbytes: int, holding: _Holding):
        self.nbytes, self.holdings = nbytes, [holding]


class _Piece(NamedTuple):
    """What one writer writes: a box, or a row range of a big replicated one (`parent`)."""
    key: str
    box: Box
    nbytes: int
    parent: Tuple[str, Box]
    ranks: Tuple[int, ...]


@gc_paused
def plan_save(tensors: Sequence[Sequence[TensorSpec]], files_per_rank: int = 1,
              aliases: Optional[Dict[str, str]] = None, digests: Optional[Sequence] = None,
              casts: bool = False) -> SavePlan:
    """Build the global save plan from every rank's tensor specs (index = rank).

    `digests[rank]`: the rank's `spec_runs` (None: each rank's list its own run); a run's specs
    are read from its first holder alone (others may pass None in their place). Steps: the
    distinct boxes (runs several ranks hold alike, such as data-parallel replicas, are validated
    once); a box one rank alone holds is its to write; big replicated boxes are cut into row
    ranges, each piece assigned to the least-loaded rank holding it (biggest first); then all are
    placed in files. `casts`: every rank found its weights equal to its fp32 masters' cast
    (`casts.masters_cast_exactly`), so the weights whose masters cover them are not written
    (`drop_cast_weights`).
    """
    metas: Dict[str, TensorMeta] = {}
    boxes = _distinct_boxes(tensors, digests, metas)
    derived = drop_cast_weights(metas, boxes) if casts else {}
    assigned, load = [_RankWrites() for _ in tensors], LeastLoaded(len(tensors))
    _assign(_pieces(boxes, assigned, load), boxes, assigned, load)
    plan = _place(assigned, load, metas, files_per_rank, aliases)
    plan.metadata.casts = dict(sorted(derived.items()))
    return plan


def drop_cast_weights(metas: Dict[str, TensorMeta], boxes: Dict[Tuple[str, Box], "_Box"]) -> Dict[str, str]:
    """Drop from `boxes` the 16-bit weights (`model/<name>`) stored as their fp32 master
    (`master_key(name)`) of the same shape, whose distinct boxes cover it exactly; returns them,
    weight key -> master key. One pass over the boxes: there are millions at scale."""
    pairs = {}
    for key, meta in metas.items():
        if key.startswith(MODEL + "/") and meta.dtype in CAST_DTYPES:
            source = master_key(key[len(MODEL) + 1:])
            master = metas.get(source)
            if master is not None and master.dtype == "float32" and master.shape == meta.shape:
                pairs[key] = source
    covered, weight_boxes = dict.fromkeys(pairs.values(), 0), []
    for box in boxes if pairs else ():
        if box[0] in covered:
            covered[box[0]] += math.prod(box[1][1])
        elif box[0] in pairs:
            weight_boxes.append(box)
    derived = {k: m for k, m in pairs.items() if covered[m] == math.prod(metas[m].shape)}
    for box in weight_boxes:
        if box[0] in derived:
            del boxes[box]
    return derived


def _distinct_boxes(tensors: Sequence[Sequence[TensorSpec]], digests: Optional[Sequence],
                    metas: Dict[str, TensorMeta]) -> Dict[Tuple[str, Box], _Box]:
    """Every distinct non-empty box, with the runs holding it; `metas` gets each tensor's shape
    and dtype, checked to agree across ranks."""
    groups = run_groups(digests, [len(specs) for specs in tensors])
    ranks, begins = groups.rank.tolist(), groups.start.tolist()
    order, bounds = (a.tolist() for a in groups.holders())
    boxes: Dict[Tuple[str, Box], _Box] = {}
    itemsize: Dict[str, int] = {}
    for g, k in enumerate(groups.first.tolist()):
        starts = {ranks[s]: begins[s] for s in order[bounds[g]:bounds[g + 1]]}  # the run's start in each holder's list
        leader, begin, end = ranks[k], begins[k], begins[k] + int(groups.count[k])
        specs = tensors[leader]
        _check_specs(specs[begin:end], metas, leader)
        for i in range(begin, end):
            spec = specs[i]
            count = math.prod(spec.lengths)
            if not count:
                continue
            box = (spec.key, (spec.offsets, spec.lengths))
            entry = boxes.get(box)
            if entry is None:
                size = itemsize.get(spec.dtype)
                if size is None:
                    size = itemsize[spec.dtype] = dtype_from_name(spec.dtype).itemsize
                boxes[box] = _Box(count * size, _Holding(starts, i - begin))
            elif entry.holdings[-1].starts is not starts:  # the same box in another run (a rank holds it once)
                entry.holdings.append(_Holding(starts, i - begin))
    return boxes


def _check_specs(specs: Sequence[TensorSpec], metas: Dict[str, TensorMeta], rank: int) -> None:
    """Each spec's box lies inside its tensor, whose shape and dtype agree with other ranks'."""
    for spec in specs:
        meta = metas.get(spec.key)
        if meta is None:
            meta = metas[spec.key] = TensorMeta(spec.shape, spec.dtype)
        elif meta.shape != spec.shape or meta.dtype != spec.dtype:
            raise ValueError(f"{spec.key}: ranks disagree on the tensor: one holds shape {list(meta.shape)} "
                             f"{meta.dtype}, rank {rank} holds shape {list(spec.shape)} {spec.dtype}")
        offsets, lengths = spec.offsets, spec.lengths
        if len(offsets) != len(spec.shape) or len(lengths) != len(offsets) or not all(
                map(operator.le, map(operator.add, offsets, lengths), spec.shape)):
            raise ValueError(f"{spec.key}: rank {rank}'s box {spec.box} lies outside shape {list(spec.shape)}")


def _pieces(boxes: Dict[Tuple[str, Box], _Box], assigned: List["_RankWrites"], load: "LeastLoaded") -> List[_Piece]:
    """The replicated boxes as writers write them: those big enough are cut into row ranges, so
    several holders write them in parallel. A box one rank alone holds (most at scale: optimizer
    shards) goes to that rank here, with no choice to make."""
    holder_sets: Dict[Tuple[int, ...], Tuple[int, ...]] = {}  # by the runs holding a box
    pieces: List[_Piece] = []
    for box, entry in boxes.items():
        nbytes, holdings = entry.nbytes, entry.holdings
        by_runs = tuple(id(h.starts) for h in holdings)
        ranks = holder_sets.get(by_runs)
        if ranks is None:
            ranks = holder_sets[by_runs] = tuple(r for h in holdings for r in h.starts)
        if len(ranks) == 1:
            rank, (starts, index) = ranks[0], holdings[0]
            assigned[rank].add(starts[rank] + index, box[0], box[1], nbytes)
            load.add(rank, nbytes)
            continue
        key, (offs, lens) = box
        n = min(len(ranks), nbytes // SPLIT_BYTES, lens[0] if lens else 1)
        if n < 2:
            pieces.append(_Piece(key, box[1], nbytes, box, ranks))
            continue
        row_bytes = nbytes // lens[0]
        for i in range(n):
            lo, hi = lens[0] * i // n, lens[0] * (i + 1) // n
            pieces.append(_Piece(key, ((offs[0] + lo,) + offs[1:], (hi - lo,) + lens[1:]), (hi - lo) * row_bytes,
                                 box, ranks))
    return pieces


@dataclass
class _RankWrites:
    """What one rank writes, before placement in files: its spec index, key, box and size per write."""
    indices: List[int] = field(default_factory=list)
    keys: List[str] = field(default_factory=list)
    boxes: List[Box] = field(default_factory=list)
    sizes: List[int] = field(default_factory=list)

    def add(self, index: int, key: str, box: Box, nbytes: int) -> None:
        self.indices.append(index)
        self.keys.append(key)
        self.boxes.append(box)
        self.sizes.append(nbytes)


def _assign(pieces: List[_Piece], boxes: Dict[Tuple[str, Box], _Box], assigned: List[_RankWrites],
            load: "LeastLoaded") -> None:
    """Each piece to the least-loaded rank holding it, biggest first (into `assigned` and `load`)."""
    for piece in sorted(pieces, key=lambda p: (-p.nbytes, p.key, p.box)):
        rank = load.pick(piece.ranks)
        index = next(h.starts[rank] + h.index for h in boxes[piece.parent].holdings if rank in h.starts)
        assigned[rank].add(index, piece.key, piece.box, piece.nbytes)
        load.add(rank, piece.nbytes)


def _place(assigned: List[_RankWrites], load: "LeastLoaded",
           metas: Dict[str, TensorMeta], files_per_rank: int, aliases: Optional[Dict[str, str]]) -> SavePlan:
    """Files and byte offsets of every rank's writes, and the metadata's stored boxes."""
    writes: List[List[WriteItem]] = []
    stored: List[List[StoredBox]] = []
    files: Dict[str, int] = {}
    for rank, mine in enumerate(assigned):
        placed, used = place(mine.sizes, data_file_names(rank, files_per_rank))
        files.update(used)
        items, entries = [], []
        for index, key, box, nbytes, (f, o) in zip(mine.indices, mine.keys, mine.boxes, mine.sizes, placed):
            items.append(WriteItem(index, box, f, o))
            entry = StoredBox(file=f, offset=o, nbytes=nbytes, crc32c=[], offsets=box[0], lengths=box[1])
            metas[key].boxes.append(entry)
            entries.append(entry)
        writes.append(items)
        stored.append(entries)
    for meta in metas.values():
        meta.boxes.sort(key=lambda b: b.offsets)
    metadata = Metadata(tensors=dict(sorted(metas.items())), objects={}, files=dict(sorted(files.items())),
                        aliases=dict(aliases or {}), world_size=len(assigned),
                        chunk_bytes=chunk_bytes_for(sum(load.load)))
    return SavePlan(writes=writes, stored=stored, metadata=metadata, rank_bytes=load.load)


# ---------------------------------------------------------------------------- load


@dataclass
class Copy:
    target: int  # index into the wanted specs
    region: Box  # global coordinates


@dataclass
class ReadItem:
    """One byte-range read of a stored box, verified chunk by chunk, feeding several copies."""
    key: str
    stored: StoredBox
    start: int  # byte offset inside the stored box, chunk aligned
    end: int
    copies: List[Copy] = field(default_factory=list)


@dataclass
class LoadPlan:
    reads: List[ReadItem]
    missing: List[str]  # wanted keys the checkpoint lacks

    @property
    def read_bytes(self) -> int:
        return sum(r.end - r.start for r in self.reads)


def box_difference(box: Box, cut: Box) -> List[Box]:
    """`box` minus `cut` (which lies inside it), as at most 2*ndim disjoint boxes."""
    out = []
    offs, lens = list(box[0]), list(box[1])
    for d, (co, cl) in enumerate(zip(*cut)):
        lo, hi = offs[d], offs[d] + lens[d]
        if co > lo:
            out.append((tuple(offs[:d]) + (lo,) + tuple(offs[d + 1:]),
                        tuple(lens[:d]) + (co - lo,) + tuple(lens[d + 1:])))
        if co + cl < hi:
            out.append((tuple(offs[:d]) + (co + cl,) + tuple(offs[d + 1:]),
                        tuple(lens[:d]) + (hi - co - cl,) + tuple(lens[d + 1:])))
        offs[d], lens[d] = co, cl
    return out


def resolve_key(metadata: Metadata, key: str) -> str:
    return metadata.aliases.get(key, key)


def candidate_keys(spec: TensorSpec) -> Tuple[str, ...]:
    """Every stored key that may fill `spec`, in order of preference."""
    return (spec.key,) + tuple(spec.sources)


# Conversions that lose nothing: a bf16 checkpoint fills an fp32 model exactly.
EXACT_WIDENING = {("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float64"),
                  ("float16", "float64"), ("float32", "float64")}


def choose_source(metadata: Metadata, spec: TensorSpec) -> Optional[str]:
    """The stored key that fills `spec`: the first candidate of the wanted dtype, else the first
    that widens to it exactly, else (when the spec allows a cast) the first present; None when no
    candidate is stored. A weight stored as its master's cast is a candidate of its own dtype,
    filled from the master (never widened: that would give the master's values, not the weight's)."""
    casts = metadata.casts
    present = [(metadata.tensors[r].dtype, casts.get(r, r), r) for r in
               (resolve_key(metadata, k) for k in candidate_keys(spec)) if r in metadata.tensors]
    if not present:
        return None
    for dtype, key, _ in present:
        if dtype == spec.dtype:
            return key
    for dtype, key, name in present:
        if key == name and (dtype, spec.dtype) in EXACT_WIDENING:
            return key
    if spec.cast:
        return present[0][1]
    found = ", ".join(f"{name} is {d}" for d, _, name in present)
    raise LoadMismatchError(f"{spec.key}: the model wants {spec.dtype}, but the checkpoint holds no "
                            f"{spec.dtype} copy ({found}); convert the model or the checkpoint")


@gc_paused
def plan_load(metadata: Metadata, wanted: Sequence[TensorSpec]) -> LoadPlan:
    """Reads and copies that fill every wanted box; raises LoadMismatchError on any misfit.

    Checks shapes, dtypes and coverage for everything before anything is read.
    """
    reads: Dict[Tuple[str, int], ReadItem] = {}
    missing: List[str] = []
    itemsizes = {}
    for target, spec in enumerate(wanted):
        stored_key = choose_source(metadata, spec)
        if stored_key is None:
            missing.append(spec.key)
            continue
        meta = metadata.tensors[stored_key]
        if tuple(meta.shape) != tuple(spec.shape):
            via = "" if stored_key == spec.key else f" (as {stored_key})"
            raise LoadMismatchError(f"{spec.key}: checkpoint holds shape {list(meta.shape)}{via}, the model "
                                    f"wants {list(spec.shape)}")
        itemsize = itemsizes.setdefault(meta.dtype, dtype_from_name(meta.dtype).itemsize)
        needed = [spec.box] if math.prod(spec.lengths) else []
        for b, stored in enumerate(meta.boxes):
            if not needed:
                break
            remaining = []
            for piece in needed:
                region = intersect(piece, (stored.offsets, stored.lengths))
                if region is None:
                    remaining.append(piece)
                    continue
                read = reads.setdefault((stored_key, b), ReadItem(stored_key, stored, stored.nbytes, 0))
                read.copies.append(Copy(target, region))
                rel = tuple(o - so for o, so in zip(region[0], stored.offsets))
                last = tuple(r + n - 1 for r, n in zip(rel, region[1]))
                read.start = min(read.start, flat_offset(stored.lengths, rel) * itemsize)
                read.end = max(read.end, (flat_offset(stored.lengths, last) + 1) * itemsize)
                remaining += box_difference(piece, region)
            needed = remaining
        if needed:
            offs, lens = needed[0]
            raise LoadMismatchError(
                f"{spec.key}: no stored box covers region offsets {list(offs)} lengths {list(lens)} "
                f"(the checkpoint stores {len(meta.boxes)} box(es) of shape {list(meta.shape)})")
    chunk = metadata.chunk_bytes
    for read in reads.values():
        read.start = read.start // chunk * chunk
        read.end = min(-(-read.end // chunk) * chunk, read.stored.nbytes)
    return LoadPlan(reads=list(reads.values()), missing=missing)


class LeastLoaded:
    """Byte counts per rank, and the least-loaded rank of a rank set (ties: the lowest rank).

    One heap per distinct rank set (a box's holders are usually a whole data-parallel group, so
    there are few sets). Loads only grow, so a heap entry whose recorded load is stale is
    refreshed when it surfaces: each pick costs O(log n) instead of a scan of the set.
    """

    def __init__(self, world: int):
        self.load = [0] * world
        self._by_ranks: Dict[Tuple[int, ...], List[Tuple[int, int]]] = {}
        self._by_name: Dict[int, List[Tuple[int, int]]] = {}

    def add(self, rank: int, nbytes: int) -> None:
        self.load[rank] += nbytes

    def pick(self, ranks: Tuple[int, ...], name: Optional[int] = None) -> int:
        """`name`: a number naming the set instead of its ranks (cheaper to look up)."""
        heaps, key = (self._by_ranks, ranks) if name is None else (self._by_name, name)
        heap = heaps.get(key)
        if heap is None:
            heap = heaps[key] = [(self.load[r], r) for r in ranks]
            heapq.heapify(heap)
        while heap[0][0] != self.load[heap[0][1]]:
            heapq.heapreplace(heap, (self.load[heap[0][1]], heap[0][1]))
        return heap[0][1]


def specs_of(fragments) -> List[TensorSpec]:
    """The TensorSpecs of fragments: what planning needs of them, without their memory."""
    return [TensorSpec(f.key, tuple(f.global_shape), dtype_name(f.dtype), tuple(f.offsets), tuple(f.lengths),
                       tuple(f.sources), f.cast)
            for f in fragments]
