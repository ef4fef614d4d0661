"""Execution: write a rank's share of a save plan, and run a load plan's reads and copies.

Side effects live here (and in storage); what to do was decided by `plan`.
"""
from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence

import torch

from .errors import CorruptCheckpointError
from .format import chunk_checksums, dtype_from_name
from .fragment import Fragment, flat_offset, sub_view
from .plan import ReadItem, WriteItem
from .storage import Storage


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw row-major bytes of a tensor, as a host buffer (a copy only when needed)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def write_items(storage: Storage, items: Sequence[WriteItem], fragments: Sequence[Fragment],
                objects: Sequence[bytes]) -> List[List[int]]:
    """Write this rank's items, one thread per file; returns each item's chunk checksums."""
    by_file: Dict[str, List[int]] = defaultdict(list)
    for position, item in enumerate(items):
        by_file[item.file].append(position)
    checksums: List[List[int]] = [[] for _ in items]

    def write_file(name: str) -> None:
        writer = storage.open_writer(name)
        try:
            for position in sorted(by_file[name], key=lambda p: items[p].offset):
                item = items[position]
                data = objects[item.index] if item.is_object else tensor_bytes(fragments[item.index].local)
                writer.write(data)
                checksums[position] = chunk_checksums(data)
        finally:
            writer.close()

    if len(by_file) <= 1:
        for name in by_file:
            write_file(name)
    else:
        with ThreadPoolExecutor(len(by_file), thread_name_prefix="ckpt-write") as pool:
            list(pool.map(write_file, list(by_file)))
    return checksums


def read_checked(storage: Storage, key: str, file: str, offset: int, nbytes: int, start: int, end: int,
                 crc32: Sequence[int], chunk: int) -> bytearray:
    """Bytes [start, end) of an item stored at `offset`, verified against its chunk checksums."""
    buffer = bytearray(end - start)
    storage.read_into(file, offset + start, buffer)
    expected = crc32[start // chunk:start // chunk + len(range(start, end, chunk))]
    if chunk_checksums(buffer, chunk) != list(expected):
        raise CorruptCheckpointError(f"checksum mismatch in {key}: file {file}, bytes "
                                     f"{offset + start}..{offset + end}; the checkpoint is corrupt")
    return buffer


def read_items(storage: Storage, reads: Sequence[ReadItem], targets: Sequence[Fragment], dtypes: Dict[str, str],
               chunk: int, threads: int = 2) -> None:
    """Run reads in parallel; copy each verified range into its destination views."""

    def run(read: ReadItem) -> None:
        stored = read.stored
        buffer = read_checked(storage, read.key, stored.file, stored.offset, stored.nbytes, read.start,
                              read.end, stored.crc32, chunk)
        dtype = dtype_from_name(dtypes[read.key])
        flat = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype) if buffer else None
        strides = [1] * len(stored.lengths)
        for d in range(len(strides) - 2, -1, -1):
            strides[d] = strides[d + 1] * stored.lengths[d + 1]
        first = read.start // dtype.itemsize
        for copy in read.copies:
            target = targets[copy.target]
            rel = [o - so for o, so in zip(copy.region[0], stored.offsets)]
            src = flat.as_strided(copy.region[1], strides, flat_offset(stored.lengths, rel) - first)
            sub_view(target.local, target.offsets, copy.region).copy_(src)

    if threads <= 1 or len(reads) <= 1:
        for read in reads:
            run(read)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-read") as pool:
        list(pool.map(run, reads))
