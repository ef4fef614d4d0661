"""`bcp import-deepspeed DIR PATH`: a native DeepSpeed ZeRO checkpoint (stages 1-3) becomes a
ckpt_plugins checkpoint, in one process, without a GPU, a process group or DeepSpeed itself.

DeepSpeed's files are pickles. They are read with `torch.load(weights_only=True)`, which only
rebuilds tensors and plain containers, with inert stand-ins for the DeepSpeed classes its files
name (a fragment address, the ZeRO stage enum, the loss scaler; `ckpt_plugins.ext.StandIn`): nothing
from the files is executed. What comes out is what deepspeed_ext would have saved from the same engine: weights by
canonical name (frozen ones included), fp32 masters for bf16/fp16 runs, Adam moments and step per
parameter, param groups, LR scheduler, step counters and client state.
"""
from __future__ import annotations

import glob
import math
import os
import re
from typing import Any, Dict, List, Tuple

import torch

from ckpt_plugins import CorruptCheckpointError, NotACheckpointError
from ckpt_plugins.ext import (MASTER, MODEL, OPTIM, DictHandler, LazyFragment, StandIn, canonical_name, flat_views,
                              load_torch_inert, write_checkpoint)

# Top-level entries of DeepSpeed's model-states file; anything else is the user's client_state.
DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
           "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
           "ds_version", "checkpoint_parallel_dimensions", "iteration", "ds_zero_partition_groups"}


def safe_load(path: str) -> Any:
    return load_torch_inert(path, f"{path} (a DeepSpeed checkpoint file)")


def _enum_value(value) -> int:
    """An enum member pickled by DeepSpeed (ZeroStageEnum) comes back as a stand-in holding its value."""
    return int(value.args[0]) if isinstance(value, StandIn) else int(value)


def _rank_files(ckpt_dir: str, pattern: str) -> List[str]:
    files = glob.glob(os.path.join(ckpt_dir, pattern))
    ranked = sorted((int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f)).group(1)), f) for f in files)
    if [r for r, _ in ranked] != list(range(len(ranked))):
        raise CorruptCheckpointError(f"{ckpt_dir}: the per-rank files {pattern} are not ranks 0..N-1: "
                                     f"{[os.path.basename(f) for _, f in ranked]}")
    return [f for _, f in ranked]


def _flat_pieces(key: str, shape, dtype, flat_of, offset: int, numel: int, start: int) -> List[LazyFragment]:
    """LazyFragments for elements [start, start + numel) of `key`, held from `offset` on in flat_of()."""
    return [LazyFragment(key, tuple(shape), dtype, offs, lens,
                         lambda b=begin, n=math.prod(lens), l=lens: flat_of().narrow(0, b, n).view(l))
            for (offs, lens), begin in flat_views(shape, start, numel, offset)]


