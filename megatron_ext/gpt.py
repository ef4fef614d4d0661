"""megatron-core GPT models (dense and mixture-of-experts) and optimizers as fragments under
canonical names (`megatron_ext.family`).

Every rank describes what it holds, from Megatron's own bookkeeping, as views; nothing is gathered:
- weights (`model/<name>`) in the training dtype, and persistent buffers (the router's expert
  bias): each local tensor cut into segments; DP and expert-DP replicas hold the same boxes, which
  the save plan writes once;
- optimizer state (`optim/<name>/exp_avg`, ...) and, when training in bf16, fp32 masters
  (`optim/<name>/master`): per main parameter the optimizers (dense and expert, chained) step.
  The distributed optimizer's main parameter is elements [start, end) of the flattened local
  parameter, cut at an arbitrary position: its flat-range boxes are intersected with the segments.
"""
from __future__ import annotations

import json
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ckpt_plugins.ext import (MASTER, MODEL, Dims, Fragment, Handler, Ignore, LoadItems, Metadata, ModelConfig,
                              OptimizerHandler, ParamLayout, SaveItems, Segment, add_master_sources, hf_config,
                              segment_fragments, zero_padding)
from .family import OWN_NAMES, Ranks, canonical_segments, hybrid_pairs, megatron_family, moe_layers



def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def model_dims(gpt, vocab_size: Optional[int] = None, family: Optional[str] = None) -> Dims:
    """The canonical mapping's view of a GPTModel's or HybridModel's TransformerConfig. A hybrid
    whose layers are not attention + MLP/MoE pairs has no HF family: its layers keep Megatron names."""
    cfg = gpt.config
    experts = int(cfg.num_moe_experts or 0)
    shared = int(getattr(cfg, "moe_shared_expert_intermediate_size", None) or 0)
    mla = bool(getattr(cfg, "multi_latent_attention", False))
    pattern = getattr(gpt, "hybrid_layer_pattern", None)
    if pattern is not None and hybrid_pairs(pattern) is None:
        family = OWN_NAMES.name
    family = family or megatron_family(
        moe=bool(experts), mla=mla, qk_norm=bool(cfg.qk_layernorm), shared_experts=bool(shared),
        qkv_bias=bool(cfg.add_qkv_bias or cfg.add_bias_linear), shared_gate=bool(cfg.moe_shared_expert_gate))
    mamba = {}
    if pattern is not None and "M" in pattern:
        heads = cfg.mamba_num_heads or 2 * cfg.hidden_size // cfg.mamba_head_dim  # MambaMixer's expand=2
        mamba = dict(mamba_heads=heads, mamba_head_dim=cfg.mamba_head_dim, mamba_groups=cfg.mamba_num_groups,
                     mamba_state=cfg.mamba_state_dim)
    return Dims(hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size, heads=cfg.num_attention_heads,
                groups=cfg.num_query_groups or cfg.num_attention_heads, head_dim=cfg.kv_channels,
                vocab=vocab_size or gpt.vocab_size, tied=gpt.share_embeddings_and_output_weights,
                gated=cfg.gated_linear_unit, family=family, experts=experts,
                moe_ffn=int(cfg.moe_ffn_hidden_size or 0) if experts else 0, shared_ffn=shared, mla=mla, **mamba)


def parallel_ranks() -> Ranks:
    from megatron.core import parallel_state as ps
    return Ranks(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                 ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                 ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())


def _persistent_buffers(module) -> Iterator[Tuple[str, torch.Tensor]]:
    """Buffers that are part of the module's state_dict (the router's expert bias; not its
    per-step token counts, which every optimizer step uses and zeroes)."""
    for mname, sub in module.named_modules():
        for bname, buf in sub._buffers.items():
            if buf is not None and bname not in sub._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), buf


# HybridModel layer kinds whose fused TP-split projections are not cut into parts (they need TE).
_UNSPLIT_HYBRID = {"G": "GatedDeltaNet", "D": "DeepSeek sparse attention"}


def _unsplit(gpt) -> List[str]:
    """The model's layers whose fused TP-split projections (qkv, SwiGLU fc1, ...) keep Megatron
    names without being cut into parts: stored whole at TP1 they reshard, split over TP they would
    not. Multi-token-prediction layers are outside `decoder.layers`, where the cutting happens."""
    pattern = getattr(gpt, "hybrid_layer_pattern", None) or ""
    kinds = [f"HybridModel {_UNSPLIT_HYBRID[k]}" for k in sorted(set(pattern) & set(_UNSPLIT_HYBRID))]
    return kinds + (["multi-token prediction"] if getattr(gpt, "mtp_process", False) else [])


