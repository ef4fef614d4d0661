"""Handlers: turn entries of a user's `state` into fragments and objects, and back.

One handler per top-level entry. The core ships handlers for what torch itself provides:
`nn.Module` (plain, DDP, DTensor/FSDP2/tensor parallel), `torch.optim.Optimizer`, tensors and
DTensors, anything with `state_dict`/`load_state_dict`, nested dicts and plain objects.
Framework extensions add their own `Handler` subclasses and pass them as state values.
"""
from __future__ import annotations

import functools
import logging
import sys
from collections import OrderedDict
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from .errors import LoadMismatchError
from .format import MASTER, MODEL, Metadata, master_key
from .fragment import FlatPiece, Fragment
from .hostmem import fresh_empty
from .tensor_map import IDENTITY, TensorMap, is_dtensor, model_mapping, tensor_fragments

log = logging.getLogger(__name__)

# Wrapper modules that add a path component without changing the model's own names.
WRAPPER_COMPONENTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")

def add_master_sources(prefix: str, fragments: List[Fragment]) -> List[Fragment]:
    """Let model weights be filled from fp32 masters: a checkpoint from a mixed-precision job may
    hold a weight in the dtype we want only as its master."""
    if prefix == MODEL:
        for frag in fragments:
            frag.sources = (master_key(frag.key[len(MODEL) + 1:]),)
    return fragments


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
    frozen: Set[str] = field(default_factory=set)  # keys of frozen parameters (a save on a base may skip them)

    def extend(self, other: "SaveItems") -> None:
        self.fragments += other.fragments
        self.objects.update(other.objects)
        self.per_rank.update(other.per_rank)
        self.aliases.update(other.aliases)
        self.frozen |= other.frozen


@dataclass
class LoadItems:
    fragments: List[Fragment] = field(default_factory=list)  # destinations, filled in place
    objects: Dict[str, Callable[[Any], None]] = field(default_factory=dict)  # key -> setter
    per_rank: Dict[str, Callable[[Any], None]] = field(default_factory=dict)
    accepted: Set[str] = field(default_factory=set)  # keys consumed without a destination (aliases)
    finish: List[Callable[[], None]] = field(default_factory=list)  # after all data has landed
    undo: List[Callable[[], None]] = field(default_factory=list)  # if the load fails: drop what was created
    # before any data moves, given a reader of stored objects by key: refuse what cannot load (raise),
    # or return the keys found missing (None: none)
    checks: List[Callable[[Callable[[str], Any]], Optional[List[str]]]] = field(default_factory=list)

    def extend(self, other: "LoadItems") -> None:
        self.fragments += other.fragments
        self.objects.update(other.objects)
        self.per_rank.update(other.per_rank)
        self.accepted |= other.accepted
        self.finish += other.finish
        self.undo += other.undo
        self.checks += other.checks


class Handler(ABC):
    """Saves and loads one state entry under a key prefix."""

    @abstractmethod
    def save_items(self, prefix: str) -> SaveItems: ...

    @abstractmethod
    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems: ...


class Ignore(Handler):
    """A state entry that saves nothing and, on load, accepts whatever the checkpoint holds under
    its key without loading it: a strict load that wants part of a checkpoint (the weights of a
    training checkpoint, say) names the rest with Ignore()."""

    def save_items(self, prefix: str) -> SaveItems:
        return SaveItems()

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        stored = set(metadata.tensors) | set(metadata.objects) | set(metadata.aliases)
        return LoadItems(accepted={k for k in stored if k == prefix or k.startswith(prefix + "/")})


# ------------------------------------------------------------------ tensors


def canonical_name(name: str) -> str:
    """A module's parameter name without wrapper components."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_COMPONENTS)


def unwrap(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    while isinstance(module, DistributedDataParallel) or hasattr(module, "_orig_mod"):
        module = module.module if isinstance(module, DistributedDataParallel) else module._orig_mod
    return module


def _storage_id(tensor: torch.Tensor):
    t = tensor._local_tensor if is_dtensor(tensor) else tensor
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _register_sharded(module: nn.Module) -> None:
    """FSDP2 leaves a module's parameters gathered after a forward without backward (an evaluation
    pass) and registers its sharded ones again before `state_dict()`; reading the parameters
    directly needs the same. A job that never imported FSDP has no FSDP module (and pays no import)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for m in module.modules() if fsdp is not None else ():
        if isinstance(m, fsdp.FSDPModule):
            m.reshard()


