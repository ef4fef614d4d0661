"""Handlers: turn entries of a user's `state` into fragments and objects, and back.

One handler per top-level entry. The core ships handlers for what torch itself provides:
`nn.Module` (plain, DDP, DTensor/FSDP2/tensor parallel), `torch.optim.Optimizer`, tensors and
DTensors, anything with `state_dict`/`load_state_dict`, nested dicts and plain objects.
Framework extensions add their own `Handler` subclasses and pass them as state values.
"""
from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .errors import LoadMismatchError
from .format import Metadata
from .fragment import Fragment, box_fragment

log = logging.getLogger(__name__)

# Wrapper modules that add a path component without changing the model's own names.
WRAPPER_COMPONENTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")

# The state keys under which checkpoints move between frameworks: `model/<param>` holds weights in
# the training dtype, `optim/<param>/<state>` the optimizer's, and `optim/<param>/master` the fp32
# master weights of mixed-precision frameworks (stored only where they differ from the weights).
MODEL, OPTIM, MASTER = "model", "optim", "master"


def master_key(name: str) -> str:
    """Where the fp32 master copy of parameter `name` is stored."""
    return f"{OPTIM}/{name}/{MASTER}"


def weight_key(name: str) -> str:
    return f"{MODEL}/{name}"


class PerRank:
    """Marks a value that differs per rank (RNG states): saved with its rank, restored to it."""

    def __init__(self, value: Any):
        self.value = value


@dataclass
class SaveItems:
    fragments: List[Fragment] = field(default_factory=list)
    objects: Dict[str, Any] = field(default_factory=dict)  # replicated: stored once
    per_rank: Dict[str, Any] = field(default_factory=dict)  # stored with this rank's id
    aliases: Dict[str, str] = field(default_factory=dict)

    def extend(self, other: "SaveItems") -> None:
        self.fragments += other.fragments
        self.objects.update(other.objects)
        self.per_rank.update(other.per_rank)
        self.aliases.update(other.aliases)


@dataclass
class LoadItems:
    fragments: List[Fragment] = field(default_factory=list)  # destinations, filled in place
    objects: Dict[str, Callable[[Any], None]] = field(default_factory=dict)  # key -> setter
    per_rank: Dict[str, Callable[[Any], None]] = field(default_factory=dict)
    accepted: Set[str] = field(default_factory=set)  # keys consumed without a destination (aliases)
    finish: List[Callable[[], None]] = field(default_factory=list)  # after all data has landed

    def extend(self, other: "LoadItems") -> None:
        self.fragments += other.fragments
        self.objects.update(other.objects)
        self.per_rank.update(other.per_rank)
        self.accepted |= other.accepted
        self.finish += other.finish


class Handler(ABC):
    """Saves and loads one state entry under a key prefix."""

    @abstractmethod
    def save_items(self, prefix: str) -> SaveItems: ...

    @abstractmethod
    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems: ...


# ------------------------------------------------------------------ tensors


@functools.lru_cache(maxsize=None)
def _dtensor_box(shape: torch.Size, mesh, placements) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """This rank's (local shape, global offsets) of a DTensor layout. Cached: it is the same at
    every save, and recomputing it for every tensor was most of a cached save's planning time."""
    for placement in placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(f"DTensor placement {placement} is not supported; only Shard(dim) and "
                             "Replicate() are")
    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local_shape), tuple(offsets)


def tensor_fragments(key: str, tensor: torch.Tensor) -> List[Fragment]:
    """The fragment of a plain tensor (whole, replicated) or of a DTensor's local shard."""
    if not isinstance(tensor, DTensor):
        tensor = tensor.detach()
        return [Fragment(key, tuple(tensor.shape), tensor.dtype, (0,) * tensor.dim(), tensor)]
    try:
        shape, offsets = _dtensor_box(tensor.shape, tensor.device_mesh, tuple(tensor.placements))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    # the local shard itself: DTensor.to_local()/detach() dispatch through autograd, ~10x slower
    local = tensor._local_tensor.detach()
    for d, n in enumerate(shape):  # uneven shards may carry padding past the real extent
        if local.shape[d] != n:
            local = local.narrow(d, 0, n)
    frag = box_fragment(key, tuple(tensor.shape), offsets, local)
    return [frag] if frag is not None else [Fragment(key, tuple(tensor.shape), tensor.dtype,
                                                     tuple(offsets), local)]