class GPTLayout:
    """Each local parameter's (and persistent buffer's) global Megatron name and segments, over
    all model chunks. `family`: the HF family whose names to use (default: from the config)."""

    def __init__(self, model, vocab_size: Optional[int] = None, family: Optional[str] = None):
        from megatron.core.utils import unwrap_model

        ranks = parallel_ranks()
        self.params: List[Tuple[torch.Tensor, str, List[Segment]]] = []
        self.buffers: List[Tuple[torch.Tensor, str, List[Segment]]] = []
        self.low_precision = False
        for chunk in _chunks(model):
            gpt = unwrap_model(chunk)
            unsplit = _unsplit(gpt)
            if unsplit and max(ranks.tp_size, ranks.etp_size) > 1:
                raise NotImplementedError(f"megatron_ext does not cut the fused TP-split projections of "
                                          f"{', '.join(unsplit)} layers yet: save and load this model at TP1")
            pattern = getattr(gpt, "hybrid_layer_pattern", None)
            paired = pattern is not None and hybrid_pairs(pattern) is not None
            dims = model_dims(gpt, vocab_size, family)
            self.low_precision |= bool(gpt.config.bf16 or gpt.config.fp16)
            for local, p in gpt.named_parameters():
                name = _global_name(gpt, local, paired)
                dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
                self.params.append((p, name, canonical_segments(name, tuple(p.shape), dims, ranks, dim)))
            for local, b in _persistent_buffers(gpt):
                name = _global_name(gpt, local, paired)
                self.buffers.append((b, name, canonical_segments(name, tuple(b.shape), dims, ranks)))
        self.by_id = {id(p): (name, segs) for p, name, segs in self.params}

    def names(self, param) -> Tuple[Tuple[str, ...], Tuple[Tuple[int, ...], ...]]:
        segs = self.by_id[id(param)][1]
        named = {s.name: s.shape for s in segs if s.name is not None}
        return tuple(named), tuple(named.values())

    def weight_fragments(self, prefix: str) -> List[Fragment]:
        return [f for p, _, segs in self.params + self.buffers
                for f in segment_fragments(segs, p.shape, p.detach(), lambda n: f"{prefix}/{n}")]

    def main_layout(self, param, start: Optional[int]) -> ParamLayout:
        """The layout of an optimizer's main parameter for `param`: the whole local parameter
        (start None) or its flattened elements [start, start + numel)."""
        segs, shape = self.by_id[id(param)][1], tuple(param.shape)
        names, shapes = self.names(param)
        pad = (lambda t: zero_padding(segs, shape, t.reshape(-1) if start is not None else t, start)) \
            if any(s.name is None for s in segs) else None
        return ParamLayout(names, shapes, lambda t, key_of: segment_fragments(segs, shape, t, key_of, start), pad=pad)


