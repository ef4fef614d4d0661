"""The on-disk format: metadata schema (versioned JSON), file layout, dtypes and checksums.

A checkpoint directory holds raw tensor/object bytes under `data/` and one `metadata.json`,
written last; its presence is the commit. The metadata is plain JSON so any tool can read it
and loading never executes anything. Decoding validates every field before it is used.
"""
from __future__ import annotations

import json
import math
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import crc32c as _crc32c
import torch

from .errors import MetadataError, UnsafePathError
from .gcpause import gc_paused

FORMAT_NAME = "ckpt_plugins"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
DATA_DIR = "data"
# Checksums cover fixed-size chunks of each stored item, so a partial (byte-range) read still
# verifies every byte it uses while reading at most one extra chunk at each end.
CHUNK_BYTES = 1 << 20

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                 "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                 "uint16", "uint32", "uint64")
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


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


def chunk_checksums(data, chunk: int = CHUNK_BYTES) -> List[int]:
    """CRC32C of each `chunk`-byte piece of `data` (bytes-like); one checksum when empty.

    CRC32C because it is hardware-accelerated (SSE4.2 / ARMv8) and releases the GIL: checksums
    run beside the writes instead of bounding them.
    """
    view = memoryview(data).cast("B")
    if len(view) == 0:
        return [_crc32c.crc32c(b"")]
    return [_crc32c.crc32c(view[i:i + chunk]) for i in range(0, len(view), chunk)]


def check_relative_path(path: str) -> str:
    """Reject any metadata path that could leave the checkpoint directory."""
    if (not isinstance(path, str) or not path or "\\" in path or "\x00" in path
            or path.startswith("/") or posixpath.normpath(path) != path
            or path.split("/")[0] == ".."):
        raise UnsafePathError(f"metadata names file {path!r}, which is not a plain relative path "
                              "inside the checkpoint; refusing to read it")
    return path


@dataclass
class StoredItem:
    """Where one stored box (or object) lives: file, byte range, and chunk checksums."""
    file: str
    offset: int
    nbytes: int
    crc32c: List[int]


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
class Metadata:
    tensors: Dict[str, TensorMeta]
    objects: Dict[str, List[ObjectMeta]]
    files: Dict[str, int]  # data file -> expected size in bytes
    aliases: Dict[str, str] = field(default_factory=dict)  # tied key -> stored key
    framework: str = "torch"
    layout: Dict[str, Any] = field(default_factory=dict)
    step: Optional[int] = None
    world_size: int = 1
    version: int = FORMAT_VERSION
    chunk_bytes: int = CHUNK_BYTES

    def to_json(self) -> bytes:
        body = {"format": FORMAT_NAME, "version": self.version, **asdict(self)}
        return json.dumps(body, separators=(",", ":")).encode()

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def stored_entries(metadata: Metadata) -> set:
    """The top-level state entries a checkpoint holds: `model` of `model/...`, an object's name."""
    return {k.split("/", 1)[0] for k in list(metadata.tensors) + list(metadata.objects) + list(metadata.aliases)}


# --- decoding: every field is type-checked, so a hostile file yields MetadataError only ---

def _need(cond: bool, what: str) -> None:
    if not cond:
        raise MetadataError(f"malformed metadata: {what}")


def _int(value, what: str, minimum: int = 0) -> int:
    _need(type(value) is int and value >= minimum, f"{what} must be an integer >= {minimum}")
    return value


def _ints(value, what: str) -> Tuple[int, ...]:
    _need(isinstance(value, list) and len(value) <= 64, f"{what} must be a list of integers")
    return tuple(_int(v, what) for v in value)


def _dict(value, what: str) -> dict:
    _need(isinstance(value, dict), f"{what} must be an object")
    return value


def _item_fields(raw: dict, what: str, chunk_bytes: int) -> dict:
    raw = _dict(raw, what)
    nbytes = _int(raw.get("nbytes"), f"{what}.nbytes")
    crc = raw.get("crc32c")
    _need(isinstance(crc, list) and all(type(c) is int for c in crc)
          and len(crc) == max(1, math.ceil(nbytes / chunk_bytes)),
          f"{what}.crc32c must hold one checksum per chunk")
    return dict(file=check_relative_path(raw.get("file")), offset=_int(raw.get("offset"), f"{what}.offset"),
                nbytes=nbytes, crc32c=crc)


