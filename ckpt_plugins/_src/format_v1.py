"""Format version 1: the tensor table as JSON objects, one per tensor and per box (still read;
written by releases before version 2)."""
from __future__ import annotations

import math
from typing import Dict, Tuple

from .format import (StoredBox, TensorMeta, check_in_file, check_relative_path, dtype_from_name, item_fields, need, require_dict,
                     require_int, require_ints)


def decode_tables(raw: dict, chunk_bytes: int) -> Tuple[Dict[str, TensorMeta], Dict[str, int]]:
    """The tensor table and the file table of a version-1 body, every field checked."""
    tensors = {k: _tensor(k, v, chunk_bytes) for k, v in require_dict(raw.get("tensors"), "tensors").items()}
    files = {check_relative_path(f): require_int(n, f"files.{f}")
             for f, n in require_dict(raw.get("files"), "files").items()}
    for key, meta in tensors.items():
        for box in meta.boxes:
            check_in_file(key, box, files)
    return tensors, files


def _tensor(key: str, raw: dict, chunk_bytes: int) -> TensorMeta:
    raw = require_dict(raw, f"tensor {key}")
    shape = require_ints(raw.get("shape"), f"{key}.shape")
    dtype = raw.get("dtype")
    itemsize = dtype_from_name(dtype).itemsize
    boxes = []
    raw_boxes = raw.get("boxes")
    need(isinstance(raw_boxes, list), f"{key}.boxes must be a list")
    for i, rb in enumerate(raw_boxes):
        what = f"{key}.boxes[{i}]"
        box = StoredBox(**item_fields(rb, what, chunk_bytes),
                        offsets=require_ints(rb.get("offsets"), f"{what}.offsets"),
                        lengths=require_ints(rb.get("lengths"), f"{what}.lengths"))
        need(len(box.offsets) == len(shape) == len(box.lengths), f"{what} rank differs from the tensor's")
        need(all(o + n <= s for o, n, s in zip(box.offsets, box.lengths, shape)),
             f"{what} lies outside shape {list(shape)}")
        need(box.nbytes == math.prod(box.lengths) * itemsize, f"{what}.nbytes disagrees with its box")
        boxes.append(box)
    return TensorMeta(shape=shape, dtype=dtype, boxes=boxes)
