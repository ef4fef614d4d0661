"""Encoding of extra state (objects): JSON when the value is plain JSON data, else torch.save.

Non-JSON values are read back with `torch.load(weights_only=True)`, whose unpickler only builds
tensors and plain containers, so loading never runs code from the checkpoint.
"""
from __future__ import annotations

import io
import json
import math
from typing import Any, NamedTuple

import torch

from .errors import CorruptCheckpointError


def _plain(value: Any) -> bool:
    if value is None or type(value) in (bool, int, str):
        return True
    if type(value) is float:
        return math.isfinite(value)
    if type(value) is list:
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return False


class Encoded(NamedTuple):
    encoding: str  # "json" or "torch"
    data: bytes


def encode_object(value: Any) -> Encoded:
    if _plain(value):
        return Encoded("json", json.dumps(value, separators=(",", ":")).encode())
    buf = io.BytesIO()
    torch.save(value, buf)
    data = buf.getvalue()
    if not _loadable(value):
        try:  # refuse at save time what could never be loaded safely
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:
            raise TypeError(f"{type(value).__name__} is neither JSON data nor tensors/containers that "
                            f"torch.load(weights_only=True) accepts: {exc}") from None
    return Encoded("torch", data)


_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _loadable(value: Any, depth: int = 0) -> bool:
    """Whether `value` is made only of what `torch.load(weights_only=True)` always rebuilds (plain
    scalars, tuples, lists, dicts, plain CPU tensors), so a save need not load it back to know:
    that round trip cost more than the pickling (an optimizer's param_groups, an RNG state).
    False means: check by loading it back."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if depth > 32:  # deep, or a cycle
        return False
    if kind in (tuple, list):
        return all(_loadable(v, depth + 1) for v in value)
    if kind is dict:
        return all(type(k) in _SCALARS and _loadable(v, depth + 1) for k, v in value.items())
    return (kind is torch.Tensor and value.device.type == "cpu" and value.layout == torch.strided
            and not value.is_quantized and not vars(value))  # attributes set on it are pickled too


def decode_object(key: str, encoding: str, data: bytes) -> Any:
    try:
        if encoding == "json":
            return json.loads(data)
        if encoding == "text":  # a foreign checkpoint's text file (HF config.json)
            return data.decode()
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(f"object {key} cannot be decoded as {encoding} data: {exc}") from None