def _tensor(key: str, raw: dict, chunk_bytes: int) -> TensorMeta:
    raw = _dict(raw, f"tensor {key}")
    shape = _ints(raw.get("shape"), f"{key}.shape")
    dtype = raw.get("dtype")
    itemsize = dtype_from_name(dtype).itemsize
    boxes = []
    raw_boxes = raw.get("boxes")
    _need(isinstance(raw_boxes, list), f"{key}.boxes must be a list")
    for i, rb in enumerate(raw_boxes):
        what = f"{key}.boxes[{i}]"
        box = StoredBox(**_item_fields(rb, what, chunk_bytes),
                        offsets=_ints(rb.get("offsets"), f"{what}.offsets"),
                        lengths=_ints(rb.get("lengths"), f"{what}.lengths"))
        _need(len(box.offsets) == len(shape) == len(box.lengths), f"{what} rank differs from the tensor's")
        _need(all(o + n <= s for o, n, s in zip(box.offsets, box.lengths, shape)),
              f"{what} lies outside shape {list(shape)}")
        _need(box.nbytes == math.prod(box.lengths) * itemsize, f"{what}.nbytes disagrees with its box")
        boxes.append(box)
    return TensorMeta(shape=shape, dtype=dtype, boxes=boxes)


def _object(key: str, raw: dict, chunk_bytes: int) -> ObjectMeta:
    raw = _dict(raw, f"object {key}")
    meta = ObjectMeta(**_item_fields(raw, f"object {key}", chunk_bytes),
                      encoding=raw.get("encoding"), rank=raw.get("rank"))
    _need(meta.encoding in ("json", "torch"), f"object {key} has unknown encoding {meta.encoding!r}")
    _need(meta.rank is None or type(meta.rank) is int, f"object {key}.rank must be an integer or null")
    return meta


@gc_paused
def decode_metadata(data: bytes) -> Metadata:
    """Parse and validate metadata bytes. Raises MetadataError (or UnsafePathError) only."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MetadataError(f"metadata is not valid JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise MetadataError(f"metadata file is not a {FORMAT_NAME} checkpoint's (no 'format' marker)")
    version = raw.get("version")
    _int(version, "version", 1)
    if version > FORMAT_VERSION:
        raise MetadataError(f"checkpoint format version {version} is newer than this ckpt_plugins "
                            f"understands ({FORMAT_VERSION}); upgrade ckpt_plugins to load it")
    chunk_bytes = _int(raw.get("chunk_bytes"), "chunk_bytes", 1)
    tensors = {k: _tensor(k, v, chunk_bytes) for k, v in _dict(raw.get("tensors"), "tensors").items()}
    objects = {}
    for k, v in _dict(raw.get("objects"), "objects").items():
        _need(isinstance(v, list), f"objects.{k} must be a list")
        objects[k] = [_object(k, o, chunk_bytes) for o in v]
    files = {check_relative_path(f): _int(n, f"files.{f}") for f, n in _dict(raw.get("files"), "files").items()}
    for key, item in [(k, b) for k, t in tensors.items() for b in t.boxes] + \
                     [(k, o) for k, objs in objects.items() for o in objs]:
        _need(item.file in files, f"{key} is stored in {item.file}, which the file table lacks")
        _need(item.offset + item.nbytes <= files[item.file], f"{key} extends past the end of {item.file}")
    aliases = _dict(raw.get("aliases", {}), "aliases")
    for alias, target in aliases.items():
        _need(isinstance(target, str) and target in tensors, f"alias {alias} points to missing tensor {target!r}")
    step = raw.get("step")
    _need(step is None or type(step) is int, "step must be an integer or null")
    layout = _dict(raw.get("layout", {}), "layout")
    framework = raw.get("framework")
    _need(isinstance(framework, str), "framework must be a string")
    return Metadata(tensors=tensors, objects=objects, files=files, aliases=aliases,
                    framework=framework, layout=layout, step=step,
                    world_size=_int(raw.get("world_size"), "world_size", 1),
                    version=version, chunk_bytes=chunk_bytes)
