"""Megatron's torch_dist checkpoints, read in place (`cp.load` of the directory, the reader the
`ckpt_plugins.readers` entry point registers) and by `bcp import-megatron DIR PATH`, which writes
the same view as a ckpt_plugins checkpoint: in one process, with no GPU, process group or megatron
import; the tensors under the HF family's names.

torch_dist is PyTorch DCP, read by the core's DCP reader: a pickled `.metadata` (read with an
allowlist of DCP's own metadata classes) and `__R_I.distcp` files of `torch.save`d chunks, whose
tensor bytes are read in place; objects with torch's weights-only unpickler (Megatron's args and
enums become inert stand-ins). Model tensors are stored globally, layers (and experts) stacked on
leading axes: each layer's (expert's) slice is a TP1 tensor, cut into canonical tensors by the same
segments as a live model. The distributed optimizer's default (`dp_reshardable`) state is one flat
buffer per bucket and model-parallel rank of each optimizer (a MoE run chains a dense one over (TP,
PP) ranks and an expert one over (expert-TP, EP, PP) ranks), packing that rank's parameters in
reverse order at 64-element aligned starts: the packing is rebuilt from the run's arguments and
checked against the chunk boundaries DCP recorded (a mismatch is an error, never a silent
misassignment). A checkpoint without run arguments (written by `dist_checkpointing.save` outside
megatron.training) takes the model's sizes from an HF config.json (--hf-config, or beside it).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import torch

from ckpt_plugins import CorruptCheckpointError, NotACheckpointError
from ckpt_plugins.ext import (DCP_METADATA, FOREIGN_CHUNK, HF_CONFIG, MASTER, MODEL, OPTIM, Dims, ForeignMetadata,
                              ForeignReader, LazyFragment, ModelConfig, StandIn, Storage, chunk_boxes, chunk_location,
                              computed, data_files, dcp_index, dtype_from_name, hf_config, load_torch_inert,
                              model_config, read_dcp_metadata, read_object, read_tensor, saved_groups, segment_pieces,
                              storage_for, tensor_meta, view_boxes, within, write_checkpoint)
from .family import OWN_NAMES, Ranks, canonical_segments, megatron_family, moe_layers

from .gpt import LAYOUT_KEYS
from .training import (BACKEND_FILE, NATIVE_FORMAT as NAME, TORCH_DCP_FORMAT as TORCH_DCP, checkpoint_dir,
                       tracked_iteration)

CONFIG = "config.json"  # an HF config beside a checkpoint without run arguments: its sizes
ALIGN = 64  # the distributed optimizer's parameter alignment in its buffers (elements)


class DcpCheckpoint:
    """One torch_dist checkpoint directory, read through the core's DCP reader (one assembled
    tensor cached at a time): tensor chunks as raw bytes in place, objects weights-only."""

    def __init__(self, directory):
        self.storage = directory if isinstance(directory, Storage) else storage_for(directory)
        self.dir = str(self.storage)
        if not self.storage.exists(DCP_METADATA):
            raise NotACheckpointError(f"{directory} has no {DCP_METADATA}: not a Megatron torch_dist checkpoint "
                                      f"(or one whose save did not finish)")
        self.md = read_dcp_metadata(self.storage)
        self.index = dcp_index(self.md)
        # torch_dcp (Megatron with torch FSDP2): generate_state_dict's {"args", "iteration", "model": ...}
        # saved by DCP itself, per-layer names under "model."; else torch_dist's sharded layout
        self.torch_dcp = "args" in self.md.state_dict_metadata and any(
            k.startswith(("model.embedding.", "model.decoder.")) for k in self.md.state_dict_metadata)
        self._cached: Tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def _info(self, fqn: str, offset):
        info = self.index.get((fqn, offset))
        if info is None:
            raise CorruptCheckpointError(f"{self.dir}: no stored data for {fqn} at {offset}")
        return info

    def tensors(self) -> Dict[str, Any]:
        return {k: v for k, v in self.md.state_dict_metadata.items() if hasattr(v, "chunks")}

    def chunks(self, fqn: str) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        return [(tuple(c.offsets), tuple(c.sizes)) for c in self.md.state_dict_metadata[fqn].chunks]

    def tensor(self, fqn: str) -> torch.Tensor:
        if self._cached[0] == fqn:
            return self._cached[1]
        meta = self.md.state_dict_metadata[fqn]
        dtype = meta.properties.dtype
        full = torch.empty(tuple(meta.size), dtype=dtype)
        for offsets, sizes in self.chunks(fqn):
            info = self._info(fqn, offsets)
            data = bytearray(math.prod(sizes) * dtype.itemsize)
            self.storage.read_into(info.relative_path, chunk_location(self.storage, info, fqn, dtype, sizes), data)
            view = full
            for d, (o, n) in enumerate(zip(offsets, sizes)):
                view = view.narrow(d, o, n)
            if data:
                view.copy_(torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(sizes))
        self._cached = (fqn, full)
        return full

    def item(self, fqn: str) -> Any:
        """A plain DCP bytes item's value (torch_dcp's args, iteration)."""
        info = self._info(fqn, None)
        data = bytearray(info.length)
        self.storage.read_into(info.relative_path, info.offset, data)
        return load_torch_inert(bytes(data), f"{self.dir}: {fqn}")

    def object(self, fqn: str) -> Any:
        """A sharded object (`<fqn>/shard_...`): the first shard's value."""
        keys = sorted(k for k in self.md.state_dict_metadata if k.startswith(fqn + "/shard_"))
        if not keys:
            raise CorruptCheckpointError(f"{self.dir}: no object {fqn}")
        info = self._info(keys[0], None)
        data = bytearray(info.length)
        self.storage.read_into(info.relative_path, info.offset, data)
        return load_torch_inert(bytes(data), f"{self.dir}: {fqn}")


