"""A model's tensors as fragments of canonical tensors.

Most tensors are stored under their own (canonical) name: a plain tensor whole, a DTensor as its
local shard's box. Some are views onto tensors of other names: transformers' fused MoE experts
(`families.hf_experts`) are stored as per-expert tensors, whichever way a framework shards them
(a DTensor row block, an FSDP1 or ZeRO flat range). `TensorMap` says which, for one model, and cuts
every tensor, shard or flat piece of it that way, so model weights, masters and optimizer moments
of every framework follow one mapping.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .families.hf_experts import FUSED, expert_segments, segment_names
from .families.peft import peft_segments
from .families.segments import Segment, segment_fragments, within
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


def is_peft_model(module: Any) -> bool:
    """A PEFT `PeftModel` (or a wrapper forwarding to one), by what it has rather than its class:
    the core imports no framework."""
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def tensor_map(module: Any) -> TensorMap:
    """The map of a model: a PEFT model's base under the base model's names and its adapters under
    theirs; transformers' MoE families by their config's `model_type`."""
    peft = is_peft_model(module)
    base = module.get_base_model() if peft else module
    family = getattr(getattr(base, "config", None), "model_type", None)
    if peft:
        return TensorMap(functools.partial(peft_segments, family))
    return TensorMap(functools.partial(expert_segments, family)) if family in FUSED else IDENTITY
