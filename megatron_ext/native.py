"""`bcp import-megatron DIR PATH`: a native Megatron torch_dist checkpoint becomes a ckpt_plugins
checkpoint under HF Llama names, in one process, with no GPU, process group or megatron import.

torch_dist is PyTorch DCP: a pickled `.metadata` (read with an allowlist of DCP's own metadata
classes) and `__R_I.distcp` files of `torch.save`d chunks (read with torch's weights-only
unpickler; Megatron's args and enums become inert stand-ins). Model tensors are stored globally,
layers stacked on a leading axis: each layer's slice is a TP1 tensor, cut into HF tensors by the
same segments as a live model. The distributed optimizer's default (`dp_reshardable`) state is
one flat buffer per bucket and (TP, PP) rank, packing that rank's parameters in reverse order at
64-element aligned starts: the packing is rebuilt from the run's arguments and checked against the
chunk boundaries DCP recorded (a mismatch is an error, never a silent misassignment).
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from ckpt_plugins.errors import CorruptCheckpointError, NotACheckpointError, UnsafePathError
from ckpt_plugins.families.megatron import Dims, Ranks, canonical_segments
from ckpt_plugins.foreign import StandIn, load_pickle_restricted, load_torch_inert
from ckpt_plugins.offline import LazyFragment, write_checkpoint
from ckpt_plugins.state import MASTER, MODEL, OPTIM

from .gpt import _pieces
from .training import checkpoint_dir, tracked_iteration

DCP_METADATA = ".metadata"
ALIGN = 64  # the distributed optimizer's parameter alignment in its buffers (elements)


def _dcp_classes() -> Dict[Tuple[str, str], Any]:
    import collections

    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    import torch.distributed.checkpoint.planner as pl
    allowed: Dict[Tuple[str, str], Any] = {
        (md.__name__, n): getattr(md, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                   "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                   "StorageMeta", "_MEM_FORMAT_ENCODING")}
    allowed.update({(pl.__name__, n): getattr(pl, n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                               "TensorWriteData")})
    allowed[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a name -> layout lookup
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed.update({("torch", n): getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)})
    return allowed


class DcpCheckpoint:
    """One torch_dist checkpoint directory, read lazily (one assembled tensor cached at a time)."""

    def __init__(self, directory: str):
        self.dir = directory
        meta_path = os.path.join(directory, DCP_METADATA)
        if not os.path.isfile(meta_path):
            raise NotACheckpointError(f"{directory} has no {DCP_METADATA}: not a Megatron torch_dist checkpoint "
                                      f"(or one whose save did not finish)")
        with open(meta_path, "rb") as f:
            self.md = load_pickle_restricted(f.read(), _dcp_classes(), meta_path)
        self.index = {(i.fqn, None if i.offset is None else tuple(i.offset)): info
                      for i, info in self.md.storage_data.items()}
        self._cached: Tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def _bytes(self, fqn: str, offset) -> bytes:
        info = self.index.get((fqn, offset))
        if info is None:
            raise CorruptCheckpointError(f"{self.dir}: no stored data for {fqn} at {offset}")
        name = info.relative_path
        if os.path.basename(name) != name or name in (".", ".."):
            raise UnsafePathError(f"{self.dir}: {fqn} points outside the checkpoint ({name!r})")
        with open(os.path.join(self.dir, name), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CorruptCheckpointError(f"{self.dir}/{name} is truncated (reading {fqn})")
        return data

    def tensors(self) -> Dict[str, Any]:
        return {k: v for k, v in self.md.state_dict_metadata.items() if hasattr(v, "chunks")}

    def chunks(self, fqn: str) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        return [(tuple(c.offsets), tuple(c.sizes)) for c in self.md.state_dict_metadata[fqn].chunks]

    def tensor(self, fqn: str) -> torch.Tensor:
        if self._cached[0] == fqn:
            return self._cached[1]
        meta = self.md.state_dict_metadata[fqn]
        full = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for offsets, sizes in self.chunks(fqn):
            piece = load_torch_inert(self._bytes(fqn, offsets), f"{self.dir}: {fqn}")
            if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != sizes:
                raise CorruptCheckpointError(f"{self.dir}: chunk {offsets} of {fqn} is not a tensor of shape {sizes}")
            view = full
            for d, (o, n) in enumerate(zip(offsets, sizes)):
                view = view.narrow(d, o, n)
            view.copy_(piece)
        self._cached = (fqn, full)
        return full

    def object(self, fqn: str) -> Any:
        """A sharded object (`<fqn>/shard_...`): the first shard's value."""
        keys = sorted(k for k in self.md.state_dict_metadata if k.startswith(fqn + "/shard_"))
        if not keys:
            raise CorruptCheckpointError(f"{self.dir}: no object {fqn}")
        return load_torch_inert(self._bytes(keys[0], None), f"{self.dir}: {fqn}")


