"""A model's tensors as fragments of canonical tensors.

Most tensors are stored under their own (canonical) name: a plain tensor whole, a DTensor as its
local shard's box. Some are views onto tensors of other names (a library's fused in-memory
experts stored as the per-expert tensors its files name), whichever way a framework shards them (a
DTensor row block, a flat range). `TensorMap` says which, for one model, and cuts every tensor,
shard or flat piece of it that way, so model weights, masters and optimizer moments of every
framework follow one mapping. Extensions provide the maps of their frameworks' models
(`register_model_mapping`, or the `ckpt_plugins.model_mappings` entry point).
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .families.segments import Segment, segment_fragments, segment_names, within
from .fragment import FlatPiece, Fragment, box_fragment, piece_fragments


def is_dtensor(tensor: Any) -> bool:
    """Whether `tensor` is a DTensor. Without importing torch.distributed.tensor (about 1 s, paid
    by every tool otherwise): until something imports it, no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


@functools.lru_cache(maxsize=None)
def _dtensor_box(shape: torch.Size, mesh, placements) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """This rank's (local shape, global offsets) of a DTensor layout. Cached: it is the same at
    every save, and recomputing it for every tensor was most of a cached save's planning time."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    for placement in placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(f"DTensor placement {placement} is not supported; only Shard(dim) and "
                             "Replicate() are")
    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local_shape), tuple(offsets)


def local_box(key: str, tensor: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """(the rank's part of `tensor`, its offsets in the global tensor): a plain tensor whole, a
    DTensor's local shard without the padding uneven shards may carry."""
    if not is_dtensor(tensor):
        return tensor.detach(), (0,) * tensor.dim()
    try:
        shape, offsets = _dtensor_box(tensor.shape, tensor.device_mesh, tuple(tensor.placements))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    # the local shard itself: DTensor.to_local()/detach() dispatch through autograd, ~10x slower
    local = tensor._local_tensor.detach()
    for d, n in enumerate(shape):
        if local.shape[d] != n:
            local = local.narrow(d, 0, n)
    return local, offsets


def tensor_fragments(key: str, tensor: torch.Tensor) -> List[Fragment]:
    """The fragment of a plain tensor (whole, replicated) or of a DTensor's local shard."""
    if not is_dtensor(tensor):  # the common case, once per tensor per save: no box to clip
        tensor = tensor.detach()
        return [Fragment(key, tuple(tensor.shape), tensor.dtype, (0,) * tensor.dim(), tensor)]
    local, offsets = local_box(key, tensor)
    frag = box_fragment(key, tuple(tensor.shape), offsets, local)
    return [frag] if frag is not None else [Fragment(key, tuple(tensor.shape), tensor.dtype, offsets, local)]


Segments = Callable[[str, Tuple[int, ...]], Optional[Tuple[Segment, ...]]]


def _own_names(name: str, shape: Tuple[int, ...]) -> None:
    return None


@dataclass(frozen=True)
class TensorMap:
    """How one model's tensors (by canonical in-memory name and global shape) are stored.
    `segments(name, shape)`: the canonical tensors a tensor is made of, as segments of the whole
    tensor; None when it is stored under its own name. A pure, cached function: a family's
    mapping (`families`) or a framework layout's (DeepSpeed AutoEP's grouped experts)."""
    segments: Segments = _own_names

    def names(self, name: str, shape: Sequence[int]) -> List[Tuple[str, Tuple[int, ...]]]:
        """(stored name, shape) of every tensor that `name` is stored as."""
        shape = tuple(int(s) for s in shape)
        return segment_names(self.segments(name, shape), name, shape)

    def renamed(self, name: str) -> str:
        """The stored name of a tensor stored whole under another name (PEFT's wrapped names,
        Mixtral's router): what a tied tensor's alias names. Renames never depend on the shape."""
        segments = self.segments(name, ())
        return segments[0].name if segments is not None and len(segments) == 1 else name

    def fragments(self, name: str, tensor: torch.Tensor, key_of: Callable[[str], str]) -> List[Fragment]:
        """A tensor shaped like `name` (plain, or a DTensor shard of it) as stored fragments."""
        segments = self.segments(name, tuple(tensor.shape))
        if segments is None:
            return tensor_fragments(key_of(name), tensor)
        local, offsets = local_box(key_of(name), tensor)
        return segment_fragments(within(segments, (offsets, tuple(local.shape))), tuple(local.shape), local, key_of)

    def piece_fragments(self, pieces: Sequence[FlatPiece], flat: torch.Tensor,
                        key_of: Callable[[str], str]) -> List[Fragment]:
        """The fragments of the 1-D buffer `flat` holding `pieces` (flat ranges of tensors)."""
        out: List[Fragment] = []
        for piece in pieces:
            segments = self.segments(piece.name, tuple(piece.shape))
            if segments is None:
                out += piece_fragments([piece], flat, key_of)
            else:
                out += segment_fragments(segments, piece.shape, flat[piece.offset:piece.offset + piece.numel],
                                         key_of, start=piece.start)
        return out


IDENTITY = TensorMap()


def _no_objects(prefix: str) -> Dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ModelMapping:
    """What an extension knows about storing one model: its tensors' map, and the objects stored
    beside them, by key under a prefix (an adapter's config, say)."""
    tensors: TensorMap = IDENTITY
    objects: Callable[[str], Dict[str, Any]] = _no_objects


Provider = Callable[[Any], Optional[ModelMapping]]
_PROVIDERS: List[Provider] = []
_DISCOVERED: List[bool] = []
ENTRY_POINTS = "ckpt_plugins.model_mappings"  # installed extensions' providers, found on first use


def register_model_mapping(provider: Provider) -> None:
    """Make `provider(module)` (a ModelMapping, or None for a model it does not know) consulted
    for every model, newest first: how an extension stores the models of its framework."""
    if provider not in _PROVIDERS:
        _PROVIDERS.insert(0, provider)


def model_mapping(module: Any) -> ModelMapping:
    """How `module` is stored: the first registered provider's mapping, else its own names."""
    if not _DISCOVERED:
        _DISCOVERED.append(True)
        for entry in entry_points(group=ENTRY_POINTS):
            register_model_mapping(entry.load())
    for provider in _PROVIDERS:
        found = provider(module)
        if found is not None:
            return found
    return ModelMapping()


def tensor_map(module: Any) -> TensorMap:
    return model_mapping(module).tensors
