"""Native DeepSpeed ZeRO checkpoints (stages 1-3), read in place (`cp.load` of a tag directory, or
of a save directory with its `latest` file: the reader the `ckpt_plugins.readers` entry point
registers) and by `bcp import-deepspeed DIR PATH`, which writes the same view as a ckpt_plugins
checkpoint; without a GPU, a process group or DeepSpeed itself.

DeepSpeed's files are `torch.save` archives. They are read with the core's archive reader: the
pickled structure with every tensor a location in the file (read later, once, by the load plan)
and an inert stand-in for every DeepSpeed class the files name (a fragment address, the ZeRO stage
enum, the loss scaler; `ckpt_plugins.ext.StandIn`): nothing from the files is executed. What comes
out is what deepspeed_ext saves from the same engine: weights by canonical name (frozen ones
included), fp32 masters for bf16/fp16 runs, Adam moments and step per parameter, param groups, LR
scheduler, step counters and client state.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ckpt_plugins import CorruptCheckpointError, NotACheckpointError
from ckpt_plugins.ext import (FOREIGN_CHUNK, MASTER, MODEL, OPTIM, DictHandler, ForeignMetadata, ForeignReader, Fragment,
                              LazyFragment, StandIn, Storage, TensorLocation, Transform, canonical_name, computed,
                              dtype_from_name, flat_views, raw_box, read_archive, read_located, read_object,
                              read_tensor, storage_for, tensor_meta, write_checkpoint)

NAME = "DeepSpeed"
LATEST = "latest"
# Top-level entries of DeepSpeed's model-states file; anything else is the user's client_state.
DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
           "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
           "ds_version", "checkpoint_parallel_dimensions", "iteration", "ds_zero_partition_groups"}
_MODEL_STATES = re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_00_model_states\.pt")
_RANKED = re.compile(r"zero_pp_rank_(\d+)_")


def _enum_value(value) -> int:
    """An enum member pickled by DeepSpeed (ZeroStageEnum) comes back as a stand-in holding its value."""
    return int(value.args[0]) if isinstance(value, StandIn) else int(value)


def _rank_files(storage: Storage, prefix: str, pattern: str) -> List[str]:
    files = [prefix + n for n in storage.listdir(prefix.rstrip("/")) if re.fullmatch(pattern, n)]
    ranked = sorted((int(_RANKED.search(f).group(1)), f) for f in files)
    if [r for r, _ in ranked] != list(range(len(ranked))):
        raise CorruptCheckpointError(f"{storage}: the per-rank files {pattern} are not ranks 0..N-1: "
                                     f"{[f for _, f in ranked]}")
    return [f for _, f in ranked]


def _tag(storage: Storage) -> str:
    """Where the rank files are: the directory itself, or the tag its `latest` file names."""
    if any(_MODEL_STATES.fullmatch(n) for n in storage.listdir()):
        return ""
    if storage.exists(LATEST):
        tag = storage.read_bytes(LATEST).decode(errors="replace").strip()
        if tag and "/" not in tag and tag not in (".", "..") and storage.exists(tag):
            return tag + "/"
    raise NotACheckpointError(f"{storage} holds no DeepSpeed model states (mp_rank_00_model_states.pt or "
                              "zero_pp_rank_*_mp_rank_00_model_states.pt), nor a `latest` tag naming a directory with them")


def is_deepspeed_dir(storage: Storage) -> bool:
    try:
        _tag(storage)
        return True
    except (NotACheckpointError, OSError):
        return False


def _boxes(key: str, shape, dtype: torch.dtype, parts: List[TensorLocation], offset: int, numel: int,
           start: int) -> List:
    """Raw boxes of elements [start, start + numel) of `key`, held from element `offset` on in the
    flat concatenation of `parts` (each rank's partition: one flat tensor, or its sub-groups')."""
    bounds, at = [], 0
    for part in parts:
        if part.dtype != dtype or not part.contiguous:
            raise CorruptCheckpointError(f"{key}: its partition is {part.dtype} (non-contiguous: {not part.contiguous}), "
                                         f"expected contiguous {dtype}")
        n = math.prod(part.shape)
        bounds.append((at, at + n, part))
        at += n
    out = []
    for (offs, lens), begin in flat_views(shape, start, numel, offset):
        n = math.prod(lens)
        part = next(((lo, p) for lo, hi, p in bounds if lo <= begin and begin + n <= hi), None)
        if part is None:
            raise CorruptCheckpointError(f"{key}: elements {begin}..{begin + n} are not within one partition")
        lo, p = part
        out.append(raw_box(p.file, p.offset + (begin - lo) * dtype.itemsize, dtype, offs, lens))
    return out


@dataclass(frozen=True)
class Rounded(Transform):
    """Stage-3 files keep no low-precision weights: they are the fp32 masters, rounded to `dtype`
    (a float32 model takes the masters themselves, as it would from our own checkpoint)."""
    dtype: torch.dtype

    def sources(self, key, shape, dtype, box):
        return [Fragment(key, tuple(shape), dtype, box[0], torch.empty(box[1], dtype=dtype))]

    def apply(self, box, read, dtype):
        return read[0].clone() if dtype == torch.float32 else read[0].to(self.dtype).to(dtype)

    def value_dtype(self, stored):
        return self.dtype


class NativeCheckpoint:
    """One DeepSpeed checkpoint: its rank files' structures, tensors as locations (each file's
    `data.pkl` read once, when first needed; no tensor data)."""

    def __init__(self, storage: Storage):
        self.storage, tag = storage, _tag(storage)
        self.model_files = _rank_files(storage, tag, r"zero_pp_rank_\d+_mp_rank_00_model_states\.pt")
        self.stage3 = bool(self.model_files)
        if not self.stage3:
            self.model_files = [tag + "mp_rank_00_model_states.pt"]
        self.optim_files = _rank_files(storage, tag, r".*zero_pp_rank_\d+_mp_rank_00_optim_states\.pt")
        if not self.optim_files:
            raise NotACheckpointError(f"{storage} has no ZeRO optimizer files: only ZeRO stages 1-3 are read")
        self.world = len(self.optim_files)
        self._files: Dict[str, Any] = {}
        self.model = self.load(self.model_files[0])

    def load(self, name: str) -> Any:
        if name not in self._files:
            self._files[name] = read_archive(self.storage, name)
        return self._files[name]

    def optim(self, rank: int) -> dict:
        return self.load(self.optim_files[rank])["optimizer_state_dict"]

    def base(self, rank: int) -> dict:
        """The base (torch) optimizer's state dict: stages 1-2 and 3 file it under different names."""
        opt = self.optim(rank)
        return opt["base_optimizer_state"] if "base_optimizer_state" in opt else opt["optimizer_state_dict"]

    def flat(self, rank: int, group: Optional[int], what: str) -> List[TensorLocation]:
        """Rank `rank`'s flat fp32 partition (`what` = MASTER) or optimizer state of group `group`;
        for stage 3 (group None) every sub-group's, in order."""
        opt, states = self.optim(rank), self.base(rank)["state"]
        if group is None:
            return list(opt["fp32_flat_groups"]) if what == MASTER else [states[g][what] for g in sorted(states)]
        return [opt["single_partition_of_fp32_groups"][group] if what == MASTER else states[group][what]]

    def value(self, obj: Any) -> Any:
        """A small object with its tensors read (a scheduler's state, a step)."""
        if isinstance(obj, TensorLocation):
            return read_located(self.storage, obj)
        if isinstance(obj, dict):
            return type(obj)((k, self.value(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.value(v) for v in obj)
        return obj



def read_deepspeed(storage: Storage) -> ForeignMetadata:
    """A native checkpoint as foreign metadata (see the module docstring)."""
    ck = NativeCheckpoint(storage)
    model, world = ck.model, ck.world
    lp_dtype = next((t.dtype for t in model["module"].values() if isinstance(t, TensorLocation)), torch.float32)
    low_precision = lp_dtype != torch.float32
    aliases = {f"{MODEL}/{canonical_name(a)}": f"{MODEL}/{canonical_name(t)}"
               for a, t in (model.get("shared_params") or {}).items()}
    base = ck.base(0)
    first = base["state"][next(iter(base["state"]))]
    moments = sorted(k for k, v in first.items() if isinstance(v, TensorLocation) and v.shape)
    flats = ([MASTER] if low_precision else []) + moments  # what the fp32 partitions hold
    boxes: Dict[str, list] = {}
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    transforms: Dict[str, Transform] = {}

    def add(key: str, shape, dtype: torch.dtype, found: List) -> None:
        shapes[key] = (tuple(shape), dtype)
        boxes.setdefault(key, []).extend(found)

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
                        key = f"{OPTIM}/{canonical_name(name)}/{what}"
                        add(key, shape, torch.float32, _boxes(key, shape, torch.float32, ck.flat(rank, None, what),
                                                              offset, numel, start))
                    # DeepSpeed's stage-3 files keep no low-precision weights: they are the rounded masters
                    key = f"{MODEL}/{canonical_name(name)}"
                    add(key, shape, torch.float32, _boxes(key, shape, torch.float32, ck.flat(rank, None, MASTER),
                                                          offset, numel, start))
                    transforms[key] = Rounded(lp_dtype)
                offset += per_rank
        for name, shape in (model.get("frozen_param_shapes") or {}).items():
            shape = tuple(shape)
            per_rank = math.ceil(math.prod(shape) / world)
            for rank in range(world):
                start = rank * per_rank
                numel = max(0, min(per_rank, math.prod(shape) - start))
                key = f"{MODEL}/{canonical_name(name)}"
                piece = ck.load(ck.model_files[rank])["frozen_param_fragments"][name]
                add(key, shape, lp_dtype, _boxes(key, shape, lp_dtype, [piece], 0, numel, start))
    else:
        # stages 1-2: whole low-precision weights (frozen ones too) in the model file; rank r's fp32
        # partition of group g holds the pieces its param_slice_mappings lists, parameter after
        # parameter and rank after rank
        for name, loc in model["module"].items():
            key = f"{MODEL}/{canonical_name(name)}"
            if key not in aliases and isinstance(loc, TensorLocation):
                add(key, loc.shape, loc.dtype, _boxes(key, loc.shape, loc.dtype, [loc], 0, math.prod(loc.shape), 0))
        done: Dict[str, int] = {}
        for rank in range(world):
            for g, mapping in enumerate(ck.optim(rank)["param_slice_mappings"]):
                for name, address in mapping.items():
                    shape = tuple(model["param_shapes"][g][name])
                    group_of[name] = g
                    start = done.get(name, 0)
                    for what in flats:
                        key = f"{OPTIM}/{canonical_name(name)}/{what}"
                        add(key, shape, torch.float32, _boxes(key, shape, torch.float32, ck.flat(rank, g, what),
                                                              address.start, address.numel, start))
                    done[name] = start + address.numel
    tensors = {k: tensor_meta(shapes[k][0], shapes[k][1], b) for k, b in sorted(boxes.items())}
    objects: Dict[str, list] = {f"{OPTIM}/{canonical_name(n)}/step": computed(
        lambda g=g: torch.as_tensor(ck.value(base["state"][g]["step"])).reshape(())) for n, g in group_of.items()}
    objects[f"{OPTIM}/param_groups"] = computed(lambda: [
        {**{k: ck.value(v) for k, v in group.items() if k != "params"},
         "params": [canonical_name(n) for n, g in group_of.items() if g in set(group["params"])]}
        for group in base["param_groups"]])
    if model.get("lr_scheduler"):
        sched = DictHandler(ck.value(dict(model["lr_scheduler"]))).save_items("sched")
        objects.update((k, computed(lambda v=v: v)) for k, v in sched.objects.items())
        objects.update((f.key, computed(lambda t=f.local: t)) for f in sched.fragments)
    objects.update({f"engine/{k}": computed(lambda v=int(model[k]): v)
                    for k in ("global_steps", "global_samples", "skipped_steps") if k in model})
    objects["client_state"] = computed(lambda: ck.value({k: v for k, v in model.items() if k not in DS_KEYS}))
    layout = {"zero_stage": 3 if ck.stage3 else _enum_value(ck.optim(0).get("zero_stage", 1)), "dp_world_size": world,
              "dtype": {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(lp_dtype, "fp32")}
    files = {name: storage.size(name) for name in {b.file for t in tensors.values() for b in t.boxes}}
    step = int(model["global_steps"]) if "global_steps" in model else None
    return ForeignMetadata(tensors=tensors, objects=objects, files=files, aliases=aliases, framework="deepspeed",
                           layout=layout, step=step, chunk_bytes=FOREIGN_CHUNK, source=NAME, transforms=transforms)


READER = ForeignReader(NAME, is_deepspeed_dir, read_deepspeed)


def import_deepspeed(ckpt_dir: str, path, *, overwrite: bool = False, progress=None):
    """Convert a native DeepSpeed checkpoint (a tag directory, or a save dir with a `latest` file),
    read by the same reader as a load in place."""
    storage = storage_for(ckpt_dir)
    view = read_deepspeed(storage)
    fragments = []
    for key, meta in view.tensors.items():
        how = view.transforms.get(key)
        dtype = dtype_from_name(meta.dtype)
        fragments.append(LazyFragment(key, meta.shape, how.value_dtype(dtype) if how else dtype, (0,) * len(meta.shape),
                                      meta.shape, lambda k=key: read_tensor(storage, view, k)))
    objects = {}
    for key in view.objects:
        value = read_object(storage, view, key, None)
        if isinstance(value, torch.Tensor):
            fragments.append(LazyFragment(key, tuple(value.shape), value.dtype, (0,) * value.dim(), tuple(value.shape),
                                          lambda v=value: v))
        else:
            objects[key] = value
    layout = {**view.layout, "imported_from": "deepspeed"}
    return write_checkpoint(path, fragments, objects, aliases=view.aliases, framework="deepspeed", layout=layout,
                            step=objects.get("engine/global_steps"), overwrite=overwrite, progress=progress)
