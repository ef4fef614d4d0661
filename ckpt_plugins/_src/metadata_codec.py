"""Metadata bytes: written in the current format version, read in every version ever written.

The envelope (format marker, version, step, layout, objects, aliases) is the same JSON in every
version; the tensor and file tables are version 1's JSON objects (`format_v1`) or version 2's
columns (`format_v2`, also version 3's, which adds `casts`, version 4's, which adds the
compressed boxes' columns, and version 5's, which stores each column in its narrowest width).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict
from typing import Optional

from . import format_v1, format_v2
from .errors import MetadataError
from .format import (CAST_DTYPES, FORMAT_NAME, DeltaRef, FORMAT_VERSION, Metadata, ObjectMeta, check_in_file, item_fields, need,
                     require_dict, require_int)
from .gcpause import gc_paused


def encode_metadata(metadata: Metadata) -> bytes:
    """`metadata` as the bytes of a current-version metadata file (its first bytes are the
    format marker `is_checkpoint` looks for)."""
    body = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "chunk_bytes": metadata.chunk_bytes,
            "framework": metadata.framework, "layout": metadata.layout, "step": metadata.step,
            "world_size": metadata.world_size, **format_v2.encode_tables(metadata.tensors, metadata.files),
            "objects": {k: [_object_fields(o) for o in objs] for k, objs in metadata.objects.items()},
            "aliases": metadata.aliases, "casts": metadata.casts,
            "delta": None if metadata.delta is None else asdict(metadata.delta)}
    return json.dumps(body, separators=(",", ":")).encode()


@gc_paused
def decode_metadata(data: bytes) -> Metadata:
    """Parse and validate metadata bytes of any version. Raises MetadataError (or
    UnsafePathError) only."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MetadataError(f"metadata is not valid JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise MetadataError(f"metadata file is not a {FORMAT_NAME} checkpoint's (no 'format' marker)")
    version = require_int(raw.get("version"), "version", 1)
    if version > FORMAT_VERSION:
        raise MetadataError(f"checkpoint format version {version} is newer than this ckpt_plugins "
                            f"understands ({FORMAT_VERSION}); upgrade ckpt_plugins to load it")
    chunk_bytes = require_int(raw.get("chunk_bytes"), "chunk_bytes", 1)
    if version == 1:
        tensors, files = format_v1.decode_tables(raw, chunk_bytes)
    else:
        tensors, files = format_v2.decode_tables(raw, chunk_bytes, version)
    objects = {}
    for k, v in require_dict(raw.get("objects"), "objects").items():
        need(isinstance(v, list), f"objects.{k} must be a list")
        objects[k] = [_object(k, o, chunk_bytes) for o in v]
    for key, objs in objects.items():
        for item in objs:
            check_in_file(key, item, files)
    aliases = require_dict(raw.get("aliases", {}), "aliases")
    for alias, target in aliases.items():
        need(isinstance(target, str) and target in tensors, f"alias {alias} points to missing tensor {target!r}")
    casts = _casts(raw.get("casts", {}) if version >= 3 else {}, tensors)
    delta = _delta(raw.get("delta") if version >= 4 else None)
    step = raw.get("step")
    need(step is None or type(step) is int, "step must be an integer or null")
    layout = require_dict(raw.get("layout", {}), "layout")
    framework = raw.get("framework")
    need(isinstance(framework, str), "framework must be a string")
    return Metadata(tensors=tensors, objects=objects, files=files, aliases=aliases, casts=casts, delta=delta,
                    framework=framework, layout=layout, step=step,
                    world_size=require_int(raw.get("world_size"), "world_size", 1),
                    version=version, chunk_bytes=chunk_bytes)


def _casts(raw, tensors) -> dict:
    """Weights stored as their masters' cast: each an entry without boxes, its source an fp32
    tensor of the same shape."""
    for key, source in require_dict(raw, "casts").items():
        need(isinstance(source, str) and source in tensors, f"cast {key} names missing tensor {source!r}")
        need(key in tensors, f"cast {key} has no tensor entry")
        (shape, dtype, boxes), (source_shape, source_dtype, _) = tensors.describe(key), tensors.describe(source)
        need(not boxes, f"cast {key} must be a tensor entry without boxes")
        need(source_dtype == "float32" and dtype in CAST_DTYPES and shape == source_shape,
             f"cast {key} ({dtype} {list(shape)}) is no cast of {source} ({source_dtype} {list(source_shape)})")
    return raw


def _delta(raw) -> Optional[DeltaRef]:
    """The base of a delta checkpoint (its boxes' `delta` flags are checked where they are used:
    a delta box in a checkpoint without a base cannot be read)."""
    if raw is None:
        return None
    raw = require_dict(raw, "delta")
    need(isinstance(raw.get("path"), str) and raw["path"] != "", "delta.path must be a path")
    need(isinstance(raw.get("digest"), str) and re.fullmatch(r"[0-9a-f]{64}", raw["digest"]) is not None,
         "delta.digest must be a sha256 hex digest")
    return DeltaRef(raw["path"], raw["digest"], require_int(raw.get("depth"), "delta.depth", 1))


def _object_fields(meta: ObjectMeta) -> dict:
    """An object's entry: objects are stored plainly (no `group` or `packed`)."""
    fields = asdict(meta)
    del fields["group"], fields["packed"], fields["delta"]
    return fields


def _object(key: str, raw: dict, chunk_bytes: int) -> ObjectMeta:
    raw = require_dict(raw, f"object {key}")
    meta = ObjectMeta(**item_fields(raw, f"object {key}", chunk_bytes),
                      encoding=raw.get("encoding"), rank=raw.get("rank"))
    need(meta.encoding in ("json", "torch"), f"object {key} has unknown encoding {meta.encoding!r}")
    need(meta.rank is None or type(meta.rank) is int, f"object {key}.rank must be an integer or null")
    return meta