def _global_name(gpt, local: str, paired: bool = False) -> str:
    """`decoder.layers.<i>.…` with the global layer index (layer_number is global and 1-based);
    `paired`: a HybridModel of attention + MLP pairs, numbered as the GPT layers they form."""
    parts = local.split(".")
    if parts[:2] == ["decoder", "layers"]:
        index = gpt.decoder.layers[int(parts[2])].layer_number - 1
        parts[2] = str(index // 2 if paired else index)
    return ".".join(parts)


class MegatronModel(Handler):
    """The weights and persistent buffers of a (list of) Megatron model chunk(s), DDP /
    Float16Module wrapped or not. `vocab_size`: the real vocabulary when the model's is padded (rows
    past it are not stored); `family`: the HF family whose names to use (default: from the config,
    `families.megatron.megatron_family`)."""

    def __init__(self, model, vocab_size: Optional[int] = None, family: Optional[str] = None):
        self.model, self.vocab_size, self.family = model, vocab_size, family

    def save_items(self, prefix: str) -> SaveItems:
        return SaveItems(fragments=GPTLayout(self.model, self.vocab_size, self.family).weight_fragments(prefix))

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        layout = GPTLayout(self.model, self.vocab_size, self.family)
        frags = add_master_sources(prefix, layout.weight_fragments(prefix))
        for frag in frags:  # bf16 weights are a rounding of the fp32 masters: any stored copy will do
            frag.cast = layout.low_precision

        def pad() -> None:
            with torch.no_grad():
                for p, _, segs in layout.params + layout.buffers:
                    zero_padding(segs, p.shape, p.data)
        return LoadItems(fragments=frags, finish=[pad])


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def main_params(inner) -> List[Tuple[torch.nn.Parameter, torch.Tensor, Optional[int]]]:
    """(model parameter, the main parameter the torch optimizer steps, its first flat element or
    None when whole) for one of Megatron's optimizers."""
    if hasattr(inner, "model_param_gbuf_map"):  # DistributedOptimizer: a shard of each param
        out = []
        for p, (gbuf, dtype, bucket) in inner.model_param_gbuf_map.items():
            prange = inner.gbuf_ranges[gbuf][dtype][bucket]["param_map"][p]["param"]
            group, index = inner.model_param_group_index_map[p]
            out.append((p, inner.optimizer.param_groups[group]["params"][index], prange.start))
        return out
    if hasattr(inner, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params: whole fp32 copies
        pairs = [(p, m) for lp, hp in zip(inner.float16_groups, inner.fp32_from_float16_groups) for p, m in zip(lp, hp)]
        pairs += [(p, p) for group in inner.fp32_from_fp32_groups for p in group]
        return [(p, m, None) for p, m in pairs]
    if hasattr(inner, "optimizer") and isinstance(inner.optimizer, torch.optim.Optimizer):  # FP32Optimizer
        return [(p, p, None) for g in inner.optimizer.param_groups for p in g["params"]]
    raise NotImplementedError(f"megatron_ext cannot map Megatron's {type(inner).__name__}")


# Param-group keys Megatron sets per kind of group: equal across ranks for the same kind of group.
# which optimizer (dense or expert) steps an expert depends on the EP and expert-TP sizes
LAYOUT_KEYS = ("is_expert_parallel",)
_GROUP_KIND = ("wd_mult", "lr_mult", "is_decoupled_lr", "default_config")


class MegatronOptimizer(Handler):
    """Optimizer state and fp32 masters of Megatron's optimizers (distributed or not, fp32 or
    bf16; a MoE model's dense and expert optimizers chained), per canonical parameter, through the
    core's OptimizerHandler. With
    `optimizer_state=False` a load fills the masters only (from the weights) and accepts the rest."""

    def __init__(self, optimizer, model, vocab_size: Optional[int] = None, optimizer_state: bool = True,
                 family: Optional[str] = None):
        self.optimizer, self.inners = optimizer, _inner_optimizers(optimizer)
        self.layout = GPTLayout(model, vocab_size, family)
        self.optimizer_state = optimizer_state

    def _parts(self):
        mains = [m for inner in self.inners for m in main_params(inner)]
        layouts = {id(m): self.layout.main_layout(p, start) for p, m, start in mains}
        masters = [(m, layouts[id(m)]) for p, m, _ in mains if m.dtype != p.dtype]
        return OptimizerHandler([inner.optimizer for inner in self.inners], layouts, layout_keys=LAYOUT_KEYS), masters

    @staticmethod
    def _master_fragments(masters, prefix: str) -> List[Fragment]:
        return [f for m, layout in masters for f in layout.fragments(m.detach(), lambda n: f"{prefix}/{n}/{MASTER}")]

    def save_items(self, prefix: str) -> SaveItems:
        handler, masters = self._parts()
        items = handler.save_items(prefix)
        key = f"{prefix}/param_groups"
        items.objects[key] = self._all_rank_groups(items.objects[key])
        items.fragments += self._master_fragments(masters, prefix)
        return items

    def _all_rank_groups(self, groups: List[dict]) -> List[dict]:
        """Param groups naming every rank's parameters (the saved object is written by one rank,
        and a PP stage or DP shard holds only some). The names never change during a run: they are
        gathered once per optimizer."""
        cached = getattr(self.optimizer, "_ckpt_plugins_group_names", None)
        if cached is None:
            mine = [(tuple(g.get(k) for k in _GROUP_KIND), g["params"]) for g in groups]
            everyone = [mine]
            if dist.is_initialized() and dist.get_world_size() > 1:
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, mine)
            cached = {}
            for rank_groups in everyone:
                for kind, names in rank_groups:
                    cached.setdefault(kind, {}).update(dict.fromkeys(names))  # ordered union
            self.optimizer._ckpt_plugins_group_names = cached
        return [{**g, "params": list(cached[tuple(g.get(k) for k in _GROUP_KIND)])} for g in groups]

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        handler, masters = self._parts()
        items = handler.load_items(prefix, metadata) if self.optimizer_state else Ignore().load_items(prefix, metadata)
        for frag in self._master_fragments(masters, prefix):
            name = frag.key[len(prefix) + 1:-len(MASTER) - 1]
            frag.sources, frag.cast = (f"{MODEL}/{name}",), True
            items.fragments.append(frag)
        return items


def hf_config_json(model, vocab_size: Optional[int] = None, family: Optional[str] = None) -> Optional[str]:
    """The config.json `transformers` would write for this Megatron model (first chunk's config;
    every chunk shares it): save it as the `hf_config` object and `bcp export` writes it out.
    None for a model with no HF family (a hybrid with Mamba layers)."""
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(_chunks(model)[0])
    cfg, dims = gpt.config, model_dims(gpt, vocab_size, family)
    if dims.family == OWN_NAMES.name:
        return None
    pattern = getattr(gpt, "hybrid_layer_pattern", None)
    moe = hybrid_pairs(pattern) if pattern is not None else moe_layers(cfg.moe_layer_freq, cfg.num_layers)
    mla = {}
    if dims.mla:
        mla = dict(q_lora_rank=cfg.q_lora_rank or 0, kv_lora_rank=cfg.kv_lora_rank, qk_nope_dim=cfg.qk_head_dim,
                   qk_rope_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim)
    m = ModelConfig(dims=dims, layers=len(moe), norm_eps=cfg.layernorm_epsilon,
                    rope_theta=float(getattr(gpt, "rotary_base", 10000)), max_positions=gpt.max_sequence_length,
                    dtype=str(cfg.params_dtype).replace("torch.", ""), topk=cfg.moe_router_topk or 0,
                    dense_layers=tuple(i for i, m in enumerate(moe) if not m) if dims.experts else (),
                    norm_topk=not cfg.moe_router_pre_softmax,
                    routed_scaling=float(cfg.moe_router_topk_scaling_factor or 1.0), **mla)
    return json.dumps(hf_config(m), indent=2)