def _args_dims(args, padded_vocab: int) -> Dims:
    """The mapping's view of the run's arguments (megatron.training's names)."""
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    experts = int(getattr(args, "num_experts", None) or getattr(args, "num_moe_experts", None) or 0)
    shared = int(getattr(args, "moe_shared_expert_intermediate_size", None) or 0)
    mla = bool(getattr(args, "multi_latent_attention", False))
    family = megatron_family(moe=bool(experts), mla=mla, qk_norm=bool(getattr(args, "qk_layernorm", False)),
                             qkv_bias=bool(getattr(args, "add_qkv_bias", False) or args.add_bias_linear),
                             shared_experts=bool(shared), shared_gate=bool(getattr(args, "moe_shared_expert_gate", False)))
    return Dims(hidden=args.hidden_size, ffn=args.ffn_hidden_size, heads=heads, groups=groups or heads,
                head_dim=args.kv_channels or args.hidden_size // heads, vocab=args.vocab_size or padded_vocab,
                tied=not args.untie_embeddings_and_output_weights, gated=bool(args.swiglu), family=family,
                experts=experts, moe_ffn=int(getattr(args, "moe_ffn_hidden_size", None) or 0) if experts else 0,
                shared_ffn=shared, mla=mla)


_EXPERTS = "decoder.layers.mlp.experts.experts."  # stacked [layer, expert, ...] (SequentialMLP / TEGroupedMLP)


