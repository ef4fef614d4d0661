"""The on-disk format: the metadata's types, file layout, dtypes and checksums.

A checkpoint directory holds raw tensor/object bytes under `data/` and one `metadata.json`,
written last; its presence is the commit. The metadata is JSON (`metadata_codec` encodes and
decodes it) so any tool can read it and loading never executes anything. Decoding validates
every field before it is used.
"""
from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Dict, List, Mapping, Optional, Tuple

import crc32c as _crc32c
import torch

from .errors import MetadataError, UnsafePathError

FORMAT_NAME = "ckpt_plugins"
# 1: tables as JSON objects (still read); 2: as columns (format_v2); 3: weights stored as their
# fp32 masters' cast (`Metadata.casts`); 4: boxes stored compressed, chunk by chunk (`codec`), or as
# deltas against an earlier checkpoint (`Metadata.delta`); 5: each column in its narrowest width
# (`format_v2.WIDTHS`)
FORMAT_VERSION = 5
METADATA_FILE = "metadata.json"
DATA_DIR = "data"
# Checksums cover fixed-size chunks of each stored item, so a partial (byte-range) read still
# verifies every byte it uses while reading at most one extra chunk at each end.
CHUNK_BYTES = 1 << 20
# A checkpoint of more chunks than this has bigger ones (`chunk_bytes_for`): its checksums would
# otherwise be most of its metadata, which every host reads and decodes on every load.
MAX_CHUNKS = 1 << 21

# The state keys under which checkpoints move between frameworks: `model/<param>` holds weights in
# the training dtype, `optim/<param>/<state>` the optimizer's, and `optim/<param>/master` the fp32
# master weights of mixed-precision frameworks (stored only where they differ from the weights).
MODEL, OPTIM, MASTER = "model", "optim", "master"


def master_key(name: str) -> str:
    """Where the fp32 master copy of parameter `name` is stored."""
    return f"{OPTIM}/{name}/{MASTER}"


CAST_DTYPES = ("bfloat16", "float16")  # weight dtypes a save may store as their fp32 masters' cast


_DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                 "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                 "uint16", "uint32", "uint64")
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
STORABLE_DTYPES = tuple(_DTYPES)  # the dtype names a checkpoint may hold (messages between ranks number them)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored by ckpt_plugins") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise MetadataError(f"unknown dtype {name!r} in metadata") from None


def crc32c_of(data) -> int:
    return _crc32c.crc32c(data)


def chunk_bytes_for(total: int) -> int:
    """The chunk of a checkpoint of `total` bytes: `CHUNK_BYTES`, doubled until it has at most
    about `MAX_CHUNKS` chunks (2 TiB and less: 1 MiB)."""
    chunk = CHUNK_BYTES
    while total > chunk * MAX_CHUNKS:
        chunk *= 2
    return chunk


def chunk_checksums(data, chunk: int = CHUNK_BYTES) -> List[int]:
    """CRC32C of each `chunk`-byte piece of `data` (bytes-like); one checksum when empty.

    CRC32C because it is hardware-accelerated (SSE4.2 / ARMv8) and releases the GIL: checksums
    run beside the writes instead of bounding them.
    """
    view = memoryview(data).cast("B")
    if len(view) == 0:
        return [_crc32c.crc32c(b"")]
    return [_crc32c.crc32c(view[i:i + chunk]) for i in range(0, len(view), chunk)]


class ChunkSums:
    """`chunk_checksums` of an item whose bytes arrive in order, piece by piece: a save streaming
    through a small staging buffer never holds a big item whole."""

    def __init__(self, chunk: int = CHUNK_BYTES):
        self.chunk, self._sums, self._crc, self._filled = chunk, [], 0, 0

    def feed(self, data) -> None:
        view, at = memoryview(data).cast("B"), 0
        while at < len(view):
            take = min(self.chunk - self._filled, len(view) - at)
            self._crc = _crc32c.crc32c(view[at:at + take], self._crc)
            self._filled, at = self._filled + take, at + take
            if self._filled == self.chunk:
                self._sums.append(self._crc)
                self._crc = self._filled = 0

    def result(self) -> List[int]:
        return self._sums + [self._crc] if self._filled or not self._sums else list(self._sums)


_OWN_FILE = re.compile(r"data/(?:g\d+-)?r\d+-(?:\d+|objects)\.bin")  # the names saves write: safe as they are


def check_relative_path(path: str) -> str:
    """Reject any metadata path that could leave the checkpoint directory."""
    if isinstance(path, str) and _OWN_FILE.fullmatch(path):
        return path
    if (not isinstance(path, str) or not path or "\\" in path or "\x00" in path
            or path.startswith("/") or posixpath.normpath(path) != path
            or path.split("/")[0] == ".."):
        raise UnsafePathError(f"metadata names file {path!r}, which is not a plain relative path "
                              "inside the checkpoint; refusing to read it")
    return path


@dataclass
class StoredItem:
    """Where one stored box (or object) lives: file, byte range, and chunk checksums (of the bytes
    as loaded). A compressed box (`group` > 0) holds its chunks one after the other from `offset`
    on, each `packed[k]` bytes: its bytes grouped by position in elements of `group` bytes, as one
    zstd frame, or the chunk as it is where `packed[k]` is the chunk's own length (`codec`). A delta
    box (`delta`) holds each chunk so as the XOR of its bytes with the same chunk of the same box
    in the checkpoint `Metadata.delta` names; a chunk of 0 bytes is that chunk unchanged."""
    file: str
    offset: int
    nbytes: int
    crc32c: List[int]
    group: int = 0
    packed: List[int] = field(default_factory=list)
    delta: bool = False

    @property
    def stored_nbytes(self) -> int:
        """The bytes it takes in its file."""
        return sum(self.packed) if self.group else self.nbytes