# ------------------------------------------------------------------ modules


class ModuleHandler(Handler):
    """An nn.Module's state_dict under canonical names (through the model's `TensorMap`); tied
    tensors are stored once.

    A load fills the live tensors in place, except under a module that adapts what it loads
    itself (`loads_itself`: its own `load_state_dict` or `_load_from_state_dict`, or load hooks):
    those get the stored tensors, shaped as stored, through their own `load_state_dict`, as with
    torch."""

    def __init__(self, module: nn.Module):
        self.module = unwrap(module)
        self.mapping = model_mapping(self.module)
        self.map = self.mapping.tensors

    def named_tensors(self) -> Dict[str, torch.Tensor]:
        return {canonical_name(k): v for k, v in self.module.state_dict().items()}

    def param_layouts(self) -> Dict[int, "ParamLayout"]:
        _register_sharded(self.module)
        return {id(p): plain_layout(canonical_name(n), p, self.map) for n, p in self.module.named_parameters()}

    def _split_tied(self, prefix: str, named: Dict[str, torch.Tensor]):
        first: Dict[Any, str] = {}
        own, aliases = {}, {}
        for name, tensor in named.items():
            sid = _storage_id(tensor)
            key = f"{prefix}/{self.map.renamed(name)}"
            if sid in first and tensor.numel():
                aliases[key] = first[sid]
            else:
                first.setdefault(sid, key)
                own[name] = tensor
        return own, aliases

    def _fragments(self, prefix: str, own: Dict[str, torch.Tensor]) -> List[Fragment]:
        key_of = lambda n: f"{prefix}/{n}"  # noqa: E731
        return [f for name, tensor in own.items() for f in self.map.fragments(name, tensor, key_of)]

    def save_items(self, prefix: str) -> SaveItems:
        own, aliases = self._split_tied(prefix, self.named_tensors())
        return SaveItems(fragments=self._fragments(prefix, own), aliases=aliases, objects=self.mapping.objects(prefix),
                         frozen=frozen_keys(self.module, self.map, prefix))

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        named, finish = self._load_targets(prefix, metadata)
        own, aliases = self._split_tied(prefix, named)
        return LoadItems(fragments=add_master_sources(prefix, self._fragments(prefix, own)), finish=finish,
                         accepted=set(aliases) | set(self.mapping.objects(prefix)))

    def _load_targets(self, prefix: str, metadata: Metadata):
        """(canonical name -> the tensor a load fills, steps after the data has landed): the live
        tensors, or staging tensors for those under modules that load themselves."""
        live = self.module.state_dict()
        subtrees = _self_loading(self.module)
        if not subtrees:
            return {canonical_name(k): v for k, v in live.items()}, []
        staged: Dict[str, torch.Tensor] = {}
        for raw, tensor in live.items():
            if any(raw.startswith(p) for p, _ in subtrees):
                name = canonical_name(raw)
                stored = [f"{prefix}/{n}" for n, _ in self.map.names(name, tensor.shape)]
                if all(_stored_source(metadata, k) for k in stored):  # else missing: torch reports it
                    staged[raw] = _staging(tensor, metadata.tensors.get(_stored_source(metadata, stored[0]) or ""))
        named = {canonical_name(k): staged.get(k, v) for k, v in live.items()
                 if k in staged or not any(k.startswith(p) for p, _ in subtrees)}

        def through_torch(path: str, module: nn.Module) -> None:
            wanted = module.state_dict()
            given = OrderedDict((k[len(path):], v) for k, v in staged.items() if k.startswith(path))
            given._metadata = getattr(wanted, "_metadata", None)
            module.load_state_dict(given, strict=len(given) == len(wanted))

        return named, [functools.partial(through_torch, p, m) for p, m in subtrees]

