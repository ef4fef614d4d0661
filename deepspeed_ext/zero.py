"""DeepSpeed engine state as fragments: ZeRO stages 0-3, fp32 or bf16 with fp32 masters.

Each rank describes what it holds, straight from DeepSpeed's own bookkeeping, under the model's
canonical (HF) parameter names (fused MoE experts per expert, through the model's `TensorMap`);
nothing is gathered:
- weights (`model/<name>`) in the training dtype: whole on every rank for stages 0-2 (written once
  by the save plan), the rank's flat partition `param.ds_tensor` for stage 3;
- fp32 masters (`optim/<name>/master`, only when training in bf16/fp16) and optimizer state
  (`optim/<name>/exp_avg`, ...): the rank's flat fp32 partition, which DeepSpeed's base optimizer
  steps, cut at arbitrary element positions: `param._hp_mapping` (stages 1-2 and the bf16
  optimizer) or `grad_position` (stage 3) says which elements of which parameter each piece holds.
The base optimizer's state and param groups go through the core's OptimizerHandler with a layout
per flat partition, so they are stored per canonical parameter like every other framework's.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ckpt_plugins.ext import (MASTER, MODEL, FlatPiece, Fragment, Handler, Ignore, LoadItems, Metadata,
                              OptimizerHandler, ParamLayout, SaveItems, TensorMap, add_master_sources, canonical_name,
                              flat_layout, frozen_keys, model_mapping, plain_layout, tensor_map)

from .autoep import autoep_segments, placements


def model_map(module, modules) -> TensorMap:
    """How the engine's model is stored: AutoEP's grouped experts and router under the family's
    per-expert names, else as the model's own map says (`modules`: its `named_modules()`)."""
    found, own = placements(modules), tensor_map(module)
    if not found:
        return own
    return TensorMap(functools.partial(autoep_segments, getattr(module.config, "model_type", None), found,
                                       own.segments))


def _stage3_range(param) -> Tuple[int, int]:
    """(first element, numel) of `param` in this rank's stage-3 partition, padding excluded."""
    per_rank = param.ds_tensor.ds_numel
    start = dist.get_rank(group=param.ds_process_group) * per_rank
    return start, max(0, min(per_rank, param.ds_numel - start))