class NativeCheckpoint:
    """One DeepSpeed checkpoint tag directory. Rank files are read once each, when first needed."""

    def __init__(self, ckpt_dir: str):
        self.dir = ckpt_dir
        self.model_files = _rank_files(ckpt_dir, "zero_pp_rank_*_mp_rank_00_model_states.pt")
        self.stage3 = bool(self.model_files)
        if not self.stage3:
            single = os.path.join(ckpt_dir, "mp_rank_00_model_states.pt")
            if not os.path.isfile(single):
                raise NotACheckpointError(f"{ckpt_dir} holds no DeepSpeed model states (mp_rank_00_model_states.pt "
                                          "or zero_pp_rank_*_mp_rank_00_model_states.pt)")
            self.model_files = [single]
        self.optim_files = _rank_files(ckpt_dir, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")
        if not self.optim_files:
            raise NotACheckpointError(f"{ckpt_dir} has no ZeRO optimizer files: only ZeRO stages 1-3 are imported")
        self.world = len(self.optim_files)
        self._files: Dict[str, Any] = {}
        self._flats: Dict[Tuple[int, str], torch.Tensor] = {}
        self.model = self.load(self.model_files[0])

    def load(self, path: str) -> Any:
        if path not in self._files:
            self._files[path] = safe_load(path)
        return self._files[path]

    def optim(self, rank: int) -> dict:
        return self.load(self.optim_files[rank])["optimizer_state_dict"]

    def base(self, rank: int) -> dict:
        """The base (torch) optimizer's state dict: stages 1-2 and 3 file it under different names."""
        opt = self.optim(rank)
        return opt["base_optimizer_state"] if "base_optimizer_state" in opt else opt["optimizer_state_dict"]

    def flat(self, rank: int, group: int, what: str) -> torch.Tensor:
        """Rank `rank`'s flat fp32 partition (`what` = MASTER) or optimizer state of group `group`;
        for stage 3 (group None) every sub-group's, concatenated."""
        if (rank, group, what) not in self._flats:
            opt, states = self.optim(rank), self.base(rank)["state"]
            if group is None:
                parts = opt["fp32_flat_groups"] if what == MASTER else [states[g][what] for g in sorted(states)]
                self._flats[(rank, group, what)] = torch.cat([t.reshape(-1) for t in parts])
            else:
                self._flats[(rank, group, what)] = (opt["single_partition_of_fp32_groups"][group] if what == MASTER
                                                    else states[group][what])
        return self._flats[(rank, group, what)]

    def module_tensor(self, name: str) -> torch.Tensor:
        return self.model["module"][name]

    def frozen_piece(self, rank: int, name: str) -> torch.Tensor:
        return self.load(self.model_files[rank])["frozen_param_fragments"][name].reshape(-1)


def convert(ckpt_dir: str) -> Tuple[List[LazyFragment], Dict[str, Any], Dict[str, str], Dict[str, Any]]:
    """(fragments, objects, aliases, layout) of a native checkpoint."""
    ck = NativeCheckpoint(ckpt_dir)
    model, world = ck.model, ck.world
    lp_dtype = next((t.dtype for t in model["module"].values() if isinstance(t, torch.Tensor)), torch.float32)
    low_precision = lp_dtype != torch.float32
    aliases = {f"{MODEL}/{canonical_name(a)}": f"{MODEL}/{canonical_name(t)}"
               for a, t in (model.get("shared_params") or {}).items()}
    base = ck.base(0)
    first = base["state"][next(iter(base["state"]))]
    moments = sorted(k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim())
    flats = ([MASTER] if low_precision else []) + moments  # what the fp32 partitions hold
    fragments: List[LazyFragment] = []
    group_of: Dict[str, int] = {}  # trainable parameter (DeepSpeed name) -> its flat group
    if ck.stage3:
        # rank r holds partition r (ceil(numel / world) elements, the last padded) of every
        # trainable parameter, concatenated in param_shapes order over its sub-groups
        offset = 0
        for g, group in enumerate(model["param_shapes"]):
            for name, shape in group.items():
                group_of[name], shape = g, tuple(shape)
                per_rank = math.ceil(math.prod(shape) / world)
                for rank in range(world):
                    start = rank * per_rank
                    numel = max(0, min(per_rank, math.prod(shape) - start))
                    for what in flats:
                        fragments += _flat_pieces(f"{OPTIM}/{canonical_name(name)}/{what}", shape, torch.float32,
                                                  lambda r=rank, w=what: ck.flat(r, None, w), offset, numel, start)
                    # DeepSpeed's stage-3 files keep no low-precision weights: they are the rounded masters
                    weights = _flat_pieces(f"{MODEL}/{canonical_name(name)}", shape, lp_dtype,
                                           lambda r=rank: ck.flat(r, None, MASTER), offset, numel, start)
                    for frag in weights:
                        frag.load = lambda load=frag.load: load().to(lp_dtype)
                    fragments += weights
                offset += per_rank
        for name, shape in (model.get("frozen_param_shapes") or {}).items():
            shape = tuple(shape)
            per_rank = math.ceil(math.prod(shape) / world)
            for rank in range(world):
                start = rank * per_rank
                numel = max(0, min(per_rank, math.prod(shape) - start))
                fragments += _flat_pieces(f"{MODEL}/{canonical_name(name)}", shape, lp_dtype,
                                          lambda r=rank, n=name: ck.frozen_piece(r, n), 0, numel, start)
    else:
        # stages 1-2: whole low-precision weights (frozen ones too) in the model file; rank r's fp32
        # partition of group g holds the pieces its param_slice_mappings lists, parameter after
        # parameter and rank after rank
        for name, tensor in model["module"].items():
            key = f"{MODEL}/{canonical_name(name)}"
            if key not in aliases:
                fragments.append(LazyFragment(key, tuple(tensor.shape), tensor.dtype, (0,) * tensor.dim(),
                                              tuple(tensor.shape), lambda n=name: ck.module_tensor(n)))
        done: Dict[str, int] = {}
        for rank in range(world):
            for g, mapping in enumerate(ck.optim(rank)["param_slice_mappings"]):
                for name, address in mapping.items():
                    shape = tuple(model["param_shapes"][g][name])
                    group_of[name] = g
                    start = done.get(name, 0)
                    for what in flats:
                        fragments += _flat_pieces(f"{OPTIM}/{canonical_name(name)}/{what}", shape, torch.float32,
                                                  lambda r=rank, g=g, w=what: ck.flat(r, g, w), address.start,
                                                  address.numel, start)
                    done[name] = start + address.numel
    for name, g in group_of.items():
        step = base["state"][g]["step"]
        fragments.append(LazyFragment(f"{OPTIM}/{canonical_name(name)}/step", (), step.dtype, (), (),
                                      lambda s=step: s.reshape(())))
    objects: Dict[str, Any] = {f"{OPTIM}/param_groups": [
        {**{k: v for k, v in group.items() if k != "params"},
         "params": [canonical_name(n) for n, g in group_of.items() if g in set(group["params"])]}
        for group in base["param_groups"]]}
    if model.get("lr_scheduler"):
        sched = DictHandler(dict(model["lr_scheduler"])).save_items("sched")
        objects.update(sched.objects)
        fragments += [LazyFragment(f.key, f.global_shape, f.dtype, f.offsets, f.lengths, lambda f=f: f.local)
                      for f in sched.fragments]
    objects.update({f"engine/{k}": int(model[k]) for k in ("global_steps", "global_samples", "skipped_steps")
                    if k in model})
    objects["client_state"] = {k: v for k, v in model.items() if k not in DS_KEYS}
    layout = {"zero_stage": 3 if ck.stage3 else _enum_value(ck.optim(0).get("zero_stage", 1)), "dp_world_size": world,
              "dtype": {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(lp_dtype, "fp32"),
              "imported_from": "deepspeed"}
    return fragments, objects, aliases, layout


def import_deepspeed(ckpt_dir: str, path, *, overwrite: bool = False, progress=None):
    """Convert a native DeepSpeed checkpoint (a tag directory, or a save dir with a `latest` file)."""
    latest = os.path.join(ckpt_dir, "latest")
    if os.path.isfile(latest) and not glob.glob(os.path.join(ckpt_dir, "*model_states.pt")):
        with open(latest) as f:
            ckpt_dir = os.path.join(ckpt_dir, f.read().strip())
    fragments, objects, aliases, layout = convert(ckpt_dir)
    step = objects.get("engine/global_steps")
    return write_checkpoint(path, fragments, objects, aliases=aliases, framework="deepspeed", layout=layout,
                            step=step, overwrite=overwrite, progress=progress)
