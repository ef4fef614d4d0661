"""FSDP1 (`FullyShardedDataParallel`) through the core, straight from each rank's flat shards.

Each wrapped unit concatenates its parameters into one flat parameter and gives every rank an
equal contiguous piece of it, cutting parameters anywhere. A rank's piece is described with the
core's flat-range decomposition, from FSDP's own shard metadata (`_shard_param_infos`), as views
of the local shard: no all-gather, no state_dict hooks, no device synchronisation. Optimizer state
follows the same layout: flat (use_orig_params=False) or per original parameter's 1-D piece
(use_orig_params=True).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from ckpt_plugins.ext import (FlatPiece, Fragment, Handler, LoadItems, Metadata, ParamLayout, SaveItems, TensorMap,
                              add_master_sources, canonical_name, flat_layout, frozen_keys, model_mapping,
                              plain_layout, tensor_map)


def _join(*parts: str) -> str:
    return canonical_name(".".join(p for p in parts if p))


def _pieces(flat_param, prefix: str) -> List[FlatPiece]:
    """The pieces of every original parameter this rank's shard holds part of."""
    return [FlatPiece(_join(prefix, fqn), tuple(shape), info.offset_in_shard, info.numel_in_shard,
                      info.intra_param_start_idx)
            for fqn, shape, info in zip(flat_param._fqns, flat_param._shapes, flat_param._shard_param_infos)
            if info.in_shard]


def _flat_layout(flat_param, prefix: str, tmap: TensorMap) -> ParamLayout:
    """A flat parameter (use_orig_params=False): a tensor shaped like its local shard."""
    return flat_layout([_join(prefix, f) for f in flat_param._fqns], flat_param._shapes, _pieces(flat_param, prefix),
                       tmap)


def _orig_layout(name: str, shape: Tuple[int, ...], info, tmap: TensorMap) -> ParamLayout:
    """An original parameter under use_orig_params=True: a 1-D view of its piece of the shard."""
    start, numel = (info.intra_param_start_idx, info.numel_in_shard) if info.in_shard else (0, 0)
    return flat_layout([name], [shape], [FlatPiece(name, shape, 0, numel, start)], tmap)


def _local_shard(flat_param) -> torch.Tensor:
    """The full-precision local shard, whatever the unit's state: the root stays unsharded after a
    forward without backward, and mixed precision computes from a low-precision copy. Before the
    first forward (FSDP's lazy init) the flat parameter itself is that shard."""
    return getattr(flat_param, "_local_shard", flat_param).detach()


class FSDP1ModuleHandler(Handler):
    """An FSDP1-wrapped model: sharded parameters from the flat shards, buffers and unmanaged
    parameters whole (replicated), tied parameters stored once."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.map = tensor_map(module)
        self.units = []  # (canonical prefix of the wrapped module, flat parameter)
        self.handles = []
        for name, sub in module.named_modules():
            if isinstance(sub, FSDP) and sub._handle is not None:
                self.units.append((canonical_name(name), sub._handle.flat_param))
                self.handles.append(sub._handle)
        self.aliases: Dict[str, str] = {}
        self.covered = set()
        for prefix, flat in self.units:
            self.covered.update(_join(prefix, f) for f in flat._fqns)
            for info in flat._shared_param_infos:
                self.aliases[_join(prefix, info.module_name, info.param_name)] = \
                    _join(prefix, info.prim_module_name, info.prim_param_name)

    def _plain(self) -> Dict[str, torch.Tensor]:
        """Buffers and parameters FSDP does not manage (ignored modules): whole on every rank."""
        out = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            name = canonical_name(name)
            if not hasattr(p, "_fqns") and name not in self.covered and name not in self.aliases:
                out[name] = p
        for mod_name, mod in self.module.named_modules():
            for buf_name, buf in mod.named_buffers(recurse=False):
                if buf is not None and buf_name not in mod._non_persistent_buffers_set:
                    out[_join(mod_name, buf_name)] = buf
        return out

    def param_layouts(self) -> Dict[int, ParamLayout]:
        plain = self._plain()
        layouts = {id(p): plain_layout(canonical_name(n), p, self.map) for n, p in self.module.named_parameters()
                   if canonical_name(n) in plain}
        for prefix, flat in self.units:
            if flat._params is None:  # use_orig_params=False: the optimizer holds the flat parameter
                layouts[id(flat)] = _flat_layout(flat, prefix, self.map)
                continue
            for param, fqn, shape, info in zip(flat._params, flat._fqns, flat._shapes, flat._shard_param_infos):
                layouts[id(param)] = _orig_layout(_join(prefix, fqn), tuple(shape), info, self.map)
        return layouts

    def _fragments(self, prefix: str) -> List[Fragment]:
        key_of = lambda n: f"{prefix}/{n}"  # noqa: E731
        frags: List[Fragment] = []
        for unit_prefix, flat in self.units:
            frags += _flat_layout(flat, unit_prefix, self.map).fragments(_local_shard(flat), key_of)
        for name, tensor in self._plain().items():
            frags += self.map.fragments(name, tensor, key_of)
        return frags

    def save_items(self, prefix: str) -> SaveItems:
        return SaveItems(fragments=self._fragments(prefix),
                         aliases={f"{prefix}/{self.map.renamed(a)}": f"{prefix}/{self.map.renamed(t)}"
                                  for a, t in self.aliases.items()},
                         objects=model_mapping(self.module).objects(prefix), frozen=frozen_keys(self.module, self.map, prefix))

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        for handle in self.handles:  # an unsharded copy would hide the loaded shard until the next reshard
            if hasattr(handle.flat_param, "_local_shard") and handle.uses_sharded_strategy \
                    and not handle.is_sharded(handle.flat_param):
                handle.reshard(free_unsharded_flat_param=True)
                handle.post_reshard()
        return LoadItems(fragments=add_master_sources(prefix, self._fragments(prefix)),
                         accepted={f"{prefix}/{self.map.renamed(a)}" for a in self.aliases} |
                         set(model_mapping(self.module).objects(prefix)))


def has_fsdp1_units(value) -> bool:
    """A model with FSDP1 units anywhere (the root need not be wrapped)."""
    return isinstance(value, nn.Module) and any(isinstance(m, FSDP) for m in value.modules())