def _args_dims(args, padded_vocab: int) -> Dims:
    for flag, want in (("swiglu", True), ("normalization", "RMSNorm"), ("position_embedding_type", "rope"),
                       ("add_bias_linear", False)):
        if getattr(args, flag, want) != want:
            raise ValueError(f"the checkpoint's run has {flag}={getattr(args, flag)!r}; a Llama-shaped model needs "
                             f"{want!r}")
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    return Dims(hidden=args.hidden_size, ffn=args.ffn_hidden_size, heads=heads, groups=groups or heads,
                head_dim=args.kv_channels or args.hidden_size // heads, vocab=args.vocab_size or padded_vocab,
                tied=not args.untie_embeddings_and_output_weights)


def _lazy(key_of, segments, shape, load, start: Optional[int], numel: int, dtype) -> List[LazyFragment]:
    """LazyFragments for the parts of a TP-local tensor (or of its flat range [start, start+numel))
    that `segments` place in HF tensors. `load()` gives the whole local tensor or the flat range."""
    probe = torch.empty(numel if start is not None else shape, dtype=dtype, device="meta")
    out = []
    for seg, view, at in _pieces(segments, shape, probe, start):
        if seg.name is None:
            continue

        def piece(view=view, load=load):  # the same view of the real data as of the probe
            data = load()  # contiguous, like the probe
            return data.as_strided(view.shape, view.stride(), data.storage_offset() + view.storage_offset())
        out.append(LazyFragment(key_of(seg.name), seg.shape, dtype, at, tuple(view.shape), piece))
    return out


def _model_fragments(ck: DcpCheckpoint, dims: Dims) -> List[LazyFragment]:
    frags: List[LazyFragment] = []
    for fqn, meta in ck.tensors().items():
        if fqn.startswith("optimizer.") or "_extra_state" in fqn:
            continue
        shape = tuple(meta.size)
        stacked = fqn.startswith("decoder.layers.")
        for layer in range(shape[0]) if stacked else [None]:
            name = f"decoder.layers.{layer}.{fqn[len('decoder.layers.'):]}" if stacked else fqn
            local = shape[1:] if stacked else shape
            load = (lambda f=fqn, i=layer: ck.tensor(f)[i]) if stacked else (lambda f=fqn: ck.tensor(f))
            frags += _lazy(lambda n: f"{MODEL}/{n}", canonical_segments(name, local, dims), local, load, None,
                           math.prod(local), meta.properties.dtype)
    return frags


