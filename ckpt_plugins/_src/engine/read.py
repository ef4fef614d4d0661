"""Verified reads of stored ranges and the copies out of them: the pieces every load path (the
read-once exchange, offline tools) is built from."""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import torch

from ..errors import CorruptCheckpointError
from ..codec import unpack, xor
from ..format import StoredItem, chunk_checksums, crc32c_of
from ..fragment import Fragment, flat_offset, sub_view
from ..plan import ReadItem
from ..storage import Storage
from ..telemetry import Recorder


def read_checked(storage: Storage, key: str, item: StoredItem, start: int, end: int, chunk: int, buffer=None,
                 recorder: Optional[Recorder] = None, base=None) -> bytearray:
    """Bytes [start, end) of a stored item, verified against its chunk checksums (a foreign
    checkpoint's items have none: `crc32c` empty); a compressed item's chunks are decompressed,
    only those the range touches, and a delta item's applied to the same chunks of `base` (the
    checkpoint's `delta.Base`)."""
    buffer = bytearray(end - start) if buffer is None else buffer
    if item.group:
        return _read_packed(storage, key, item, start, end, chunk, buffer, recorder, base)
    t0 = time.time()
    storage.read_into(item.file, item.offset + start, buffer)
    t1 = time.time()
    if not item.crc32c:
        if recorder is not None:
            recorder.add("read", t0, t1, end - start)
        return buffer
    _check(key, item, start, end, chunk_checksums(buffer, chunk), chunk)
    if recorder is not None:
        recorder.add("read", t0, t1, end - start)
        recorder.add("checksum", t1, time.time(), end - start)
    return buffer


def _check(key: str, item: StoredItem, start: int, end: int, sums, chunk: int) -> None:
    if sums != item.crc32c[start // chunk:start // chunk + len(sums)]:
        raise CorruptCheckpointError(f"checksum mismatch in {key}: file {item.file}, bytes "
                                     f"{item.offset + start}..{item.offset + end}; the checkpoint is corrupt")


def _read_packed(storage: Storage, key: str, item: StoredItem, start: int, end: int, chunk: int, buffer,
                 recorder: Optional[Recorder], base) -> bytearray:
    """`read_checked` of a compressed item: its chunks over [start, end) read as one range, then
    each decompressed (a delta's applied to its base's chunk), checked and copied out."""
    first, last = start // chunk, -(-end // chunk)
    based = _base_box(key, item, base) if item.delta else None
    at = item.offset + sum(item.packed[:first])
    frames = bytearray(sum(item.packed[first:last]))
    t0 = time.time()
    storage.read_into(item.file, at, frames)
    t1 = time.time()
    out, pos, where = memoryview(buffer).cast("B"), 0, f"{key} (file {item.file})"
    for k in range(first, last):
        n, size = item.packed[k], min(chunk, item.nbytes - k * chunk)
        data = unpack(memoryview(frames)[pos:pos + n], size, item.group, where) if n else None
        pos += n
        if based is not None:
            data = memoryview(xor(base.chunk(key, based, k), data))
        if item.crc32c:
            _check(key, item, k * chunk, k * chunk + len(data), [crc32c_of(data)], chunk)
        lo, hi = max(start, k * chunk), min(end, k * chunk + len(data))
        out[lo - start:hi - start] = data[lo - k * chunk:hi - k * chunk]
    if recorder is not None:
        recorder.add("read", t0, t1, len(frames))
        recorder.add("decompress", t1, time.time(), end - start)
    return buffer


def _base_box(key: str, item: StoredItem, base) -> StoredItem:
    found = None if base is None else base.box(key, item.offsets, item.lengths, item.nbytes)
    if found is None:
        raise CorruptCheckpointError(f"{key} (file {item.file}) is stored as a delta against a box its base "
                                     f"checkpoint {'does not name' if base is None else 'lacks'}; the checkpoint "
                                     "is corrupt")
    return found


def region_view(data, dtype: torch.dtype, first: int, stored_lengths: Sequence[int], stored_offsets: Sequence[int],
                region) -> torch.Tensor:
    """`region` (global coordinates) of a stored box, as a strided view of `data`: the box's
    elements from index `first` on."""
    flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
    strides = [1] * len(stored_lengths)
    for d in range(len(strides) - 2, -1, -1):
        strides[d] = strides[d + 1] * stored_lengths[d + 1]
    rel = [o - so for o, so in zip(region[0], stored_offsets)]
    return flat.as_strided(region[1], strides, flat_offset(stored_lengths, rel) - first)


def copy_out(read: ReadItem, data, targets: Sequence[Fragment], dtype: torch.dtype) -> None:
    """Copy the regions `read` feeds from `data` (its bytes [start, end)) into their targets."""
    if not len(data):
        return
    stored = read.stored
    for copy in read.copies:
        target = targets[copy.target]
        src = region_view(data, dtype, read.start // dtype.itemsize, stored.lengths, stored.offsets, copy.region)
        sub_view(target.local, target.offsets, copy.region).copy_(src)


def region_bytes(region, itemsize: int) -> int:
    return math.prod(region[1]) * itemsize


def payload_bytes(regions, itemsize: int) -> int:
    """Bytes of the regions packed one after the other."""
    return sum(region_bytes(g, itemsize) for g in regions)


def _contiguous_in(stored_lengths: Sequence[int], region) -> bool:
    """Whether `region`'s elements are one contiguous run of the stored box (row-major)."""
    lengths = region[1]
    d = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    return all(n == s for n, s in zip(lengths[d + 1:], stored_lengths[d + 1:]))


def needs_packing(stored_lengths: Sequence[int], regions) -> bool:
    """A payload is sent as a view of the read bytes when it is one contiguous region; else the
    reader packs the regions one after the other."""
    return len(regions) != 1 or not _contiguous_in(stored_lengths, regions[0])


def contiguous_destination(read: ReadItem, targets: Sequence[Fragment], dtype: torch.dtype, whole: bool = True):
    """The destination's own bytes when the read's one region lands unchanged in one contiguous
    CPU view: the read (`whole`: its bytes are exactly the region's, e.g. the whole stored box, or
    a rank's rows of it) or a received payload can then go straight there."""
    stored = read.stored
    if len(read.copies) != 1:
        return None
    copy = read.copies[0]
    if whole:
        if not _contiguous_in(stored.lengths, copy.region):
            return None
        first = flat_offset(stored.lengths, [o - so for o, so in zip(copy.region[0], stored.offsets)])
        start = first * dtype.itemsize
        if (read.start, read.end) != (start, start + region_bytes(copy.region, dtype.itemsize)):
            return None
    target = targets[copy.target]
    view = sub_view(target.local, target.offsets, copy.region)
    if view.dtype != dtype or view.device.type != "cpu" or not view.is_contiguous() or not view.numel():
        return None
    return view.reshape(-1).view(torch.uint8)
