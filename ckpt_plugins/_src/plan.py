"""Planning, as pure functions of descriptions (no tensors, no processes, no I/O): what
planning knows of a tensor (`TensorSpec`), and the load plan: each wanted box is intersected with
the stored boxes; every intersection becomes a byte-range read plus a copy. The save plan is
`save_plan`'s."""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .errors import LoadMismatchError
from .gcpause import gc_paused
from .format import Metadata, StoredBox, TensorMeta, dtype_from_name, dtype_name
from .format_v2 import TensorTable
from .fragment import Box, Shape, flat_offset, intersect


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


# A tensor stored in more boxes than this has the boxes meeting a wanted one found with arrays: a
# checkpoint of 100,000 ranks holds a flat buffer in thousands of boxes, and each rank wants a few.
MANY_BOXES = 16


def _meeting(metadata: Metadata, key: str, meta: TensorMeta, box: Box, extents: Dict[str, Optional[np.ndarray]]):
    """The positions, ascending, of the stored boxes of `key` that may overlap `box`: every one of
    a tensor of few boxes, else those that do, found on their extents ((boxes, ndim, 2) offsets
    and lengths, kept in `extents` for the rest of the plan)."""
    if len(meta.boxes) <= MANY_BOXES:
        return range(len(meta.boxes))
    if key not in extents:
        extents[key] = _extents(metadata, key, meta)
    found = extents[key]
    if found is None:  # a foreign box of more or fewer dimensions than its tensor: scanned as it is
        return range(len(meta.boxes))
    lo = np.asarray(box[0], dtype=np.int64)
    hi = lo + np.asarray(box[1], dtype=np.int64)
    offsets, lengths = found[:, :, 0], found[:, :, 1]
    return np.flatnonzero(((offsets < hi) & (offsets + lengths > lo)).all(axis=1)).tolist()


def _extents(metadata: Metadata, key: str, meta: TensorMeta) -> Optional[np.ndarray]:
    if isinstance(metadata.tensors, TensorTable):
        return metadata.tensors.extents(key)
    ndim = len(meta.shape)
    if any(len(b.offsets) != ndim or len(b.lengths) != ndim for b in meta.boxes):
        return None
    return np.array([(b.offsets, b.lengths) for b in meta.boxes], dtype=np.int64).reshape(
        len(meta.boxes), 2, ndim).transpose(0, 2, 1)


@gc_paused
def plan_load(metadata: Metadata, wanted: Sequence[TensorSpec]) -> LoadPlan:
    """Reads and copies that fill every wanted box; raises LoadMismatchError on any misfit.

    Checks shapes, dtypes and coverage for everything before anything is read.
    """
    reads: Dict[Tuple[str, int], ReadItem] = {}
    missing: List[str] = []
    itemsizes, extents = {}, {}
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
        for b in _meeting(metadata, stored_key, meta, spec.box, extents):
            if not needed:
                break
            stored = meta.boxes[b]
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

    def __init__(self, world: int, load: Optional[np.ndarray] = None):
        self.load = [0] * world if load is None else load.tolist()
        self._heaps: Dict[Hashable, List[int]] = {}

    def add(self, rank: int, nbytes: int) -> None:
        self.load[rank] += nbytes

    def deal(self, names: Sequence[Hashable], nbytes: Sequence[int], ranks: Union[Sequence, Mapping]) -> List[int]:
        """A rank for each item in turn, the least loaded of its set, which it then loads: item i,
        of `nbytes[i]` bytes, to one of `ranks[names[i]]` (a set by its name: hashed once, not
        per item). Returns the ranks picked, in one loop: at scale, tens of thousands of items."""
        heaps, load, out = self._heaps, self.load, []
        shift = len(load).bit_length()  # a heap entry is load << shift | rank: ints compare faster than pairs
        mask = (1 << shift) - 1
        for name, n in zip(names, nbytes):
            heap = heaps.get(name)
            if heap is None:
                heap = heaps[name] = [load[r] << shift | r for r in ranks[name]]
                heapq.heapify(heap)
            top = heap[0]
            rank = top & mask
            while top >> shift != load[rank]:
                heapq.heapreplace(heap, load[rank] << shift | rank)
                top = heap[0]
                rank = top & mask
            load[rank] += n
            heapq.heapreplace(heap, load[rank] << shift | rank)  # its entry, fresh again: no refresh at the next pick
            out.append(rank)
        return out


def specs_of(fragments) -> List[TensorSpec]:
    """The TensorSpecs of fragments: what planning needs of them, without their memory."""
    return [TensorSpec(f.key, tuple(f.global_shape), dtype_name(f.dtype), tuple(f.offsets), tuple(f.lengths),
                       tuple(f.sources), f.cast)
            for f in fragments]