def _places(ck: DcpCheckpoint, fqn: str, shape: Tuple[int, ...]) -> List[Tuple[Tuple[int, ...], str]]:
    """torch_dist stores model tensors TP-merged, layers (and experts) stacked on leading axes: each
    layer's (expert's) slice, at this index, is the TP1 / EP1 tensor of this Megatron name.
    torch_dcp stores each parameter whole under "model.<its name>"."""
    if ck.torch_dcp:
        return [((), fqn[len("model."):])] if fqn.startswith("model.") else []
    if fqn.startswith(_EXPERTS):
        rest = fqn[len(_EXPERTS):]
        return [((layer, e), f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{rest}")
                for layer in range(shape[0]) for e in range(shape[1])]
    if fqn.startswith("decoder.layers."):
        return [((layer,), f"decoder.layers.{layer}.{fqn[len('decoder.layers.'):]}") for layer in range(shape[0])]
    return [((), fqn)]


def _model_tensors(ck: DcpCheckpoint, dims: Dims) -> Dict[str, Any]:
    """The model's canonical tensors as raw boxes of the checkpoint's chunks, read in place: each
    chunk's part of a layer's (expert's) TP1 tensor cut by the same segments as a live model."""
    boxes: Dict[str, list] = {}
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for fqn, meta in ck.tensors().items():
        if ".optimizer." in f".{fqn}" or "_extra_state" in fqn:
            continue
        shape, dtype = tuple(meta.size), meta.properties.dtype
        chunks = chunk_boxes(ck.storage, ck.md, ck.index, fqn)
        for index, name in _places(ck, fqn, shape):
            lead, local = len(index), shape[len(index):]
            segments = canonical_segments(name, local, dims)
            for chunk in chunks:
                rel = [i - o for i, o in zip(index, chunk.offsets[:lead])]
                if any(not 0 <= r < n for r, n in zip(rel, chunk.lengths[:lead])):
                    continue
                inner = (tuple(chunk.offsets[lead:]), tuple(chunk.lengths[lead:]))
                first = sum(r * math.prod(chunk.lengths[d + 1:]) for d, r in enumerate(rel))
                probe = torch.empty(inner[1], dtype=dtype, device="meta")
                for seg, view, at in segment_pieces(within(segments, inner), inner[1], probe, None):
                    if seg.name is not None:
                        key = f"{MODEL}/{seg.name}"
                        shapes[key] = (seg.shape, dtype)
                        boxes.setdefault(key, []).extend(
                            view_boxes(chunk.file, chunk.offset + first * dtype.itemsize, view, at))
    return {key: tensor_meta(shapes[key][0], shapes[key][1], b) for key, b in sorted(boxes.items())}

def _stage_params(args, dims: Dims, padded_vocab: int, pp_rank: int, tp_rank: int,
                  expert: Optional[Tuple[int, int]] = None):
    """(name, local shape, TP dim) of the parameters one optimizer steps on one rank, in the local
    layer spec's named_parameters order: the dense ones of (TP, PP) rank, or with `expert` =
    (EP rank, expert-TP rank) the experts'. Local expert numbers, as the live model names them."""
    tp, pp, h = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, dims.hidden
    if args.num_layers % pp or getattr(args, "decoder_first_pipeline_num_layers", None) \
            or getattr(args, "decoder_last_pipeline_num_layers", None):
        raise ValueError("uneven pipeline stages are not supported by the optimizer import; pass --weights-only")
    unsupported = [what for what, present in (
        ("multi-latent attention", dims.mla), ("shared experts", dims.shared_ffn), ("linear biases", args.add_bias_linear),
        ("a non-SwiGLU MLP", not dims.gated),
        ("dense layers in a MoE model", dims.experts and getattr(args, "moe_layer_freq", 1) != 1)) if present]
    if unsupported:
        raise ValueError(f"the optimizer import rebuilds the distributed optimizer's buffers for GPT models "
                         f"without {', '.join(unsupported)}; pass --weights-only to import the weights")
    per_stage = args.num_layers // pp
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    local_experts = dims.experts // (getattr(args, "expert_model_parallel_size", 1) or 1) if dims.experts else 0
    out = []
    if pp_rank == 0 and expert is None:
        out.append(("embedding.word_embeddings.weight", (padded_vocab // tp, h), 0))
    for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        p = f"decoder.layers.{layer}."
        if expert is not None:
            for i in range(local_experts):
                out += [(f"{p}mlp.experts.local_experts.{i}.linear_fc1.weight", (2 * dims.moe_ffn // etp, h), 0),
                        (f"{p}mlp.experts.local_experts.{i}.linear_fc2.weight", (h, dims.moe_ffn // etp), 1)]
            continue
        out += [(p + "input_layernorm.weight", (h,), None),
                (p + "self_attention.linear_proj.weight", (h, dims.heads * dims.head_dim // tp), 1),
                (p + "self_attention.linear_qkv.weight", ((dims.heads + 2 * dims.groups) * dims.head_dim // tp, h), 0)]
        if getattr(args, "qk_layernorm", False):
            out += [(p + "self_attention.q_layernorm.weight", (dims.head_dim,), None),
                    (p + "self_attention.k_layernorm.weight", (dims.head_dim,), None)]
        out.append((p + "pre_mlp_layernorm.weight", (h,), None))
        out += [(p + "mlp.router.weight", (dims.experts, h), None)] if dims.experts else [
            (p + "mlp.linear_fc1.weight", (2 * dims.ffn // tp, h), 0), (p + "mlp.linear_fc2.weight", (h, dims.ffn // tp), 1)]
    if pp_rank == pp - 1 and expert is None:
        out.append(("decoder.final_layernorm.weight", (h,), None))
        if not dims.tied or pp > 1:
            out.append(("output_layer.weight", (padded_vocab // tp, h), 0))
    return out


_BUCKET = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(\w+)")


def _optimizer_ranks(args, chained: int, mp: int) -> Tuple[Ranks, int, int, Optional[Tuple[int, int]]]:
    """Where an optimizer's `dp_group_idx` sits: (Ranks, PP rank, TP rank, (EP, expert-TP) rank or
    None). It is the rank in the optimizer's model-parallel group, ordered by global rank: TP then
    PP for the dense optimizer (chained 0); expert-TP, then EP, then PP for the expert one (1)."""
    tp = args.tensor_model_parallel_size
    if chained == 0:
        pp_rank, tp_rank = divmod(mp, tp)
        return Ranks(tp_rank, tp), pp_rank, tp_rank, None
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    pp_rank, rest = divmod(mp, ep * etp)
    ep_rank, etp_rank = divmod(rest, etp)
    return Ranks(0, tp, ep_rank, ep, etp_rank, etp), pp_rank, 0, (ep_rank, etp_rank)



def _optimizer_view(ck: DcpCheckpoint, args, dims: Dims, padded_vocab: int, masters: bool):
    """The distributed optimizer's dp_reshardable state (a MoE run's dense and expert optimizers
    chained) as raw boxes of the canonical `optim/<name>/{master,exp_avg,exp_avg_sq}` tensors, read
    in place from the buckets' chunks, and objects: each parameter's step, the param groups."""
    buckets: Dict[Tuple[int, int], Dict[Tuple[int, str, int], Dict[str, str]]] = {}
    for fqn in ck.tensors():
        m = _BUCKET.fullmatch(fqn)
        if m:
            chained, mp, gbuf, dtype, bucket, what = m.groups()
            key = (int(chained or 0), int(mp))
            buckets.setdefault(key, {}).setdefault((int(gbuf), dtype, int(bucket)), {})[what] = fqn
    if not buckets:
        raise ValueError("the checkpoint's optimizer state is not in the distributed optimizer's dp_reshardable "
                         "format (the only one read); pass --weights-only to import the weights")
    if max(c for c, _ in buckets) > 1:
        raise ValueError("more than a dense and an expert optimizer in the checkpoint; pass --weights-only")
    boxes: Dict[str, list] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    one_d: Dict[str, Tuple[int, bool]] = {}  # name -> (its optimizer, 1-D: Megatron gives it no weight decay)
    for (chained, mp), rank_buckets in sorted(buckets.items()):
        ranks, pp_rank, tp_rank, expert = _optimizer_ranks(args, chained, mp)
        if len({k[:2] for k in rank_buckets}) != 1:
            raise ValueError(f"optimizer {chained}, model-parallel rank {mp}: expected one gradient buffer, found "
                             f"{sorted(rank_buckets)}")
        params = list(reversed(_stage_params(args, dims, padded_vocab, pp_rank, tp_rank, expert)))
        for key in sorted(rank_buckets, key=lambda k: k[2]):
            entries = rank_buckets[key]
            size = int(ck.md.state_dict_metadata[entries["param"]].size[0])
            # DCP records each parameter's range, cut further where the bucket's DP shards meet
            starts = {o[0] for o, _ in ck.chunks(entries["param"])}
            ends = {o[0] + s[0] for o, s in ck.chunks(entries["param"])}
            chunks = {what: chunk_boxes(ck.storage, ck.md, ck.index, fqn) for what, fqn in entries.items()
                      if what != "param" or masters}
            pos = 0
            while params:
                name, shape, dim = params[0]
                start = math.ceil(pos / ALIGN) * ALIGN
                numel = math.prod(shape)
                if start + numel > size:
                    break
                if start not in starts or start + numel not in ends:
                    raise CorruptCheckpointError(
                        f"cannot rebuild the distributed optimizer's buffer layout: {name} would sit at "
                        f"[{start}, {start + numel}) of {entries['param']}, which DCP does not record (a "
                        "transformer-engine spec or another Megatron version?); pass --weights-only")
                params.pop(0)
                pos = start + numel
                segments = canonical_segments(name, shape, dims, ranks, dim)
                for seg in segments:
                    if seg.name is not None:
                        one_d[seg.name] = (chained, len(shape) == 1)
                for what, stored in chunks.items():
                    state = MASTER if what == "param" else what
                    for chunk in stored:  # the parameter's elements in this chunk of the bucket
                        lo = max(start, chunk.offsets[0])
                        hi = min(start + numel, chunk.offsets[0] + chunk.lengths[0])
                        if lo >= hi:
                            continue
                        probe = torch.empty(hi - lo, dtype=torch.float32, device="meta")
                        base = chunk.offset + (lo - chunk.offsets[0]) * 4
                        for seg, view, at in segment_pieces(segments, shape, probe, lo - start):
                            if seg.name is not None:
                                k = f"{OPTIM}/{seg.name}/{state}"
                                shapes[k] = seg.shape
                                boxes.setdefault(k, []).extend(view_boxes(chunk.file, base, view, at))
        if params:
            raise CorruptCheckpointError(f"optimizer {chained}, model-parallel rank {mp}: {len(params)} parameters do "
                                         "not fit its buckets; pass --weights-only")
    tensors = {k: tensor_meta(shapes[k], torch.float32, b) for k, b in sorted(boxes.items())}
    return tensors, _optimizer_objects(ck, one_d)


def _optimizer_objects(ck: DcpCheckpoint, one_d: Dict[str, Tuple[int, bool]]) -> Dict[str, list]:
    """Each parameter's step and the param groups, from the optimizers' own state (read when a
    load asks): Megatron's default grouping, no weight decay for 1-D parameters (norms)."""
    cache: Dict[str, Any] = {}

    def groups() -> Dict[str, Any]:
        if not cache:
            saved, steps = [], {}
            for chained in sorted({c for c, _ in one_d.values()}):
                prefix = f"chained_{chained}." if any(k.startswith("chained_") for k in ck.md.state_dict_metadata) else ""
                found = ck.object(f"{prefix}optimizer.distributed.dp_group_idx_0.optimizer")
                for g in (found[0] if isinstance(found, list) else found)["param_groups"]:
                    members = [n for n, (c, flat) in one_d.items() if c == chained and flat == (g.get("wd_mult", 1.0) == 0)]
                    saved.append({**{k: v for k, v in g.items() if k != "step"}, "params": members})
                    steps.update((n, float(g.get("step", 0))) for n in members)
            cache.update(groups=saved_groups(saved, LAYOUT_KEYS), steps=steps)
        return cache

    objects = {f"{OPTIM}/param_groups": computed(lambda: groups()["groups"])}
    objects.update({f"{OPTIM}/{n}/step": computed(lambda n=n: torch.tensor(groups()["steps"][n])) for n in one_d})
    return objects


def resolve(directory: str) -> str:
    """An iteration directory, or the save directory with Megatron's tracker file."""
    if os.path.isfile(os.path.join(directory, DCP_METADATA)):
        return directory
    iteration = tracked_iteration(directory)
    return directory if iteration is None else checkpoint_dir(directory, iteration)


def _args_config(args, dims: Dims) -> ModelConfig:
    """The run's sizes for the imported checkpoint's config.json."""
    moe = moe_layers(getattr(args, "moe_layer_freq", 1), args.num_layers)
    eps = getattr(args, "layernorm_epsilon", None) or getattr(args, "norm_epsilon", None) or 1e-5
    return ModelConfig(dims=dims, layers=args.num_layers, norm_eps=eps,
                       rope_theta=float(getattr(args, "rotary_base", 10000)),
                       max_positions=getattr(args, "max_position_embeddings", None) or args.seq_length,
                       dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
                       topk=getattr(args, "moe_router_topk", 0) or 0,
                       dense_layers=tuple(i for i, m in enumerate(moe) if not m) if dims.experts else (),
                       norm_topk=not getattr(args, "moe_router_pre_softmax", False))


def _common_state(ck: DcpCheckpoint) -> dict:
    """megatron.training's common state; {} for a checkpoint written by
    `megatron.core.dist_checkpointing.save` outside it (Megatron-Bridge, NeMo, users' scripts)."""
    if ck.torch_dcp:
        return {k: ck.item(k) for k in ("args", "iteration", "num_floating_point_operations_so_far")
                if k in ck.md.state_dict_metadata}
    if not any(k.startswith("common_state/") for k in ck.md.state_dict_metadata):
        return {}
    common = ck.object("common_state")
    return common[0] if isinstance(common, list) else common


def _run(ck: DcpCheckpoint, config_json: Optional[bytes]):
    """(common state, run arguments, Dims, ModelConfig, padded vocabulary) of a torch_dist
    checkpoint: the sizes from the run's arguments, or from an HF config.json for one without them."""
    common = _common_state(ck)
    args = common.get("args")
    prefix = "model." if ck.torch_dcp else ""
    embedding = ck.tensors().get(prefix + "embedding.word_embeddings.weight") or ck.tensors().get(
        prefix + "output_layer.weight")
    if embedding is None:
        raise NotACheckpointError(f"{ck.dir} holds no GPT embedding or output layer (model keys "
                                  f"{sorted(ck.tensors())[:3]}...): not a megatron-core GPT checkpoint")
    padded_vocab = int(embedding.size[0])
    if config_json is not None:
        config = model_config(json.loads(config_json))
        dims = replace(config.dims, vocab=min(config.dims.vocab, padded_vocab))
    elif isinstance(args, StandIn):
        dims = _args_dims(args, padded_vocab)
        config = _args_config(args, dims)
    else:
        raise NotACheckpointError(
            f"{ck.dir}: its common state has no run arguments (written by megatron.core.dist_checkpointing.save "
            "outside megatron.training, e.g. by Megatron-Bridge or NeMo): pass --hf-config CONFIG_JSON, the "
            "model's HF config.json, to take its sizes from it (or put it beside .metadata to load in place; the "
            "weights come in; its optimizer state, if any, needs the run's arguments)")
    return common, args, dims, config, padded_vocab


def read_megatron(storage) -> ForeignMetadata:
    """A torch_dist checkpoint directory as foreign metadata: the model's weights under the HF
    family's names, read in place from its chunks, at any layout (its optimizer state comes in
    through `bcp import-megatron`). Sizes from the run's arguments, or a config.json beside it."""
    ck = DcpCheckpoint(storage)
    common, args, dims, config, padded_vocab = _run(ck, storage.read_bytes(CONFIG) if storage.exists(CONFIG) else None)
    tensors, objects, descriptive = _model_tensors(ck, dims), {}, ()
    if dims.family != OWN_NAMES.name:
        text = json.dumps(hf_config(config), indent=2)
        objects[HF_CONFIG] = computed(lambda: text)
        descriptive = (HF_CONFIG,)
    if _distributed_optimizer(ck, args):
        optim, optim_objects = _optimizer_view(ck, args, dims, padded_vocab, masters=bool(args.bf16 or args.fp16))
        tensors.update(optim)
        objects.update(optim_objects)
    return ForeignMetadata(tensors=tensors, objects=objects, files=data_files(storage, ck.index),
                           framework="megatron",
                           layout={"format": "torch_dcp" if ck.torch_dcp else "torch_dist", **_layout(args)},
                           step=int(common.get("iteration", 0)) if common else None, chunk_bytes=FOREIGN_CHUNK,
                           source=TORCH_DCP if ck.torch_dcp else NAME, descriptive=descriptive)


def _distributed_optimizer(ck: DcpCheckpoint, args) -> bool:
    """Whether the checkpoint holds a distributed optimizer's state its run's arguments describe."""
    return (isinstance(args, StandIn) and bool(getattr(args, "use_distributed_optimizer", False))
            and any(_BUCKET.fullmatch(k) for k in ck.tensors()))


def _layout(args) -> Dict[str, Any]:
    if not isinstance(args, StandIn):
        return {}
    return dict(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                ep=getattr(args, "expert_model_parallel_size", 1) or 1,
                distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)))


def is_torch_dist(storage) -> bool:
    """A torch_dist checkpoint: DCP's `.metadata` beside Megatron's own `metadata.json` naming it."""
    return (storage.exists(DCP_METADATA) and storage.exists(BACKEND_FILE)
            and b'"torch_dist"' in storage.read_bytes(BACKEND_FILE)[:256])


def is_torch_dcp(storage) -> bool:
    """Megatron's torch_dcp checkpoint: a DCP directory holding generate_state_dict's layout."""
    return storage.exists(DCP_METADATA) and not storage.exists(BACKEND_FILE) and DcpCheckpoint(storage).torch_dcp


READER = ForeignReader(NAME, is_torch_dist, read_megatron)
TORCH_DCP_READER = ForeignReader(TORCH_DCP, is_torch_dcp, read_megatron)


def import_megatron(directory: str, path, *, weights_only: bool = False, overwrite: bool = False, progress=None,
                    hf_config_path: Optional[str] = None):
    """A native torch_dist checkpoint as a ckpt_plugins checkpoint. The model's sizes come from the
    run's arguments, or from `hf_config_path` (an HF config.json) for a checkpoint without them.
    The weights are read by the same reader as a load in place."""
    ck = DcpCheckpoint(resolve(directory))
    config_json = None
    if hf_config_path is not None:
        with open(hf_config_path, "rb") as f:
            config_json = f.read()
    common, args, dims, config, padded_vocab = _run(ck, config_json)
    has_optimizer = any(_BUCKET.fullmatch(k) for k in ck.tensors())
    if not weights_only and has_optimizer and not isinstance(args, StandIn):
        raise ValueError(f"{ck.dir}: its optimizer state's layout needs the run's arguments, which it does not "
                         "record; pass --weights-only to import the weights")
    if not weights_only and isinstance(args, StandIn) and not getattr(args, "use_distributed_optimizer", False):
        raise ValueError("only the distributed optimizer's state is imported; pass --weights-only")
    tensors, view_objects = _model_tensors(ck, dims), {}
    if not weights_only and _distributed_optimizer(ck, args):
        optim, view_objects = _optimizer_view(ck, args, dims, padded_vocab, masters=bool(args.bf16 or args.fp16))
        tensors.update(optim)
    view = ForeignMetadata(tensors=tensors, objects=view_objects, files=data_files(ck.storage, ck.index),
                           chunk_bytes=FOREIGN_CHUNK)
    fragments = [LazyFragment(key, meta.shape, dtype_from_name(meta.dtype), (0,) * len(meta.shape), meta.shape,
                              lambda k=key: read_tensor(ck.storage, view, k)) for key, meta in view.tensors.items()]
    objects: Dict[str, Any] = {"megatron/iteration": int(common.get("iteration", 0)),
                               "megatron/num_floating_point_operations_so_far":
                                   float(common.get("num_floating_point_operations_so_far", 0))}
    if dims.family != OWN_NAMES.name:
        objects[HF_CONFIG] = json.dumps(hf_config(config), indent=2)
    for key in view_objects:  # steps are scalar tensors, as the live optimizers keep them
        value = read_object(ck.storage, view, key, None)
        if isinstance(value, torch.Tensor):
            fragments.append(LazyFragment(key, (), torch.float32, (), (), lambda v=value: v))
        else:
            objects[key] = value
    if view_objects:
        sched = common.get("opt_param_scheduler")
        if isinstance(sched, dict):
            objects.update({f"sched/{k}": v for k, v in sched.items()})
    layout = {"imported_from": "megatron torch_dist", **_layout(args)}
    return write_checkpoint(path, fragments, objects, framework="megatron", layout=layout,
                            step=objects["megatron/iteration"], overwrite=overwrite, progress=progress)