def _stage_params(args, dims: Dims, padded_vocab: int, tp_rank: int, pp_rank: int):
    """(name, TP-local shape, TP dim) of one (TP, PP) rank's parameters, in the local layer spec's
    named_parameters order."""
    tp, pp, h = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, dims.hidden
    if args.num_layers % pp or getattr(args, "decoder_first_pipeline_num_layers", None) \
            or getattr(args, "decoder_last_pipeline_num_layers", None):
        raise ValueError("uneven pipeline stages are not supported by the optimizer import; pass --weights-only")
    per_stage = args.num_layers // pp
    out = []
    if pp_rank == 0:
        out.append(("embedding.word_embeddings.weight", (padded_vocab // tp, h), 0))
    for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        p = f"decoder.layers.{layer}."
        out += [(p + "input_layernorm.weight", (h,), None),
                (p + "self_attention.linear_proj.weight", (h, dims.heads * dims.head_dim // tp), 1),
                (p + "self_attention.linear_qkv.weight", ((dims.heads + 2 * dims.groups) * dims.head_dim // tp, h), 0),
                (p + "pre_mlp_layernorm.weight", (h,), None),
                (p + "mlp.linear_fc1.weight", (2 * dims.ffn // tp, h), 0),
                (p + "mlp.linear_fc2.weight", (h, dims.ffn // tp), 1)]
    if pp_rank == pp - 1:
        out.append(("decoder.final_layernorm.weight", (h,), None))
        if not dims.tied or pp > 1:
            out.append(("output_layer.weight", (padded_vocab // tp, h), 0))
    return out


_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)")


def _optimizer_fragments(ck: DcpCheckpoint, args, dims: Dims, padded_vocab: int, masters: bool):
    """Masters and Adam moments from the dp_reshardable buckets; also each parameter's group."""
    buckets: Dict[int, Dict[Tuple[int, str, int], Dict[str, str]]] = {}
    for fqn in ck.tensors():
        m = _BUCKET.fullmatch(fqn)
        if m:
            mp, gbuf, dtype, bucket, what = m.groups()
            buckets.setdefault(int(mp), {}).setdefault((int(gbuf), dtype, int(bucket)), {})[what] = fqn
    if not buckets:
        raise ValueError("the checkpoint's optimizer state is not in the distributed optimizer's dp_reshardable "
                         "format (the only one imported); pass --weights-only to import the weights")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    frags: List[LazyFragment] = []
    one_d: Dict[str, bool] = {}  # HF name -> whether its parameter is 1-D (Megatron: no weight decay)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            mp = pp_rank * tp + tp_rank  # rank in Megatron's model-parallel group (TP fastest)
            if len(buckets.get(mp, {})) != 1 and len({k[:2] for k in buckets.get(mp, {})}) != 1:
                raise ValueError(f"model-parallel rank {mp}: expected one gradient buffer, found "
                                 f"{sorted(buckets.get(mp, {}))}")
            keys = sorted(buckets[mp], key=lambda k: k[2])
            params = list(reversed(_stage_params(args, dims, padded_vocab, tp_rank, pp_rank)))
            for key in keys:
                entries = buckets[mp][key]
                size = int(ck.md.state_dict_metadata[entries["param"]].size[0])
                chunks = {(o[0], s[0]) for o, s in ck.chunks(entries["param"])}
                pos = 0
                while params:
                    name, shape, dim = params[0]
                    start = math.ceil(pos / ALIGN) * ALIGN
                    numel = math.prod(shape)
                    if start + numel > size:
                        break
                    if (start, numel) not in chunks:
                        raise CorruptCheckpointError(
                            f"cannot rebuild the distributed optimizer's buffer layout: {name} would sit at "
                            f"[{start}, {start + numel}) of {entries['param']}, which DCP does not record (a "
                            "transformer-engine spec or another Megatron version?); pass --weights-only")
                    params.pop(0)
                    pos = start + numel
                    segments = canonical_segments(name, shape, dims, Ranks(tp_rank, tp), dim)
                    for seg in segments:
                        if seg.name is not None:
                            one_d[seg.name] = len(shape) == 1
                    for what, fqn in entries.items():
                        if what == "param" and not masters:
                            continue
                        state = MASTER if what == "param" else what
                        frags += _lazy(lambda n, s=state: f"{OPTIM}/{n}/{s}", segments, shape,
                                       lambda f=fqn, a=start, n=numel: ck.tensor(f)[a:a + n], 0, numel, torch.float32)
            if params:
                raise CorruptCheckpointError(f"model-parallel rank {mp}: {len(params)} parameters do not fit its "
                                             "optimizer buckets; pass --weights-only")
    return frags, one_d


def resolve(directory: str) -> str:
    """An iteration directory, or the save directory with Megatron's tracker file."""
    if os.path.isfile(os.path.join(directory, DCP_METADATA)):
        return directory
    iteration = tracked_iteration(directory)
    return directory if iteration is None else checkpoint_dir(directory, iteration)


def import_megatron(directory: str, path, *, weights_only: bool = False, overwrite: bool = False, progress=None):
    ck = DcpCheckpoint(resolve(directory))
    common = ck.object("common_state")
    common = common[0] if isinstance(common, list) else common
    args = common.get("args")
    if not isinstance(args, StandIn):
        raise CorruptCheckpointError(f"{ck.dir}: its common state has no run arguments")
    embedding = ck.tensors().get("embedding.word_embeddings.weight") or ck.tensors().get("output_layer.weight")
    padded_vocab = int(embedding.size[0])
    dims = _args_dims(args, padded_vocab)
    fragments = _model_fragments(ck, dims)
    objects: Dict[str, Any] = {"megatron/iteration": int(common.get("iteration", 0)),
                               "megatron/num_floating_point_operations_so_far":
                                   float(common.get("num_floating_point_operations_so_far", 0))}
    if not weights_only and getattr(args, "use_distributed_optimizer", False):
        frags, one_d = _optimizer_fragments(ck, args, dims, padded_vocab, masters=bool(args.bf16 or args.fp16))
        fragments += frags
        groups = ck.object("optimizer.distributed.dp_group_idx_0.optimizer")
        groups = (groups[0] if isinstance(groups, list) else groups)["param_groups"]
        saved = []
        for g in groups:  # Megatron's default grouping: no weight decay for 1-D parameters (norms)
            members = [n for n, flat in one_d.items() if flat == (g.get("wd_mult", 1.0) == 0)]
            saved.append({**{k: v for k, v in g.items() if k != "step"}, "params": members})
            step = torch.tensor(float(g.get("step", 0)))
            fragments += [LazyFragment(f"{OPTIM}/{n}/step", (), torch.float32, (), (), lambda s=step: s)
                          for n in members]
        objects[f"{OPTIM}/param_groups"] = saved
        sched = common.get("opt_param_scheduler")
        if isinstance(sched, dict):
            objects.update({f"sched/{k}": v for k, v in sched.items()})
    elif not weights_only:
        raise ValueError("only the distributed optimizer's state is imported; pass --weights-only")
    layout = {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
              "distributed_optimizer": bool(getattr(args, "use_distributed_optimizer", False)),
              "imported_from": "megatron torch_dist"}
    return write_checkpoint(path, fragments, objects, framework="megatron", layout=layout,
                            step=objects["megatron/iteration"], overwrite=overwrite, progress=progress)