def loads_itself(module: nn.Module) -> bool:
    """Whether `module` adapts what it loads (its own `_load_from_state_dict`, or load hooks that
    are not torch's own: FSDP2's, the checkpoint wrapper's are about layouts handled here)."""
    def foreign(hook) -> bool:
        fn = getattr(hook, "hook", hook)  # a pre-hook is wrapped
        fn = getattr(fn, "func", fn)  # a functools.partial
        return not (getattr(fn, "__module__", None) or "").startswith("torch.")

    return (type(module)._load_from_state_dict is not nn.Module._load_from_state_dict
            or any(map(foreign, module._load_state_dict_pre_hooks.values()))
            or any(map(foreign, module._load_state_dict_post_hooks.values())))


def _self_loading(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(state_dict key prefix, module) of the outermost modules of `root` that load themselves;
    the root itself when it overrides `load_state_dict`."""
    if type(root).load_state_dict is not nn.Module.load_state_dict:
        return [("", root)]
    found: List[Tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        path = f"{name}." if name else ""
        if not any(path.startswith(p) for p, _ in found) and loads_itself(module):
            found.append((path, module))
    return found


def _stored_source(metadata: Metadata, key: str) -> Optional[str]:
    """The stored key that holds `key` (itself, its alias' target, or its fp32 master)."""
    for k in (key, master_key(key[len(MODEL) + 1:]) if key.startswith(MODEL + "/") else None):
        k = metadata.aliases.get(k, k) if k else None
        if k in metadata.tensors:
            return k
    return None


def _staging(live: torch.Tensor, stored) -> torch.Tensor:
    """A tensor to load into for a module that loads itself: like `live` (a DTensor keeps its
    layout), shaped as stored where a plain tensor's shape differs (a buffer the module resizes)."""
    if is_dtensor(live):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(torch.empty_like(live._local_tensor), live.device_mesh, live.placements,
                                  run_check=False, shape=live.shape, stride=live.stride())
    shape = tuple(stored.shape) if stored is not None else tuple(live.shape)
    return torch.empty(shape, dtype=live.dtype, device=live.device)


def frozen_keys(module: nn.Module, tmap: TensorMap, prefix: str,
                shape_of: Callable[[torch.Tensor], Sequence[int]] = lambda p: p.shape) -> Set[str]:
    """The stored keys of `module`'s frozen parameters (any wrapper; a parameter whose global shape
    is hidden, such as a flat parameter, counts as trainable). `shape_of(p)`: a parameter's global
    shape, where a framework keeps it elsewhere."""
    return {f"{prefix}/{n}" for name, p in module.named_parameters() if not p.requires_grad
            for n, _ in tmap.names(canonical_name(name), shape_of(p))}


# ------------------------------------------------------------------ optimizers


@dataclass(frozen=True)
class ParamLayout:
    """How a tensor shaped like one optimizer-visible parameter maps onto canonical parameters.

    `names`/`shapes`: the canonical parameters it covers (one for a plain or DTensor parameter;
    several for a flat parameter packing many). `fragments(tensor, key_of)`: the fragments of a
    tensor of the parameter's local shape (optimizer moments, master weights) under the keys
    `key_of(name)`. Module handlers provide one per parameter; OptimizerHandler and framework
    extensions use them so that optimizer state is always stored per canonical parameter.
    """
    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    fragments: Callable[[torch.Tensor, Callable[[str], str]], List[Fragment]]
    # zeroes the parts of such a tensor that hold no parameter data (a partition's padding), which
    # state a load creates must not leave uninitialized; None: every element holds some
    pad: Optional[Callable[[torch.Tensor], None]] = None
    # where the tensor is a partition of its parameters (a flat buffer): which elements of which
    # parameter lie where in it, as (name, offset, numel, start). State of another shape is
    # then the partition's own (bitsandbytes' blockwise absmax), saved per rank with it and loaded
    # only into the same partition (`OptimizerHandler`). None: the parameters whole, or a DTensor.
    partition: Optional[Tuple[Tuple[Any, ...], ...]] = None


def _stored(tmap: TensorMap, names: Sequence[str], shapes: Sequence[Sequence[int]]):
    stored = [entry for name, shape in zip(names, shapes) for entry in tmap.names(name, shape)]
    return tuple(n for n, _ in stored), tuple(s for _, s in stored)


def flat_layout(names: Sequence[str], shapes: Sequence[Sequence[int]], pieces: List[FlatPiece],
                tmap: TensorMap = IDENTITY) -> ParamLayout:
    """A flat buffer packing pieces of the parameters `names` (a ZeRO partition, an FSDP1 flat
    parameter's shard or one parameter's 1-D piece of it), stored as `tmap` says."""
    covered = tuple(sorted((p.offset, p.offset + p.numel) for p in pieces))
    return ParamLayout(*_stored(tmap, names, shapes), lambda t, key_of: tmap.piece_fragments(pieces, t.reshape(-1), key_of),
                       pad=lambda t: _zero_gaps(t.reshape(-1), covered),
                       partition=tuple((p.name, p.offset, p.numel, p.start) for p in pieces))


def plain_layout(name: str, param: torch.Tensor, tmap: TensorMap = IDENTITY) -> ParamLayout:
    """A parameter, whole or as a DTensor shard, stored as `tmap` says."""
    return ParamLayout(*_stored(tmap, [name], [param.shape]), lambda t, key_of: tmap.fragments(name, t, key_of))


def _param_shaped(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


class OptimizerHandler(Handler):
    """torch.optim state keyed by parameter name, never by the optimizer's integer ids.

    State of a parameter's shape goes through the parameter's layout (DTensor shards, flat
    parameters); other state (the step) is stored under every canonical name the parameter
    covers. Param-group hyperparameters are one object, matched to groups by parameter names.
    """

    def __init__(self, optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                 layouts: Dict[int, ParamLayout], groups: Optional[List[Tuple[dict, List[torch.Tensor]]]] = None,
                 layout_keys: Sequence[str] = ()):
        """`optimizer`: one, or several stepping disjoint parameters (Megatron's chained dense and
        expert optimizers) whose groups are then one list. `groups`: (param group, its parameters)
        when one optimizer's own `params` lists are not filled at checkpoint time (DeepSpeed ZeRO-3
        fills them only around its step). `layout_keys`: param-group keys that say how the
        framework runs a group's parameters (which optimizer or partition group steps an expert at
        this EP size), not how they are stepped: never saved (groups then equal are saved as one)
        and never overwritten by a load, so a checkpoint's groups fit any layout."""
        self.layout_keys = tuple(layout_keys)
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        self.groups = groups if groups is not None else [(g, list(g["params"])) for o in optimizers
                                                         for g in o.param_groups]
        self.layouts, self.states = {}, {}
        for o in optimizers:
            self.states.update((id(p), o.state) for g in o.param_groups for p in g["params"])
        for _, params in self.groups:
            for p in params:
                if id(p) not in layouts:
                    raise ValueError(f"optimizer parameter of shape {tuple(p.shape)} belongs to no module "
                                     "in the state: save the model in the same state dict")
                self.layouts[id(p)] = layouts[id(p)]
                self.states.setdefault(id(p), optimizers[0].state)

    def _params(self):
        """The parameters this rank holds part of. An FSDP1 original parameter outside the rank's
        shard is an empty tensor that torch gives no optimizer state (no gradient): a load creating
        some would leave a step count that never advances, and a save would store it."""
        return [p for _, params in self.groups for p in params if p.numel() or is_dtensor(p)]

    def save_items(self, prefix: str) -> SaveItems:
        items = SaveItems()
        for p in self._params():
            layout = self.layouts[id(p)]
            for sname, value in self.states[id(p)].get(p, {}).items():
                key_of = lambda n, s=sname: f"{prefix}/{n}/{s}"  # noqa: E731
                if _param_shaped(value, p):
                    items.fragments += layout.fragments(value, key_of)
                elif isinstance(value, torch.Tensor) and value.dim() and layout.partition is not None:
                    items.per_rank[key_of(layout.names[0])] = {"partition": _listed(layout.partition), "value": value}
                elif isinstance(value, torch.Tensor):
                    for name in layout.names:
                        items.fragments += tensor_fragments(key_of(name), value)
                else:
                    items.objects.update((key_of(name), value) for name in layout.names)
        items.objects[f"{prefix}/param_groups"] = saved_groups(
            [{**g, "params": [n for p in params for n in self.layouts[id(p)].names]} for g, params in self.groups],
            self.layout_keys)
        return items

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        """The stored state replaces the live one, as torch's `load_state_dict` does: a parameter
        gets exactly the state names the checkpoint holds for it (none: no state), in place where
        the live tensors fit. A checkpoint without this optimizer (no param groups) leaves it
        alone and reports what is missing. A parameter the checkpoint's optimizer never had (its
        param groups do not name it) is missing, not reset: its state names are reported (the
        others' names), and its live state kept."""
        items = LoadItems()
        groups_key = f"{prefix}/param_groups"
        items.objects[groups_key] = self._apply_groups
        saved_optimizer = groups_key in metadata.objects
        stored: Dict[str, Set[str]] = {}  # param name -> its stored state names
        unstated = []  # (names, param, state owner, live state) of parameters the checkpoint gives no state
        for key in list(metadata.tensors) + list(metadata.objects):
            if key.startswith(prefix + "/") and key != groups_key:
                pname, _, sname = key[len(prefix) + 1:].rpartition("/")
                if sname != MASTER:  # master weights are not this optimizer's state (see add_master_sources)
                    stored.setdefault(pname, set()).add(sname)
        group_of = {id(p): g for g, params in self.groups for p in params}
        partitioned = {k for k, objs in metadata.objects.items()
                       if k.startswith(prefix + "/") and any(o.rank is not None for o in objs)}
        for p in self._params():
            layout = self.layouts[id(p)]
            if partitioned and layout.partition is None:
                raise _partition_error(min(partitioned), "this job holds its parameters whole", metadata)
            owner = self.states[id(p)]
            live = owner[p] if p in owner else None  # a defaultdict's [] would add an entry
            snames = set().union(*(stored.get(n, set()) for n in layout.names))
            if not saved_optimizer:
                snames |= set(live or ())  # reported missing (strict) or kept
            elif live:
                stale = set(live) - snames
                if stale:  # dropped once the load has succeeded
                    items.finish.append(lambda s=live, names=stale: [s.pop(n) for n in names])
            if not snames:
                if saved_optimizer:
                    unstated.append((layout.names, p, owner, live))
                continue
            if live is None:
                live = owner[p] = {}
                items.undo.append(lambda p=p, owner=owner: owner.pop(p, None))
            self._load_param(p, group_of[id(p)], live, sorted(snames), prefix, metadata, items,  # same order on every rank
                             partitioned)
        if unstated:
            had = []  # of those, the ones the checkpoint's optimizer had without state: reset, as torch does

            def check(read) -> List[str]:
                named = {n for g in read(groups_key) for n in g["params"]}
                had[:] = [u for u in unstated if any(n in named for n in u[0])]
                snames = sorted(set().union(*stored.values())) or ["state"]
                return [f"{prefix}/{n}/{s}" for u in unstated if u not in had for n in u[0] for s in snames]
            items.checks.append(check)
            items.finish.append(lambda: [owner.pop(p, None) for _, p, owner, live in had if live is not None])
        return items

    def _load_param(self, p, group: dict, state: dict, snames: List[str], prefix: str, metadata: Metadata,
                    items: LoadItems, partitioned: Set[str]) -> None:
        """`partitioned`: the keys of state saved per rank with its partition."""
        layout = self.layouts[id(p)]
        for sname in snames:
            key_of = lambda n, s=sname: f"{prefix}/{n}/{s}"  # noqa: E731
            keys = [key_of(n) for n in layout.names]
            tensors = [k for k in keys if k in metadata.tensors]
            if any(k in partitioned for k in keys):
                _load_partition_state(layout, _local(p).device, state, sname, keys, metadata, items)
                continue
            shapes = {tuple(metadata.tensors[k].shape) for k in tensors} if layout.partition is not None else set()
            if shapes - {()} - set(layout.shapes):
                raise LoadMismatchError(
                    f"{tensors[0]} is optimizer state shaped neither like its parameter nor as a scalar (blockwise "
                    "state such as bitsandbytes' 8-bit absmax), stored as one value for every rank (by a job holding "
                    "its parameters whole, or by an earlier ckpt_plugins); this rank holds a partition of its "
                    "parameters, which it cannot be cut for: load without the optimizer's state")
            if not (tensors or (not any(k in metadata.objects for k in keys)
                                and isinstance(state.get(sname), torch.Tensor))):
                first = next((k for k in keys if k in metadata.objects), keys[0])
                items.objects[first] = lambda v, s=state, n=sname: s.__setitem__(n, v)
                items.accepted |= set(keys) - {first}  # one value serves the whole parameter
                continue
            if sname not in state:
                state[sname] = _allocate(p, layout, metadata.tensors[tensors[0]], sname, group)
                items.undo.append(lambda s=state, n=sname: s.pop(n, None))
                if not _param_shaped(state[sname], p):  # a step: the checkpoint's group flags decide, as in torch
                    items.finish.append(lambda s=state, n=sname: s.__setitem__(n, s[n].to(
                        *torch_placement(n, group, _local(p), s[n].dtype))))
            if _param_shaped(state[sname], p):
                frags = layout.fragments(state[sname], key_of)
            else:
                first = tensors[0] if tensors else keys[0]
                frags = tensor_fragments(first, state[sname])
                items.accepted |= set(keys) - {first}
            for frag in frags:  # converted to the live state's dtype, as load_state_dict does
                frag.cast = True
            items.fragments += frags

    def _apply_groups(self, saved_groups: List[dict]) -> None:
        by_param = {name: g for g in saved_groups for name in g["params"]}
        for group, params in self.groups:
            names = [n for p in params for n in self.layouts[id(p)].names]
            sources = {id(by_param[n]) for n in names if n in by_param}
            if len(sources) > 1:
                raise LoadMismatchError(f"a param group ({names[:3]}...) mixes parameters from saved groups "
                                        "with different hyperparameters; regroup to match the checkpoint")
            if sources:
                saved = by_param[next(n for n in names if n in by_param)]
                group.update({k: (tuple(v) if isinstance(group.get(k), tuple) else v)
                              for k, v in saved.items() if k != "params" and k not in self.layout_keys})


def _listed(partition) -> list:
    return [list(piece) for piece in partition]


def _load_partition_state(layout: ParamLayout, device: torch.device, state: dict, sname: str, keys: List[str],
                          metadata: Metadata, items: LoadItems) -> None:
    """State a rank saved for its partition alone (`ParamLayout.partition`), under the key of the
    partition's first parameter: back into the same partition only. Another partition (another
    world size or ZeRO stage) cannot take it, as the framework's own load could not."""
    key, loaded, created = keys[0], [], sname not in state
    saved = next(k for k in keys if k in metadata.objects)
    if key not in metadata.objects:
        raise _partition_error(saved, "this rank's partition starts at another parameter than any saved one", metadata)

    def put(value) -> None:
        if not (isinstance(value, dict) and isinstance(value.get("value"), torch.Tensor)):
            raise LoadMismatchError(f"{saved} holds {type(value).__name__}, not a partition's state "
                                    "({'partition': ..., 'value': tensor})")
        if value.get("partition") != _listed(layout.partition):
            raise _partition_error(saved, "this rank's partition is not the one saved", metadata)
        state[sname] = value["value"].to(device)
        loaded.append(True)

    def check() -> None:
        if not loaded:
            raise _partition_error(saved, "no rank of this rank's number saved it", metadata)
    items.per_rank[key] = put
    items.accepted |= set(keys[1:])
    items.undo.append(lambda: state.pop(sname, None) if created and loaded else None)
    items.finish.append(check)


def _partition_error(key: str, why: str, metadata: Metadata) -> LoadMismatchError:
    return LoadMismatchError(
        f"{key} is optimizer state of one rank's partition of its parameters (blockwise state such as bitsandbytes' "
        f"8-bit absmax), which loads only into the same partition: {why}; resume with the layout the checkpoint "
        f"was saved with ({metadata.world_size} ranks), or load without the optimizer's state")


def saved_groups(groups: List[dict], layout_keys: Sequence[str]) -> List[dict]:
    """Param groups (their `params` by name) as a checkpoint stores them: without the layout keys
    (see OptimizerHandler), groups then equal merged."""
    merged: Dict[str, dict] = {}
    for g in groups:
        rest = {k: v for k, v in g.items() if k != "params" and k not in layout_keys}
        merged.setdefault(repr(sorted(rest.items())), {**rest, "params": []})["params"] += g["params"]
    return list(merged.values())


def torch_placement(sname: str, group: dict, param: torch.Tensor, stored: torch.dtype) -> Tuple[torch.device, torch.dtype]:
    """The device and dtype torch's `Optimizer.load_state_dict` gives a parameter's state `sname`
    stored as `stored`: a "step" stays on the CPU as stored unless its group is capturable or fused
    (on a GPU, a step there would cost a device sync per parameter and step); the rest goes to the
    parameter's device, floating state in a floating parameter's dtype (torch's Adam steps bf16
    parameters only with bf16 moments). Integer state keeps its dtype, as bitsandbytes' 8-bit
    optimizers keep theirs (torch would cast it too)."""
    if sname == "step":
        if group.get("capturable") or group.get("fused"):
            return param.device, torch.float32
        return torch.device("cpu"), stored
    return param.device, (param.dtype if param.is_floating_point() and stored.is_floating_point else stored)


def _allocate(param: torch.Tensor, layout: ParamLayout, meta, sname: str, group: dict) -> torch.Tensor:
    """Optimizer state `sname` for `param` in `group`, shaped as the checkpoint stores it: like
    the parameter when stored with a canonical parameter's shape, else as stored (a scalar step).
    Left unfilled: the load plan has checked that the checkpoint covers all of it, and a failed
    load removes it."""
    from .format import dtype_from_name
    local = _local(param)
    device, dtype = torch_placement(sname, group, local, dtype_from_name(meta.dtype))
    if tuple(meta.shape) in layout.shapes and param.dim() > 0:
        out = fresh_empty(local.shape, dtype, device)
        if layout.pad is not None:
            layout.pad(out)
        if is_dtensor(param):
            from torch.distributed.tensor import DTensor
            out = DTensor.from_local(out, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                     stride=param.stride())
        return out
    return torch.empty(meta.shape, dtype=dtype, device=device)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if is_dtensor(param) else param


def _zero_gaps(flat: torch.Tensor, covers: Tuple[Tuple[int, int], ...]) -> None:
    """Zero the elements of `flat` outside the ranges `covers`: a partition's padding, which the
    framework keeps at zero."""
    at = 0
    for start, end in covers + ((flat.numel(), flat.numel()),):
        if start > at:
            flat[at:start].zero_()
        at = max(at, end)


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

    def __init__(self, mapping: dict, layouts: Optional[Dict[int, ParamLayout]] = None):
        self.mapping = mapping
        self.layouts = layouts or {}

    def _children(self, prefix: str):
        for k, v in self.mapping.items():
            yield k, f"{prefix}/{k}" if prefix else str(k), v

    def save_items(self, prefix: str) -> SaveItems:
        items = SaveItems()
        for _, key, value in self._children(prefix):
            handler = handler_for(value, self.layouts)
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
            handler = handler_for(value, self.layouts)
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


# Handlers that framework extensions register for their own values (checked first, newest first).
_REGISTERED: List[Tuple[Callable[[Any], bool], Callable[[Any], Handler]]] = []


def register_handler(matches: Callable[[Any], bool], factory: Callable[[Any], Handler]) -> None:
    """Make `factory(value)` the handler of every state value for which `matches(value)` is true.

    This is how an extension plugs in a framework's values (a model with FSDP1 units, say)
    without the core knowing them. Both calls should be cheap: they run at every save and load."""
    _REGISTERED.insert(0, (matches, factory))


def handler_for(value: Any, layouts: Dict[int, ParamLayout]) -> Optional[Handler]:
    if isinstance(value, Handler):
        return value
    for matches, factory in _REGISTERED:
        if matches(value):
            return factory(value)
    if isinstance(value, nn.Module):
        return ModuleHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return OptimizerHandler(value, layouts)
    if isinstance(value, dict):
        return DictHandler(value, layouts)
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict") and not isinstance(value, torch.Tensor):
        return StatefulHandler(value)
    return None


def root_handler(state: dict) -> DictHandler:
    """The handler for a whole `state` dict; optimizers find their parameters' layouts in the
    handlers of its modules."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of modules, optimizers and objects, got {type(state).__name__}")
    layouts: Dict[int, ParamLayout] = {}
    for value in state.values():
        handler = handler_for(value, {}) if isinstance(value, (nn.Module, Handler)) else None
        for pid, layout in (handler.param_layouts() if hasattr(handler, "param_layouts") else {}).items():
            layouts.setdefault(pid, layout)
    return DictHandler(state, layouts)
