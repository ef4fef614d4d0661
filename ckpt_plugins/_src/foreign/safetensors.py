"""HF model directories (`model.safetensors`, or shards listed by `model.safetensors.index.json`,
with `config.json`) as foreign checkpoints: every tensor is one box at the byte offset its file's
header gives, under `model/<name>`; block-quantized FP8 weights (a `<name>_scale_inv` beside each,
`quantization_config.weight_block_size` in config.json) load dequantized into the model's dtype.

safetensors layout: an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets}}, offsets relative to the data start), then the raw bytes. Every field is checked
before anything is read; nothing in the files is executed.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import CorruptCheckpointError, NotACheckpointError
from ..families.hf_config import HF_CONFIG
from ..format import MODEL, ObjectMeta, check_relative_path, dtype_from_name
from ..storage import Storage
from .view import FOREIGN_CHUNK, BlockDequant, ForeignMetadata, raw_box, tensor_meta

NAME = "HF safetensors"
SAFE_NAME, SAFE_INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
MAX_HEADER = 100 << 20
SCALE_SUFFIX = "_scale_inv"


def read_header(storage: Storage, name: str) -> Tuple[Dict[str, dict], int]:
    """A safetensors file's tensor entries (validated: dtype, shape, byte ranges inside the file
    and disjoint) and the byte offset where its data starts."""
    where = f"{storage}/{name}"
    size = storage.size(name)
    if size < 8:
        raise CorruptCheckpointError(f"{where} is not a safetensors file (shorter than its header length)")
    head = bytearray(8)
    storage.read_into(name, 0, head)
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER or 8 + length > size:
        raise CorruptCheckpointError(f"{where}: safetensors header of {length} bytes does not fit the file "
                                     f"({size} bytes): truncated or not safetensors")
    raw = bytearray(length)
    storage.read_into(name, 8, raw)
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: safetensors header is not a JSON object")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = []
    for tname, entry in entries.items():
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{where}: tensor {tname} has no entry object")
        start, end = (entry.get("data_offsets") or (None, None))[:2] if isinstance(entry.get("data_offsets"), list) \
            else (None, None)
        dtype, shape = FROM_ST.get(entry.get("dtype")), entry.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise CorruptCheckpointError(f"{where}: tensor {tname} has an unsupported dtype or shape {entry}")
        if (type(start), type(end)) != (int, int) or not 0 <= start <= end \
                or end - start != math.prod(shape) * dtype.itemsize or 8 + length + end > size:
            raise CorruptCheckpointError(f"{where}: tensor {tname}'s byte range {start}..{end} does not fit its "
                                         f"shape {shape} {entry.get('dtype')} or the file ({size} bytes)")
        spans.append((start, end, tname))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise CorruptCheckpointError(f"{where}: tensors {a} and {b} overlap (bytes {start}..{end})")
    return entries, 8 + length


def is_hf_dir(storage: Storage) -> bool:
    return storage.exists(SAFE_INDEX) or storage.exists(SAFE_NAME)


def _files(storage: Storage) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """The safetensors files and, when sharded, the index's weight map."""
    if not storage.exists(SAFE_INDEX):
        return [SAFE_NAME], None
    try:
        weight_map = json.loads(storage.read_bytes(SAFE_INDEX))["weight_map"]
        assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
    except (ValueError, KeyError, TypeError, AssertionError):
        raise CorruptCheckpointError(f"{storage}/{SAFE_INDEX} is not a safetensors index (no weight_map of "
                                     "tensor -> file)") from None
    files = sorted(set(weight_map.values()))
    for name in files:
        check_relative_path(name)
        if not storage.exists(name):
            raise NotACheckpointError(f"{storage}/{SAFE_INDEX} names {name}, which the directory lacks "
                                      "(an incomplete download?)")
    return files, weight_map


def _block(config: dict) -> Optional[Tuple[int, int]]:
    quant = config.get("quantization_config") or {}
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise CorruptCheckpointError(f"config.json: FP8 quantization_config has no weight_block_size [rows, cols] "
                                     f"({quant}); only block-quantized FP8 checkpoints load")
    return tuple(block)


def safetensors_metadata(storage: Storage, files: List[str], key_of: Callable[[str], str]) -> ForeignMetadata:
    """safetensors `files` of `storage` as foreign metadata: each tensor one box, under key_of(name)."""
    tensors, sizes = {}, {}
    for name in files:
        header, data_start = read_header(storage, name)
        sizes[name] = storage.size(name)
        for tname, entry in sorted(header.items()):
            dtype, shape = FROM_ST[entry["dtype"]], entry["shape"]
            box = raw_box(name, data_start + entry["data_offsets"][0], dtype, (0,) * len(shape), shape)
            key = key_of(tname)
            if key in tensors:
                raise CorruptCheckpointError(f"{storage}: tensor {tname} is in {tensors[key].boxes[0].file} and in {name}")
            tensors[key] = tensor_meta(shape, dtype, [box])
    return ForeignMetadata(tensors=tensors, objects={}, files=sizes, chunk_bytes=FOREIGN_CHUNK,
                           source="safetensors")


def read_hf_dir(storage: Storage) -> ForeignMetadata:
    """The HF model directory at `storage` as foreign metadata (see the module docstring)."""
    files, weight_map = _files(storage)
    view = safetensors_metadata(storage, files, lambda name: f"{MODEL}/{name}")
    tensors, sizes, objects, aliases, transforms = view.tensors, view.files, {}, {}, {}
    for tname, fname in (weight_map or {}).items():
        meta = tensors.get(f"{MODEL}/{tname}")
        if meta is None or meta.boxes[0].file != fname:
            raise CorruptCheckpointError(f"{storage}/{SAFE_INDEX} puts {tname} in {fname}, whose header lacks it")
    config = {}
    if storage.exists(CONFIG):
        text = storage.read_bytes(CONFIG)
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{storage}/{CONFIG} is not JSON: {exc}") from None
        sizes[CONFIG] = len(text)
        objects[HF_CONFIG] = [ObjectMeta(file=CONFIG, offset=0, nbytes=len(text), crc32c=[], encoding="text")]
    if config.get("tie_word_embeddings") and "model/lm_head.weight" not in tensors \
            and "model/model.embed_tokens.weight" in tensors:
        aliases["model/lm_head.weight"] = "model/model.embed_tokens.weight"
    block = _block(config)
    for key, meta in tensors.items():
        scale = tensors.get(key + SCALE_SUFFIX)
        if block is None or scale is None or not meta.dtype.startswith("float8"):
            continue
        want = tuple(-(-s // b) for s, b in zip(meta.shape, block))
        if len(meta.shape) != 2 or tuple(scale.shape) != want:
            raise CorruptCheckpointError(f"{storage}: {key}{SCALE_SUFFIX} has shape {list(scale.shape)}; blocks of "
                                         f"{list(block)} over {list(meta.shape)} need {list(want)}")
        transforms[key] = BlockDequant(key + SCALE_SUFFIX, want, dtype_from_name(scale.dtype), block,
                                       getattr(torch, config.get("dtype") or config.get("torch_dtype") or "bfloat16"))
    if not tensors:
        raise NotACheckpointError(f"{storage} holds no tensors in its safetensors files")
    return ForeignMetadata(tensors=tensors, objects=objects, files=sizes, aliases=aliases, framework="hf",
                           layout={"format": "hf-safetensors"}, chunk_bytes=FOREIGN_CHUNK, source=NAME,
                           transforms=transforms, descriptive=(HF_CONFIG,))