def canonical_name(name: str) -> str:
    """A module's parameter name without wrapper components."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_COMPONENTS)


def unwrap(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    while isinstance(module, DistributedDataParallel) or hasattr(module, "_orig_mod"):
        module = module.module if isinstance(module, DistributedDataParallel) else module._orig_mod
    return module


def _storage_id(tensor: torch.Tensor):
    t = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


# ------------------------------------------------------------------ modules


class ModuleHandler(Handler):
    """An nn.Module's state_dict under canonical names; tied tensors are stored once."""

    def __init__(self, module: nn.Module):
        self.module = unwrap(module)

    def named_tensors(self) -> Dict[str, torch.Tensor]:
        return {canonical_name(k): v for k, v in self.module.state_dict().items()}

    def param_names(self) -> Dict[int, str]:
        return {id(p): canonical_name(n) for n, p in self.module.named_parameters()}

    def _split_tied(self, prefix: str):
        first: Dict[Any, str] = {}
        own, aliases = {}, {}
        for name, tensor in self.named_tensors().items():
            sid = _storage_id(tensor)
            key = f"{prefix}/{name}"
            if sid in first and tensor.numel():
                aliases[key] = first[sid]
            else:
                first.setdefault(sid, key)
                own[key] = tensor
        return own, aliases

    def save_items(self, prefix: str) -> SaveItems:
        own, aliases = self._split_tied(prefix)
        items = SaveItems(aliases=aliases)
        for key, tensor in own.items():
            items.fragments += tensor_fragments(key, tensor)
        return items

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        own, aliases = self._split_tied(prefix)
        items = LoadItems(accepted=set(aliases))
        for key, tensor in own.items():
            # a checkpoint from a mixed-precision job may hold this weight in our dtype only as its master
            sources = (master_key(key[len(MODEL) + 1:]),) if prefix == MODEL else ()
            for frag in tensor_fragments(key, tensor):
                frag.sources = sources
                items.fragments.append(frag)
        return items


# ------------------------------------------------------------------ optimizers