class ZeroState:
    """What one engine holds, by canonical name. Built per save/load (DeepSpeed relinks its views)."""

    def __init__(self, engine):
        self.engine = engine
        self.stage = engine.zero_optimization_stage()
        module = engine.module
        modules = list(module.named_modules())  # one walk for the experts' placements and the buffers
        self.map = model_map(module, modules)
        self.names: Dict[int, str] = {}  # each parameter's first name, the one named_parameters() gives
        self.params: List[Tuple[str, torch.nn.Parameter]] = []  # in named_parameters() order
        self.aliases: Dict[str, str] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            name = canonical_name(n)
            if id(p) not in self.names:
                self.names[id(p)] = name
                self.params.append((name, p))
            elif self.map.renamed(name) != self.map.renamed(self.names[id(p)]):  # not AutoEP's gate.gate
                self.aliases[self.map.renamed(name)] = self.map.renamed(self.names[id(p)])
        self.buffers = {canonical_name(f"{mn}.{bn}" if mn else bn): b for mn, m in modules
                        for bn, b in m.named_buffers(recurse=False)
                        if b is not None and bn not in m._non_persistent_buffers_set}
        wrapper = engine.optimizer
        self.base = getattr(wrapper, "optimizer", None) if wrapper is not None else None
        self.low_precision = engine.bfloat16_enabled() or engine.fp16_enabled()
        self.layouts: Dict[int, ParamLayout] = {}
        self.masters: List[torch.Tensor] = []  # what the base optimizer steps: fp32 (flat) partitions
        self.groups = None  # (param group, flat partitions) where the base optimizer's lists are empty
        if wrapper is None:
            return
        if self.stage == 3:
            self._stage3(wrapper)
        elif hasattr(wrapper, "single_partition_of_fp32_groups"):  # stages 1-2
            self._hp_mapped(wrapper.bit16_groups, wrapper.single_partition_of_fp32_groups)
        elif hasattr(wrapper, "fp32_groups_flat_partition"):  # BF16_Optimizer (bf16 + fp32 accumulation)
            self._hp_mapped(wrapper.bf16_groups, wrapper.fp32_groups_flat_partition)
        elif isinstance(getattr(wrapper, "fp32_groups", None), list) and hasattr(wrapper, "fp16_groups") \
                and not hasattr(wrapper, "fp32_groups_flat"):  # FP16_UnfusedOptimizer: stage 0, bf16/fp16
            for lp_group, hp_group in zip(wrapper.fp16_groups, wrapper.fp32_groups):
                for lp, hp in zip(lp_group, hp_group):  # one whole fp32 copy per parameter
                    self.layouts[id(hp)] = plain_layout(self.names[id(lp)], hp, self.map)
                    self.masters.append(hp)
        elif hasattr(wrapper, "fp32_groups_flat") and hasattr(wrapper, "fp16_groups"):
            # FP16_Optimizer (stage 0, bf16/fp16, a fused Adam): one flat fp32 copy per group, its
            # parameters one after the other
            for params, flat in zip(wrapper.fp16_groups, wrapper.fp32_groups_flat):
                starts = [0]
                for p in params:
                    starts.append(starts[-1] + p.numel())
                pieces = [FlatPiece(self.names[id(p)], tuple(p.shape), at, p.numel(), 0) for p, at in zip(params, starts)]
                self.layouts[id(flat)] = self._group_layout(params, pieces)
                self.masters.append(flat)
        elif isinstance(wrapper, torch.optim.Optimizer) and self.base is None:
            # stage 0, fp32: DeepSpeed steps the client optimizer on the parameters themselves
            self.base = wrapper
            self.layouts = {id(p): plain_layout(name, p, self.map) for name, p in self.params}
        else:
            raise NotImplementedError(f"deepspeed_ext cannot map DeepSpeed's {type(wrapper).__name__}: it knows "
                                      "ZeRO stages 1-3, BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer and a "
                                      "torch optimizer at stage 0")

    def optimizer_handler(self) -> OptimizerHandler:
        # MoE groups (AutoEP's experts) carry the expert-data-parallel group's name: EP-size layout
        moe = any(g.get("moe") for g in self.base.param_groups)
        return OptimizerHandler(self.base, self.layouts, self.groups, layout_keys=("moe", "name") if moe else ())

    def _group_layout(self, params, pieces: List[FlatPiece]) -> ParamLayout:
        names = tuple(self.names[id(p)] for p in params)
        shapes = tuple(tuple(getattr(p, "ds_shape", p.shape)) for p in params)
        return flat_layout(names, shapes, pieces, self.map)

    def _hp_mapped(self, lp_groups, flat_partitions) -> None:
        for params, flat in zip(lp_groups, flat_partitions):
            pieces = [FlatPiece(self.names[id(p)], tuple(p.shape), p._hp_mapping.hp_fragment_address.start,
                            p._hp_mapping.hp_fragment_address.numel, p._hp_mapping.lp_fragment_address.start)
                      for p in params if getattr(p, "_hp_mapping", None) is not None]
            self.layouts[id(flat)] = self._group_layout(params, pieces)
            self.masters.append(flat)

    def _stage3(self, wrapper) -> None:
        # ZeRO-3 puts the flat partitions into the base optimizer's param groups only around a step
        self.groups = [(g, []) for g in self.base.param_groups]
        for group, params in enumerate(wrapper.fp16_groups):
            flat = wrapper.fp32_partitioned_groups_flat[group]
            self.groups[wrapper.sub_group_to_group_id[group]][1].append(flat)
            pieces = []
            for p in params:
                _, offset, _ = wrapper.grad_position[wrapper.get_param_id(p)]
                start, numel = _stage3_range(p)
                pieces.append(FlatPiece(self.names[id(p)], tuple(p.ds_shape), offset, numel, start))
            self.layouts[id(flat)] = self._group_layout(params, pieces)
            self.masters.append(flat)

    # ---------------------------------------------------------------- fragments

    def weight_fragments(self, prefix: str, gathered: bool = False) -> List[Fragment]:
        """`gathered`: stage 3's persistent parameters whole as well, gathered as they are (a load
        fills them beside their partitions, instead of gathering them again afterwards)."""
        key_of = lambda n: f"{prefix}/{n}"  # noqa: E731
        frags: List[Fragment] = []
        persistent = {id(p) for p in getattr(self.engine.optimizer, "persistent_parameters", ())} if gathered else ()
        for name, p in self.params:
            if self.stage == 3:
                start, numel = _stage3_range(p)
                frags += self.map.piece_fragments([FlatPiece(name, tuple(p.ds_shape), 0, numel, start)],
                                                  p.ds_tensor.detach(), key_of)
            if self.stage != 3 or id(p) in persistent:
                frags += self.map.fragments(name, p, key_of)
        for name, b in self.buffers.items():
            frags += self.map.fragments(name, b, key_of)
        return frags

    def master_fragments(self, prefix: str) -> List[Fragment]:
        frags: List[Fragment] = []
        for master in self.masters:
            frags += self.layouts[id(master)].fragments(master.detach(), lambda n: f"{prefix}/{n}/{MASTER}")
        return frags


