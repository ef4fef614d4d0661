"""Planning, as pure functions of descriptions (no tensors, no processes, no I/O).

Save plan: every distinct box is assigned to exactly one of the ranks holding it, balancing
bytes; file names and byte offsets are fixed here. Load plan: each wanted box is intersected
with the stored boxes; every intersection becomes a byte-range read plus a copy.
"""
from __future__ import annotations

import hashlib
import heapq
import math
import operator
import pickle
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .errors import LoadMismatchError
from .gcpause import gc_paused
from .format import CHUNK_BYTES, DATA_DIR, Metadata, StoredBox, TensorMeta, dtype_from_name, dtype_name
from .fragment import Box, Shape, flat_offset, intersect
from .hostmem import DIRECT_MIN, PAGE


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


def place(sizes: Sequence[int], names: Sequence[str]) -> Tuple[List[Tuple[str, int]], Dict[str, int]]:
    """Spread items over files, biggest first onto the least-filled; fixes every byte offset."""
    heap = [(0, i) for i in range(len(names))]
    placed: List[Tuple[str, int]] = [("", 0)] * len(sizes)
    used: Dict[str, int] = {}
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fill, f = heapq.heappop(heap)
        align = PAGE if sizes[index] >= PAGE_ITEM_BYTES else ITEM_ALIGN
        start = -(-fill // align) * align
        placed[index] = (names[f], start)
        used[names[f]] = start + sizes[index]
        heapq.heappush(heap, (start + sizes[index], f))
    return placed, used


def data_file_names(rank: int, count: int) -> List[str]:
    return [f"{DATA_DIR}/r{rank}-{i}.bin" for i in range(count)]


def runs_of(keys: Sequence[str], items: Sequence) -> List[Tuple[bytes, int]]:
    """`items` (a rank's specs or read requests, `keys` their tensor keys) as (digest, count) runs
    of one top-level key (`model/`, `optim/`, ...). A run several ranks hold alike (the weights of
    data-parallel replicas, whose optimizer shards differ) is planned once."""
    out: List[Tuple[bytes, int]] = []
    start = 0
    for i in range(1, len(items) + 1):
        if i == len(items) or keys[i].split("/", 1)[0] != keys[start].split("/", 1)[0]:
            out.append((hashlib.sha256(pickle.dumps(list(items[start:i]))).digest(), i - start))
            start = i
    return out


def spec_runs(specs: Sequence[TensorSpec]) -> List[Tuple[bytes, int]]:
    return runs_of([s.key for s in specs], specs)


def _runs(items: Sequence, digest) -> List[Tuple[object, int, int]]:
    """(identity, start, end) of the runs a rank's specs or read requests are planned in."""
    if digest is None:
        return [(tuple(items), 0, len(items))]
    if isinstance(digest, bytes):
        return [(digest, 0, len(items))]
    out, at = [], 0
    for d, n in digest:
        out.append((d, at, at + n))
        at += n
    if at != len(items):
        raise ValueError(f"run digests cover {at} of {len(items)} items")
    return out


@gc_paused
def plan_save(tensors: Sequence[Sequence[TensorSpec]], files_per_rank: int = 1,
              aliases: Optional[Dict[str, str]] = None, digests: Optional[Sequence] = None) -> SavePlan:
    """Build the global save plan from every rank's tensor specs (index = rank).

    `digests[rank]`: the digest of the rank's whole spec list, or its `spec_runs`. Runs several
    ranks hold alike (data-parallel replicas) are validated once; each distinct box goes to the
    least-loaded rank holding it, biggest boxes first.
    """
    world = len(tensors)
    metas: Dict[str, TensorMeta] = {}
    # the ranks holding each distinct run, and where it starts in each rank's list
    starts_of: Dict[object, Dict[int, int]] = {}
    first: Dict[object, Tuple[int, int, int]] = {}
    for rank, specs in enumerate(tensors):
        for ident, a, b in _runs(specs, digests[rank] if digests else None):
            starts_of.setdefault(ident, {})[rank] = a
            first.setdefault(ident, (rank, a, b))
    # box -> [nbytes, [(the run's starts by rank, index in the run)]]
    boxes: Dict[Tuple[str, Box], list] = {}
    itemsize: Dict[str, int] = {}
    for ident, (leader, a, b) in first.items():
        starts = starts_of[ident]
        specs = tensors[leader]
        for i in range(a, b):
            spec = specs[i]
            meta = metas.get(spec.key)
            if meta is None:
                meta = metas[spec.key] = TensorMeta(spec.shape, spec.dtype)
            elif meta.shape != spec.shape or meta.dtype != spec.dtype:
                raise ValueError(f"{spec.key}: ranks disagree on the tensor: one holds shape "
                                 f"{list(meta.shape)} {meta.dtype}, rank {leader} holds shape "
                                 f"{list(spec.shape)} {spec.dtype}")
            offsets, lengths = spec.offsets, spec.lengths
            if len(offsets) != len(spec.shape) or len(lengths) != len(offsets) or not all(
                    map(operator.le, map(operator.add, offsets, lengths), spec.shape)):
                raise ValueError(f"{spec.key}: rank {leader}'s box {spec.box} lies outside shape "
                                 f"{list(spec.shape)}")
            count = math.prod(lengths)
            if not count:
                continue
            box = (spec.key, (offsets, lengths))
            entry = boxes.get(box)
            if entry is None:
                size = itemsize.get(spec.dtype)
                if size is None:
                    size = itemsize[spec.dtype] = dtype_from_name(spec.dtype).itemsize
                boxes[box] = [count * size, [(starts, i - a)]]
            elif entry[1][-1][0] is not starts:  # the same box in another run (a rank holds it once)
                entry[1].append((starts, i - a))

    # Replicated boxes big enough are cut into row ranges so several holders write them in parallel.
    holder_sets: Dict[Tuple[int, ...], Tuple[int, ...]] = {}  # by the runs holding a box
    pieces = []  # (key, piece box, nbytes, parent box, its holders)
    for box, (nbytes, runs) in boxes.items():
        by_runs = tuple(id(starts) for starts, _ in runs)
        ranks = holder_sets.get(by_runs)
        if ranks is None:
            ranks = holder_sets[by_runs] = tuple(r for starts, _ in runs for r in starts)
        key, (offs, lens) = box
        n = min(len(ranks), nbytes // SPLIT_BYTES, lens[0] if lens else 1)
        if n < 2:
            pieces.append((key, box[1], nbytes, box, ranks))
            continue
        row_bytes = nbytes // lens[0]
        for i in range(n):
            lo, hi = lens[0] * i // n, lens[0] * (i + 1) // n
            pieces.append((key, ((offs[0] + lo,) + offs[1:], (hi - lo,) + lens[1:]), (hi - lo) * row_bytes, box, ranks))

    load = LeastLoaded(world)
    assigned: List[List[Tuple[int, Box, int]]] = [[] for _ in range(world)]  # (spec index, box, nbytes)
    for key, piece, nbytes, parent, ranks in sorted(pieces, key=lambda p: (-p[2], p[0], p[1])):
        rank = load.pick(ranks)
        index = next(starts[rank] + i for starts, i in boxes[parent][1] if rank in starts)
        assigned[rank].append((index, piece, nbytes))
        load.add(rank, nbytes)

    writes: List[List[WriteItem]] = []
    stored: List[List[StoredBox]] = []
    files: Dict[str, int] = {}
    for rank in range(world):
        placed, used = place([a[2] for a in assigned[rank]], data_file_names(rank, files_per_rank))
        files.update(used)
        writes.append([WriteItem(i, box, f, o) for (i, box, _), (f, o) in zip(assigned[rank], placed)])
        entries = []
        for (index, (offsets, lengths), nbytes), (f, o) in zip(assigned[rank], placed):
            entry = StoredBox(file=f, offset=o, nbytes=nbytes, crc32c=[], offsets=offsets, lengths=lengths)
            metas[tensors[rank][index].key].boxes.append(entry)
            entries.append(entry)
        stored.append(entries)
    for meta in metas.values():
        meta.boxes.sort(key=lambda b: b.offsets)
    metadata = Metadata(tensors=dict(sorted(metas.items())), objects={}, files=dict(sorted(files.items())),
                        aliases=dict(aliases or {}), world_size=world, chunk_bytes=CHUNK_BYTES)
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
    candidate is stored."""
    present = [resolve_key(metadata, k) for k in candidate_keys(spec)
               if resolve_key(metadata, k) in metadata.tensors]
    if not present:
        return None
    for key in present:
        if metadata.tensors[key].dtype == spec.dtype:
            return key
    for key in present:
        if (metadata.tensors[key].dtype, spec.dtype) in EXACT_WIDENING:
            return key
    if spec.cast:
        return present[0]
    found = ", ".join(f"{k} is {metadata.tensors[k].dtype}" for k in present)
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


# ------------------------------------------------------------------ read-once loading


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


Request = Tuple[str, int, int, int, Tuple[Box, ...]]


def read_regions(read: ReadItem) -> Tuple[Box, ...]:
    """The distinct regions a read feeds, in the order of its copies: the layout of its payload
    when another rank reads it (each region row-major, one after the other)."""
    return tuple(dict.fromkeys(c.region for c in read.copies))


def read_request(read: ReadItem) -> Request:
    """What a rank tells the others about one of its reads: stored item, byte range, regions."""
    return read.stored.file, read.stored.offset, read.start, read.end, read_regions(read)


@dataclass
class Assignment:
    """The read-once assignment: `transfers` (all, or those one rank reads or needs), and how many
    shared items there are in all (the same on every rank)."""
    transfers: Dict[Tuple[str, int], Transfer]
    shared: int


@gc_paused
def assign_transfers(requests: Sequence[Sequence[Request]], digests: Optional[Sequence] = None,
                     rank: Optional[int] = None,
                     readers: Optional[Callable[[str], Optional[Sequence[int]]]] = None) -> Assignment:
    """Pick one reader for every stored item that several ranks read (pure; same on every rank).

    The reader is one of the ranks needing the item, balancing bytes read across ranks; it reads
    the union of the needed ranges. Items only one rank needs are left to that rank. `digests`
    (each rank's request runs, `runs_of`, or one digest per rank): runs several ranks request
    alike are handled once. With `rank`, only the transfers that rank reads or needs are built.
    `readers(file)`: the ranks that can read a file (None: all); an item no needer can read is
    read by one that can, which passes it on to every needer.
    """
    groups: Dict[object, list] = {}  # run -> [ranks, leader, start, end]
    for r, reqs in enumerate(requests):
        for ident, a, b in _runs(reqs, digests[r] if digests else None):
            group = groups.get(ident)
            if group is None:
                groups[ident] = [[r], r, a, b]
            else:
                group[0].append(r)
    needs: Dict[Tuple[str, int], List[Tuple[List[int], int, int, Tuple[Box, ...]]]] = {}
    for ranks, leader, a, b in groups.values():
        for file, offset, start, end, regions in requests[leader][a:b]:
            needs.setdefault((file, offset), []).append((ranks, start, end, regions))
    load = LeastLoaded(len(requests))
    shared = []
    able: Dict[str, Optional[Tuple[int, ...]]] = {}
    if readers is not None:
        for file, _ in needs:
            if file not in able:
                found = readers(file)
                able[file] = None if found is None else tuple(sorted(found))
    for item, users in needs.items():
        if len(users) == 1 and len(users[0][0]) == 1 and (able.get(item[0]) is None or users[0][0][0] in able[item[0]]):
            load.add(users[0][0][0], users[0][2] - users[0][1])
        else:
            shared.append((min(u[1] for u in users), max(u[2] for u in users), item))
    out: Dict[Tuple[str, int], Transfer] = {}
    needer_sets: Dict[Tuple[int, ...], Tuple[Tuple[int, ...], frozenset]] = {}  # by the runs needing an item
    for tag, (start, end, item) in enumerate(sorted(shared, key=lambda x: (x[0] - x[1], x[2]))):
        users = needs[item]
        by_groups = tuple(id(u[0]) for u in users)
        cached = needer_sets.get(by_groups)
        if cached is None:
            needers = tuple(r for u in users for r in u[0])
            cached = needer_sets[by_groups] = (needers, frozenset(needers) if rank is not None else frozenset())
        needers = cached[0]
        can = able.get(item[0])
        if can is not None:
            if not can:
                raise LoadMismatchError(f"{item[0]} is needed but no rank of this job can read it")
            reader = load.pick(tuple(r for r in needers if r in can) or can)
        else:
            reader = load.pick(needers)
        load.add(reader, end - start)
        if rank is None or rank in cached[1] or rank == reader:
            out[item] = Transfer(reader, needers, tuple(u[3] for u in users for _ in u[0]), start, end, tag)
    return Assignment(out, len(shared))


class LeastLoaded:
    """Byte counts per rank, and the least-loaded rank of a rank set (ties: the lowest rank).

    One heap per distinct rank set (a box's holders are usually a whole data-parallel group, so
    there are few sets). Loads only grow, so a heap entry whose recorded load is stale is
    refreshed when it surfaces: each pick costs O(log n) instead of a scan of the set.
    """

    def __init__(self, world: int):
        self.load = [0] * world
        self._heaps: Dict[Tuple[int, ...], List[Tuple[int, int]]] = {}

    def add(self, rank: int, nbytes: int) -> None:
        self.load[rank] += nbytes

    def pick(self, ranks: Tuple[int, ...]) -> int:
        heap = self._heaps.get(ranks)
        if heap is None:
            heap = self._heaps[ranks] = [(self.load[r], r) for r in ranks]
            heapq.heapify(heap)
        while heap[0][0] != self.load[heap[0][1]]:
            heapq.heapreplace(heap, (self.load[heap[0][1]], heap[0][1]))
        return heap[0][1]


def specs_of(fragments) -> List[TensorSpec]:
    """The TensorSpecs of fragments: what planning needs of them, without their memory."""
    return [TensorSpec(f.key, tuple(f.global_shape), dtype_name(f.dtype), tuple(f.offsets), tuple(f.lengths),
                       tuple(f.sources), f.cast)
            for f in fragments]
