"""Planning, as pure functions of descriptions (no tensors, no processes, no I/O).

Save plan: every distinct box is assigned to exactly one of the ranks holding it, balancing
bytes; file names and byte offsets are fixed here. Load plan: each wanted box is intersected
with the stored boxes; every intersection becomes a byte-range read plus a copy.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .errors import LoadMismatchError
from .format import (CHUNK_BYTES, DATA_DIR, Metadata, ObjectMeta, StoredBox, StoredItem, TensorMeta,
                     dtype_from_name)
from .fragment import Box, Shape, flat_offset, intersect


@dataclass(frozen=True)
class TensorSpec:
    """What a fragment is, without its memory: the unit planning works on."""
    key: str
    shape: Shape  # global shape
    dtype: str
    offsets: Shape
    lengths: Shape

    @property
    def box(self) -> Box:
        return self.offsets, self.lengths

    @property
    def nbytes(self) -> int:
        return math.prod(self.lengths) * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class ObjectSpec:
    key: str
    nbytes: int
    encoding: str
    rank: Optional[int]  # None: one copy for all ranks


@dataclass(frozen=True)
class WriteItem:
    index: int  # position in the rank's list of tensor specs, or of object specs
    is_object: bool
    file: str
    offset: int


@dataclass
class SavePlan:
    writes: List[List[WriteItem]]  # per rank
    stored: List[List[StoredItem]]  # per rank, the metadata entry of each write (checksums at commit)
    metadata: Metadata
    rank_bytes: List[int]

    @property
    def balance(self) -> float:
        """max / mean bytes written per rank (1.0 is perfect)."""
        mean = sum(self.rank_bytes) / len(self.rank_bytes)
        return max(self.rank_bytes) / mean if mean else 1.0


def plan_save(tensors: Sequence[Sequence[TensorSpec]], objects: Sequence[Sequence[ObjectSpec]],
              files_per_rank: int = 1, aliases: Optional[Dict[str, str]] = None) -> SavePlan:
    """Build the global save plan from every rank's specs (index = rank)."""
    world = len(tensors)
    metas: Dict[str, TensorMeta] = {}
    holders: Dict[Tuple[str, Box], List[Tuple[int, int]]] = {}  # box -> [(rank, index)]
    for rank, specs in enumerate(tensors):
        for index, spec in enumerate(specs):
            meta = metas.setdefault(spec.key, TensorMeta(spec.shape, spec.dtype))
            if (meta.shape, meta.dtype) != (spec.shape, spec.dtype):
                raise ValueError(f"{spec.key}: ranks disagree on the tensor: one holds shape "
                                 f"{list(meta.shape)} {meta.dtype}, rank {rank} holds shape "
                                 f"{list(spec.shape)} {spec.dtype}")
            if len(spec.offsets) != len(spec.shape) or any(
                    o + n > s for o, n, s in zip(spec.offsets, spec.lengths, spec.shape)):
                raise ValueError(f"{spec.key}: rank {rank}'s box {spec.box} lies outside shape "
                                 f"{list(spec.shape)}")
            if math.prod(spec.lengths):
                holders.setdefault((spec.key, spec.box), []).append((rank, index))
    object_keys = {o.key for objs in objects for o in objs}
    if object_keys & metas.keys():
        raise ValueError(f"keys used both for a tensor and an object: {sorted(object_keys & metas.keys())}")

    # Objects are written by their owner; distinct boxes go to the least-loaded holder, biggest first.
    load = [0] * world
    assigned: List[List[Tuple[int, bool, int]]] = [[] for _ in range(world)]  # (index, is_object, nbytes)
    for rank, objs in enumerate(objects):
        for index, obj in enumerate(objs):
            assigned[rank].append((index, True, obj.nbytes))
            load[rank] += obj.nbytes
    boxes = sorted(holders.items(), key=lambda kv: (-tensors[kv[1][0][0]][kv[1][0][1]].nbytes, kv[0]))
    for (_key, _box), owners in boxes:
        rank, index = min(owners, key=lambda ri: (load[ri[0]], ri[0]))
        nbytes = tensors[rank][index].nbytes
        assigned[rank].append((index, False, nbytes))
        load[rank] += nbytes

    writes: List[List[WriteItem]] = []
    stored: List[List[StoredItem]] = []
    files: Dict[str, int] = {}
    object_metas: Dict[str, List[ObjectMeta]] = {}
    for rank in range(world):
        names = [f"{DATA_DIR}/r{rank}-{i}.bin" for i in range(files_per_rank)]
        heap = [(0, i) for i in range(files_per_rank)]
        rank_writes, rank_stored = [], []
        for index, is_object, nbytes in sorted(assigned[rank], key=lambda a: -a[2]):
            size, i = heapq.heappop(heap)
            item = WriteItem(index, is_object, names[i], size)
            rank_writes.append(item)
            heapq.heappush(heap, (size + nbytes, i))
            placed = dict(file=item.file, offset=item.offset, nbytes=nbytes, crc32=[])
            if is_object:
                obj = objects[rank][index]
                entry = ObjectMeta(**placed, encoding=obj.encoding, rank=obj.rank)
                object_metas.setdefault(obj.key, []).append(entry)
            else:
                spec = tensors[rank][index]
                entry = StoredBox(**placed, offsets=spec.offsets, lengths=spec.lengths)
                metas[spec.key].boxes.append(entry)
            rank_stored.append(entry)
        used = {item.file for item in rank_writes}
        files.update({names[i]: size for size, i in heap if names[i] in used})
        writes.append(rank_writes)
        stored.append(rank_stored)
    for meta in metas.values():
        meta.boxes.sort(key=lambda b: b.offsets)
    metadata = Metadata(tensors=dict(sorted(metas.items())), objects=dict(sorted(object_metas.items())),
                        files=dict(sorted(files.items())), aliases=dict(aliases or {}),
                        world_size=world, chunk_bytes=CHUNK_BYTES)
    return SavePlan(writes=writes, stored=stored, metadata=metadata, rank_bytes=load)


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


def plan_load(metadata: Metadata, wanted: Sequence[TensorSpec]) -> LoadPlan:
    """Reads and copies that fill every wanted box; raises LoadMismatchError on any misfit.

    Checks shapes, dtypes and coverage for everything before anything is read.
    """
    reads: Dict[Tuple[str, int], ReadItem] = {}
    missing: List[str] = []
    itemsizes = {}
    for target, spec in enumerate(wanted):
        stored_key = resolve_key(metadata, spec.key)
        meta = metadata.tensors.get(stored_key)
        if meta is None:
            missing.append(spec.key)
            continue
        if tuple(meta.shape) != tuple(spec.shape):
            raise LoadMismatchError(f"{spec.key}: checkpoint holds shape {list(meta.shape)}, the model "
                                    f"wants {list(spec.shape)}")
        if meta.dtype != spec.dtype:
            raise LoadMismatchError(f"{spec.key}: checkpoint holds {meta.dtype}, the model wants "
                                    f"{spec.dtype}; convert the model or the checkpoint")
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