class SharedZero:
    """One `ZeroState` for the handlers of one state dict, built once per save or load: each
    handler takes it once, and one taking it again (the next operation on a reused state dict)
    gets a new one, as DeepSpeed may have relinked its views in between."""

    def __init__(self, engine):
        self.engine = engine
        self.zero = None
        self.takers: set = set()

    def take(self, taker) -> ZeroState:
        if self.zero is None or taker in self.takers:
            self.zero, self.takers = ZeroState(self.engine), set()
        self.takers.add(taker)
        return self.zero


class DeepSpeedModel(Handler):
    """The engine's weights, in the training dtype, by canonical name (frozen parameters included).
    `gathered`: ZeRO-3's persistent parameters are gathered and the others released (`settled`),
    and stay so: a load fills the persistent ones whole too, and gathers nothing afterwards."""

    def __init__(self, engine, gathered: bool = False, shared: Optional[SharedZero] = None):
        self.engine = engine
        self.gathered = gathered
        self.shared = shared or SharedZero(engine)

    def save_items(self, prefix: str) -> SaveItems:
        zero = self.shared.take(self)
        return SaveItems(fragments=zero.weight_fragments(prefix),
                         aliases={f"{prefix}/{a}": f"{prefix}/{t}" for a, t in zero.aliases.items()},
                         objects=model_mapping(self.engine.module).objects(prefix),
                         frozen=frozen_keys(self.engine.module, zero.map, prefix, lambda p: getattr(p, "ds_shape", p.shape)))

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        zero = self.shared.take(self)
        frags = add_master_sources(prefix, zero.weight_fragments(prefix, self.gathered))
        for frag in frags:  # low-precision weights are a rounding of the masters: any stored copy will do
            frag.cast = zero.low_precision
        return LoadItems(fragments=frags, accepted={f"{prefix}/{a}" for a in zero.aliases} |
                         set(model_mapping(self.engine.module).objects(prefix)),
                         finish=[lambda: _after_load(self.engine, self.gathered)])


class DeepSpeedOptimizer(Handler):
    """The fp32 master partitions and the base optimizer's state, by canonical name.

    Masters are stored only in bf16/fp16 training (in fp32 they are the weights); on load they are
    filled from the masters when the checkpoint has them, else from the weights (fp32 weights
    exactly; low-precision ones, e.g. an HF bf16 import, widened). With `optimizer_state=False` a
    load fills the masters only (DeepSpeed's load_module_only / load_optimizer_states=False: the
    masters must follow the weights) and accepts the rest of the checkpoint's optimizer entries."""

    def __init__(self, engine, optimizer_state: bool = True, shared: Optional[SharedZero] = None):
        self.engine = engine
        self.optimizer_state = optimizer_state
        self.shared = shared or SharedZero(engine)

    def save_items(self, prefix: str) -> SaveItems:
        zero = self.shared.take(self)
        items = zero.optimizer_handler().save_items(prefix)
        if zero.low_precision:
            items.fragments += zero.master_fragments(prefix)
        return items

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        zero = self.shared.take(self)
        if self.optimizer_state:
            items = zero.optimizer_handler().load_items(prefix, metadata)
        else:
            items = Ignore().load_items(prefix, metadata)
        for frag in zero.master_fragments(prefix):
            name = frag.key[len(prefix) + 1:-len(MASTER) - 1]
            frag.sources, frag.cast = (f"{MODEL}/{name}",), True
            items.fragments.append(frag)
        return items


def _after_load(engine, gathered: bool) -> None:
    """Let DeepSpeed pick up what was written into its buffers (`gathered`: ZeRO-3's persistent
    parameters were filled whole as well)."""
    optimizer = engine.optimizer
    base = getattr(optimizer, "optimizer", None)
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state") and base is not None and base.state:
        # stages 1-2 and the bf16 optimizer link each parameter to its slice of the optimizer state
        # at their first step; state created by the load gets linked now
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    if engine.zero_optimization_stage() == 3 and not gathered:
        # persistent parameters also live gathered: drop those copies; then as DeepSpeed's own load
        # ends, drop ZeRO++'s secondary partitions (copies of the old ones) and gather the
        # persistent parameters again from the loaded partitions
        if getattr(optimizer, "persistent_parameters", None):
            optimizer.persistent_parameters[0].partition(optimizer.persistent_parameters)
        optimizer.checkpoint_event_epilogue()