class OptimizerHandler(Handler):
    """torch.optim state keyed by parameter name, never by the optimizer's integer ids.

    Tensor state of a parameter's shape takes the parameter's layout (DTensor shards included);
    param-group hyperparameters are one object, matched to groups by parameter names.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_names: Dict[int, str]):
        self.optimizer = optimizer
        self.names = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in param_names:
                    raise ValueError(f"optimizer parameter of shape {tuple(p.shape)} belongs to no module "
                                     "in the state: save the model in the same state dict")
                self.names[id(p)] = param_names[id(p)]

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def save_items(self, prefix: str) -> SaveItems:
        items = SaveItems()
        for p in self._params():
            for name, value in self.optimizer.state.get(p, {}).items():
                key = f"{prefix}/{self.names[id(p)]}/{name}"
                if isinstance(value, torch.Tensor):
                    items.fragments += tensor_fragments(key, value)
                else:
                    items.objects[key] = value
        items.objects[f"{prefix}/param_groups"] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [self.names[id(p)] for p in g["params"]]}
            for g in self.optimizer.param_groups]
        return items

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        items = LoadItems()
        stored = {}  # param name -> {state name: kind}
        for key in list(metadata.tensors) + list(metadata.objects):
            if key.startswith(prefix + "/") and key != f"{prefix}/param_groups":
                pname, _, sname = key[len(prefix) + 1:].rpartition("/")
                stored.setdefault(pname, {})[sname] = key in metadata.tensors
        for p in self._params():
            name = self.names[id(p)]
            state = self.optimizer.state[p]
            for sname in sorted(set(stored.get(name, {})) | set(state)):  # same order on every rank
                key = f"{prefix}/{name}/{sname}"
                is_tensor = stored.get(name, {}).get(sname, isinstance(state.get(sname), torch.Tensor))
                if not is_tensor:
                    items.objects[key] = lambda v, s=state, n=sname: s.__setitem__(n, v)
                    continue
                if sname not in state:
                    state[sname] = _allocate_like(p, metadata.tensors.get(key))
                items.fragments += tensor_fragments(key, state[sname])
        items.objects[f"{prefix}/param_groups"] = self._apply_groups
        return items

    def _apply_groups(self, saved_groups: List[dict]) -> None:
        by_param = {name: g for g in saved_groups for name in g["params"]}
        for group in self.optimizer.param_groups:
            sources = {id(by_param[self.names[id(p)]]) for p in group["params"] if self.names[id(p)] in by_param}
            if len(sources) > 1:
                names = [self.names[id(p)] for p in group["params"]]
                raise LoadMismatchError(f"a param group ({names[:3]}...) mixes parameters from saved groups "
                                        "with different hyperparameters; regroup to match the checkpoint")
            if sources:
                saved = by_param[next(self.names[id(p)] for p in group["params"] if self.names[id(p)] in by_param)]
                group.update({k: (tuple(v) if isinstance(group.get(k), tuple) else v)
                              for k, v in saved.items() if k != "params"})


def _allocate_like(param: torch.Tensor, meta) -> torch.Tensor:
    """Zeroed optimizer state for `param`, shaped as the checkpoint stores it."""
    from .format import dtype_from_name
    dtype = dtype_from_name(meta.dtype)
    if tuple(meta.shape) == tuple(param.shape):
        return torch.zeros_like(param, dtype=dtype)
    local = param.to_local() if isinstance(param, DTensor) else param
    return torch.zeros(meta.shape, dtype=dtype, device=local.device)


# ------------------------------------------------------------------ generic containers


class StatefulHandler(Handler):
    """Anything with state_dict()/load_state_dict(): an LR scheduler, a sampler, a user class."""

    def __init__(self, obj: Any):
        self.obj = obj

    def save_items(self, prefix: str) -> SaveItems:
        return DictHandler(self.obj.state_dict()).save_items(prefix)

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        template = self.obj.state_dict()
        items = DictHandler(template).load_items(prefix, metadata)
        items.finish.append(lambda: self.obj.load_state_dict(template))
        return items


class DictHandler(Handler):
    """A dict: tensors become fragments, nested dicts recurse, everything else is an object."""

    def __init__(self, mapping: dict, param_names: Optional[Dict[int, str]] = None):
        self.mapping = mapping
        self.param_names = param_names or {}

    def _children(self, prefix: str):
        for k, v in self.mapping.items():
            yield k, f"{prefix}/{k}" if prefix else str(k), v

    def save_items(self, prefix: str) -> SaveItems:
        items = SaveItems()
        for _, key, value in self._children(prefix):
            handler = handler_for(value, self.param_names)
            if handler is not None:
                items.extend(handler.save_items(key))
            elif isinstance(value, torch.Tensor):
                items.fragments += tensor_fragments(key, value)
            elif isinstance(value, PerRank):
                items.per_rank[key] = value.value
            else:
                items.objects[key] = value
        return items

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        items = LoadItems()
        for k, key, value in self._children(prefix):
            handler = handler_for(value, self.param_names)
            if handler is not None:
                items.extend(handler.load_items(key, metadata))
            elif isinstance(value, torch.Tensor):
                items.fragments += tensor_fragments(key, value)
            elif isinstance(value, PerRank):
                items.per_rank[key] = lambda v, box=value: setattr(box, "value", v)
            elif key not in metadata.objects and _object_subtree(metadata, key):
                # saved as a dict, wanted as a placeholder: rebuild the dict from its objects
                self.mapping[k] = _object_subtree(metadata, key)
                items.extend(DictHandler(self.mapping[k]).load_items(key, metadata))
            else:
                items.objects[key] = lambda v, d=self.mapping, k=k: d.__setitem__(k, v)
        return items


def _object_subtree(metadata: Metadata, prefix: str) -> dict:
    """A nested dict of None placeholders for the objects stored under `prefix/`."""
    tree: dict = {}
    for key in metadata.objects:
        if key.startswith(prefix + "/"):
            *path, leaf = key[len(prefix) + 1:].split("/")
            node = tree
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = None
    return tree


def handler_for(value: Any, param_names: Dict[int, str]) -> Optional[Handler]:
    if isinstance(value, Handler):
        return value
    if isinstance(value, nn.Module):
        return ModuleHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return OptimizerHandler(value, param_names)
    if isinstance(value, dict):
        return DictHandler(value, param_names)
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict") and not isinstance(value, torch.Tensor):
        return StatefulHandler(value)
    return None


def root_handler(state: dict) -> DictHandler:
    """The handler for a whole `state` dict; optimizers find their parameters' names in its modules."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of modules, optimizers and objects, got {type(state).__name__}")
    names: Dict[int, str] = {}
    for value in state.values():
        if isinstance(value, nn.Module):
            for pid, name in ModuleHandler(value).param_names().items():
                names.setdefault(pid, name)
    return DictHandler(state, names)