@dataclass
class StoredBox(StoredItem):
    offsets: Tuple[int, ...] = ()
    lengths: Tuple[int, ...] = ()


@dataclass
class TensorMeta:
    shape: Tuple[int, ...]
    dtype: str
    boxes: List[StoredBox] = field(default_factory=list)


@dataclass
class ObjectMeta(StoredItem):
    encoding: str = "json"  # "json" or "torch" (torch.save, read back with weights_only=True)
    rank: Optional[int] = None  # None: replicated, stored once; else the saving rank's own value


@dataclass
class DeltaRef:
    """The checkpoint a delta checkpoint's delta boxes are XORs against: its path (relative to this
    one's when both are local), the sha256 of its metadata file, and how many deltas deep this one
    is (1: its base stores every box itself)."""
    path: str
    digest: str
    depth: int


@dataclass
class Metadata:
    tensors: Mapping[str, TensorMeta]  # a dict when written; decoded, a read-only TensorTable
    objects: Dict[str, List[ObjectMeta]]
    files: Dict[str, int]  # data file -> expected size in bytes
    aliases: Dict[str, str] = field(default_factory=dict)  # tied key -> stored key
    # weight key -> its fp32 master's key: the weight (a tensor entry without boxes) is exactly
    # the master cast to the weight's dtype, checked on every rank when saved (`casts`)
    casts: Dict[str, str] = field(default_factory=dict)
    delta: Optional[DeltaRef] = None
    framework: str = "torch"
    layout: Dict[str, Any] = field(default_factory=dict)
    step: Optional[int] = None
    world_size: int = 1
    version: int = FORMAT_VERSION
    chunk_bytes: int = CHUNK_BYTES

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def stored_entries(metadata: Metadata) -> set:
    """The top-level state entries a checkpoint holds: `model` of `model/...`, an object's name."""
    return {k.split("/", 1)[0] for k in list(metadata.tensors) + list(metadata.objects) + list(metadata.aliases)}


# --- checks the decoders share: a hostile file yields MetadataError (or UnsafePathError) only ---

def checked_files(entries) -> Dict[str, int]:
    """A file table from its [path, size] pairs, every path checked as `check_relative_path` does
    and every size an integer >= 0. At scale it holds hundreds of thousands of files: their names
    are checked at once, as one string, for what `check_relative_path` refuses (an empty, "." or
    ".." component, a leading or trailing "/", a backslash, a NUL), one by one only where that
    finds any."""
    need(isinstance(entries, list) and set(map(type, entries)) <= {list} and set(map(len, entries)) <= {2},
         "files must be a list of [path, size] pairs")
    names, sizes = list(map(itemgetter(0), entries)), list(map(itemgetter(1), entries))
    plain = False
    if set(map(type, names)) <= {str} and set(map(type, sizes)) <= {int} and min(sizes, default=0) >= 0:
        joined = "/" + "/\n/".join(names) + "/"  # each name between slashes, one per line
        plain = joined.count("\n") == len(names) - 1 and not any(
            bad in joined for bad in ("//", "/./", "/../", "\\", "\x00"))
    files = (dict(zip(names, sizes)) if plain else
             {check_relative_path(name): require_int(size, f"files.{name}") for name, size in entries})
    need(len(files) == len(entries), "files names a file twice")
    return files


def need(cond: bool, what: str) -> None:
    if not cond:
        raise MetadataError(f"malformed metadata: {what}")


def require_int(value, what: str, minimum: int = 0) -> int:
    need(type(value) is int and value >= minimum, f"{what} must be an integer >= {minimum}")
    return value


def require_ints(value, what: str) -> Tuple[int, ...]:
    need(isinstance(value, list) and len(value) <= 64, f"{what} must be a list of integers")
    return tuple(require_int(v, what) for v in value)


def require_dict(value, what: str) -> dict:
    need(isinstance(value, dict), f"{what} must be an object")
    return value


def item_fields(raw: dict, what: str, chunk_bytes: int) -> dict:
    """A stored item's file, offset, nbytes and per-chunk checksums, checked."""
    raw = require_dict(raw, what)
    nbytes = require_int(raw.get("nbytes"), f"{what}.nbytes")
    crc = raw.get("crc32c")
    need(isinstance(crc, list) and all(type(c) is int for c in crc)
         and len(crc) == max(1, math.ceil(nbytes / chunk_bytes)),
         f"{what}.crc32c must hold one checksum per chunk")
    return dict(file=check_relative_path(raw.get("file")), offset=require_int(raw.get("offset"), f"{what}.offset"),
                nbytes=nbytes, crc32c=crc)


def check_in_file(key: str, item: StoredItem, files: Dict[str, int]) -> None:
    """`item` lies in a file of the file table, inside its expected size."""
    need(item.file in files, f"{key} is stored in {item.file}, which the file table lacks")
    need(item.offset + item.stored_nbytes <= files[item.file], f"{key} extends past the end of {item.file}")
