"""Streaming, single-process checkpoint I/O for offline tools (exports, imports): one tensor in
memory at a time, so a tool's peak memory is bounded by the largest tensor, not the model.

`write_checkpoint` writes a committed checkpoint from lazily produced fragments (each loaded just
before its bytes are written); `read_tensor` assembles one whole tensor through the same load
plan and checks as `load`. No process group is needed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import delta
from .commit import Commit
from .committed import check_files, read_metadata
from .engine.exchange import ReadWork, read_items
from .format import DATA_DIR, Metadata, ObjectMeta, chunk_checksums, dtype_from_name, dtype_name
from .fragment import Fragment, sub_view
from .objects import encode_object
from .foreign.view import transformed
from .plan import TensorSpec, plan_load, specs_of
from .runs import run_groups
from .save_plan import place, plan_save
from .spec_table import SpecTable
from .storage import AlignedStream, Storage, durable, storage_for


@dataclass
class LazyFragment:
    """A fragment whose memory is produced on demand: `load()` returns a tensor of shape
    `lengths` (it may be a view of something bigger, e.g. one partition of a flat buffer)."""
    key: str
    global_shape: Sequence[int]
    dtype: torch.dtype
    offsets: Sequence[int]
    lengths: Sequence[int]
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.lengths) * self.dtype.itemsize


def write_checkpoint(path, fragments: Sequence[LazyFragment], objects: Optional[Dict[str, Any]] = None, *,
                     aliases: Optional[Dict[str, str]] = None, framework: str = "torch",
                     layout: Optional[Dict[str, Any]] = None, step: Optional[int] = None,
                     overwrite: bool = False, progress: Optional[Callable[[int], None]] = None) -> Metadata:
    """Write and commit a checkpoint from `fragments` and replicated `objects`, streaming.

    Fragments that hold the same box are written once. `progress(nbytes)` is called as data lands.
    """
    storage = storage_for(path)
    specs = [TensorSpec(f.key, tuple(int(s) for s in f.global_shape), dtype_name(f.dtype),
                        tuple(int(o) for o in f.offsets), tuple(int(n) for n in f.lengths)) for f in fragments]
    plan = plan_save(SpecTable.of([specs]), run_groups(None, [len(specs)]), files_per_rank=1, aliases=aliases)
    encoded = [(key, *encode_object(value)) for key, value in (objects or {}).items()]
    obj_file = f"{DATA_DIR}/r0-objects.bin"
    placed, obj_sizes = place([len(data) for _, _, data in encoded], [obj_file])
    with Commit.open(storage, overwrite) as commit:
        return _write_all(commit, fragments, plan, encoded, placed, obj_sizes, obj_file, framework, layout, step,
                          progress)


def _write_all(commit: Commit, fragments, plan, encoded, placed, obj_sizes, obj_file, framework, layout, step,
               progress) -> Metadata:
    storage, files = commit.storage, dict(plan.metadata.files)
    by_file: Dict[str, List] = {}
    for write, entry in zip(plan.writes[0], plan.stored[0]):
        by_file.setdefault(write.file, []).append((write.offset, write, entry))
    for name, items in sorted(by_file.items()):
        with _SequentialFile(storage, commit.file(name)) as out:
            for offset, write, entry in sorted(items, key=lambda x: x[0]):
                frag = fragments[write.index]
                tensor = frag.load()
                if tuple(tensor.shape) != tuple(frag.lengths) or tensor.dtype != frag.dtype:
                    raise ValueError(f"{frag.key}: produced {tuple(tensor.shape)} {tensor.dtype}, expected "
                                     f"{tuple(frag.lengths)} {frag.dtype}")
                data = _bytes(sub_view(tensor, frag.offsets, write.box))
                out.write_at(offset, data)
                entry.crc32c = chunk_checksums(data, plan.metadata.chunk_bytes)
                if progress:
                    progress(len(data))
    object_meta: Dict[str, List[ObjectMeta]] = {}
    if encoded:
        with _SequentialFile(storage, commit.file(obj_file)) as out:
            for (key, encoding, data), (file, offset) in sorted(zip(encoded, placed), key=lambda x: x[1][1]):
                out.write_at(offset, data)
                object_meta[key] = [ObjectMeta(file=file, offset=offset, nbytes=len(data),
                                               crc32c=chunk_checksums(data, plan.metadata.chunk_bytes),
                                               encoding=encoding)]
        files.update(obj_sizes)
    metadata = Metadata(tensors=plan.metadata.tensors, objects=dict(sorted(object_meta.items())),
                        files=dict(sorted(files.items())), aliases=plan.metadata.aliases, framework=framework,
                        layout=dict(layout or {}), step=step, world_size=1, chunk_bytes=plan.metadata.chunk_bytes)
    commit.commit(metadata)
    return metadata


class _SequentialFile:
    """A data file written front to back; gaps between items (alignment) are zero-filled."""

    def __init__(self, storage: Storage, name: str):
        self.writer, self.pos = AlignedStream(storage.open_writer(name)), 0

    def write_at(self, offset: int, data) -> None:
        if offset < self.pos:
            raise ValueError(f"items must be written in offset order: {offset} after {self.pos}")
        if offset > self.pos:
            self.writer.write(bytes(offset - self.pos))
        self.writer.write(data)
        self.pos = offset + len(memoryview(data).cast("B"))

    def __enter__(self) -> "_SequentialFile":
        return self

    def __exit__(self, *exc) -> None:
        durable(self.writer).__exit__(*exc)


def _bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def open_checkpoint(path) -> tuple:
    """(storage, metadata) of a committed checkpoint, every file size checked."""
    storage = storage_for(path)
    metadata = read_metadata(storage)
    check_files(storage, metadata)
    return storage, metadata


def read_tensor(storage: Storage, metadata: Metadata, key: str, dtype: Optional[torch.dtype] = None,
                threads: int = 4, buffer: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The whole tensor `key` (aliases resolved), read and checksum-verified; into the front of
    `buffer` (uint8, reused by a caller streaming many tensors: fresh memory pays page faults)
    when given."""
    shape = tuple(metadata.tensors[metadata.aliases.get(key, key)].shape)
    return read_box(storage, metadata, key, (0,) * len(shape), shape, dtype, threads, buffer)


def read_box(storage: Storage, metadata: Metadata, key: str, offsets: Sequence[int], lengths: Sequence[int],
             dtype: Optional[torch.dtype] = None, threads: int = 4, buffer: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """The box (`offsets`, `lengths`) of tensor `key`, as `read_tensor` reads a whole one: only
    the stored ranges it overlaps are read."""
    key = metadata.aliases.get(key, key)
    meta = metadata.tensors[key]
    stored = dtype_from_name(meta.dtype)
    how = getattr(metadata, "transforms", {}).get(key)  # a foreign checkpoint's values computed as loads do
    dtype = dtype or (how.value_dtype(stored) if how is not None else stored)
    lengths = tuple(int(n) for n in lengths)
    if buffer is None:
        out = torch.empty(lengths, dtype=dtype)
    else:
        out = buffer[:math.prod(lengths) * dtype.itemsize].view(dtype).view(lengths)
    finish: List[Callable[[], None]] = []
    frags = transformed(metadata, [Fragment(key, tuple(meta.shape), out.dtype, tuple(int(o) for o in offsets), out,
                                            cast=True)], finish)
    plan = plan_load(metadata, specs_of(frags))
    read_items(storage, ReadWork(plan.reads, frags, {k: m.dtype for k, m in metadata.tensors.items()},
                                 metadata.chunk_bytes, base=delta.opened(storage, metadata)), threads=threads)
    for step in finish:
        step()
    return out
