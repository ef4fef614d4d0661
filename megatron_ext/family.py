"""megatron-core parameter names and TP/EP-local layouts ↔ canonical tensors (pure functions).

A local Megatron tensor is cut into `Segment`s: a sub-box of the local tensor and where it sits in
a canonical tensor.
- Fused tensors give several: `linear_qkv` a q/k/v triple per query group, SwiGLU `linear_fc1` a
  gate and an up block.
- A TP-split tensor gives one box offset by its TP rank (expert tensors: by the expert-TP rank).
- An expert's tensors land in the canonical tensors of its global index `ep_rank * local + i`,
  whatever the expert layout: SequentialMLP (`local_experts.<i>`), TEGroupedMLP
  (`linear_fc1.weight<i>`), or the legacy GroupedMLP (`weight1`/`weight2`, whose expert `i` is
  the transpose of a SequentialMLP expert's tensor: its segments carry a view and axes).
- Padded-vocabulary rows give a segment with no name (never stored, zeroed on load).

The canonical name is the family's HF safetensors name where one exists (`FAMILIES`). Any other
parameter or buffer keeps its Megatron name, with global layer and expert indices and the
TP-merged shape, so it still reshards between Megatron layouts; other frameworks report it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ckpt_plugins.ext import FAMILIES, Dims, Family, Segment, Shape

# A model with no HF counterpart (a hybrid with Mamba layers): every tensor keeps Megatron's name.
OWN_NAMES = Family("megatron")


def family_named(name: str) -> Family:
    """The HF family `name`, or `OWN_NAMES` ("megatron")."""
    if name == OWN_NAMES.name:
        return OWN_NAMES
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES) + [OWN_NAMES.name])}")
    return FAMILIES[name]


@dataclass(frozen=True)
class Ranks:
    """Where a local tensor sits: TP for dense tensors; EP and expert-TP for expert tensors."""
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1


def megatron_family(*, moe: bool, mla: bool, qk_norm: bool, qkv_bias: bool, shared_experts: bool,
                    shared_gate: bool) -> str:
    """The HF family a GPT TransformerConfig's features describe (dense families name their
    tensors alike; MoE ones differ). A plain MoE model without q/k norms is taken for Mixtral:
    pass the family explicitly for another."""
    if mla:
        return "deepseek_v3"
    if moe:
        if shared_gate or (shared_experts and qkv_bias):
            return "qwen2_moe"
        if shared_experts:
            return "deepseek_v3"
        return "qwen3_moe" if qk_norm else "mixtral"
    return "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"


def hybrid_pairs(pattern: str) -> Optional[List[bool]]:
    """For a HybridModel pattern made of attention + MLP/MoE pairs (`*-*E`), whether each pair, the
    GPT/HF layer it forms (hybrid layer i is HF layer i // 2), has a MoE MLP: [False, True]. None
    for any other pattern (Mamba, unpaired layers), whose layers keep Megatron names. Pipeline
    separators `|` and multi-token-prediction sections are not decoder layers."""
    main = pattern.split("/")[0].replace("|", "")
    pairs = len(main) % 2 == 0 and all(a == "*" and b in "-E" for a, b in zip(main[0::2], main[1::2]))
    return [kind == "E" for kind in main[1::2]] if pairs else None


def moe_layers(freq, layers: int) -> List[bool]:
    """Which of a GPT model's layers are MoE, from megatron's `moe_layer_freq` (a list of 0/1 per
    layer, or every freq-th layer)."""
    return [bool(x) for x in freq] if isinstance(freq, list) else [i % freq == 0 for i in range(layers)]


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)"
                     r"|(linear_fc[12])\.(weight|bias)(\d+))")
_GROUPED = re.compile(r"mlp\.experts\.weight([12])")
_ATTENTION = {  # local spec names and the TE spec's fused-norm names
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
_QK_NORM = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}
_MLA = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
_MLP_NORM = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
_MAMBA_FUSED = ("mixer.in_proj.weight", "mixer.conv1d_weight", "mixer.conv1d_bias")
_TOP_NAMES = {"decoder.final_layernorm.weight": "model.norm.weight", "decoder.final_norm.weight": "model.norm.weight",
              "embedding.word_embeddings.weight": "model.embed_tokens.weight"}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def _rows(local_shape: Shape, n: int) -> Shape:
    return (n,) + tuple(local_shape[1:])


def _at(local_shape: Shape, start: int) -> Shape:
    return (start,) + (0,) * (len(local_shape) - 1)


def canonical_segments(name: str, local_shape: Shape, dims: Dims, ranks: Ranks = Ranks(),
                       partition_dim: Optional[int] = None) -> List[Segment]:
    """The segments of Megatron parameter or buffer `name` (global layer numbers, local expert
    numbers) as held at `ranks`: `partition_dim` is the dimension TP (expert-TP for expert
    tensors) splits, None when replicated."""
    local_shape = tuple(int(s) for s in local_shape)
    layer = _LAYER.fullmatch(name)
    if layer:
        found = _layer_segments(layer.group(1), layer.group(2), local_shape, dims, ranks, partition_dim)
        if found is not None:
            return found
    elif name in _VOCAB:
        target = "model.embed_tokens.weight" if name == _VOCAB[0] or dims.tied else "lm_head.weight"
        return _vocab(target, local_shape, dims, ranks.tp_rank, ranks.tp_size)
    elif name in _TOP_NAMES:
        return [_split(_TOP_NAMES[name], local_shape, ranks.tp_rank, ranks.tp_size, partition_dim)]
    return [_split(name, local_shape, ranks.tp_rank, ranks.tp_size, partition_dim)]


def _layer_segments(index: str, rest: str, local_shape: Shape, dims: Dims, ranks: Ranks,
                    dim: Optional[int]) -> Optional[List[Segment]]:
    family = family_named(dims.family)
    if rest in _MAMBA_FUSED:
        return _mamba(f"decoder.layers.{index}.{rest}", local_shape, dims, ranks.tp_rank, ranks.tp_size)
    if family is OWN_NAMES:
        return None
    prefix, block = f"model.layers.{index}.", f"model.layers.{index}.{family.moe_block}."
    tp = (ranks.tp_rank, ranks.tp_size, dim)
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv(prefix, rest.rsplit(".", 1)[1], local_shape, dims, ranks.tp_rank, ranks.tp_size)
    target = (_MLA if dims.mla else _QK_NORM).get(rest) or _ATTENTION.get(rest)
    if target is None and rest in _MLP_NORM:
        target = "post_attention_layernorm.weight"
    if target is not None:
        return [_split(prefix + target, local_shape, *tp)]
    if not dims.experts or rest.startswith("mlp.linear_fc"):  # a dense MLP (layer)
        if rest == "mlp.linear_fc1.weight" and dims.gated:
            return _fc1((prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"), local_shape, dims.ffn,
                        ranks.tp_rank, ranks.tp_size)
        if rest == "mlp.linear_fc2.weight":
            return [_split(prefix + "mlp.down_proj.weight", local_shape, *tp)]
        return None
    if rest == "mlp.router.weight":
        return [_split(block + "gate.weight", local_shape, *tp)]
    if rest == "mlp.router.expert_bias" and family.expert_bias:
        return [_split(block + family.expert_bias, local_shape, *tp)]
    if rest.startswith("mlp.shared_experts.") and family.shared:
        shared = f"{block}{family.shared}."
        if rest == "mlp.shared_experts.linear_fc1.weight" and dims.gated:
            return _fc1((shared + "gate_proj.weight", shared + "up_proj.weight"), local_shape, dims.shared_ffn,
                        ranks.tp_rank, ranks.tp_size)
        if rest == "mlp.shared_experts.linear_fc2.weight":
            return [_split(shared + "down_proj.weight", local_shape, *tp)]
        if rest == "mlp.shared_experts.gate_weight" and family.shared_gate:
            return [_split(f"{block}{family.shared_gate}.weight", local_shape, *tp)]
        return None
    grouped = _GROUPED.fullmatch(rest)
    if grouped:
        return _grouped(index, int(grouped.group(1)), local_shape, dims, ranks, family)
    expert = _EXPERT.fullmatch(rest)
    if expert:
        local, fc, kind = ((int(expert.group(1)), expert.group(2), expert.group(3)) if expert.group(1) is not None
                           else (int(expert.group(6)), expert.group(4), expert.group(5)))
        return _expert(index, local, fc, kind, local_shape, dims, ranks, family, dim)
    return None


def _global_expert(local: int, dims: Dims, ranks: Ranks) -> int:
    if dims.experts % ranks.ep_size:
        raise ValueError(f"{dims.experts} experts do not split over EP {ranks.ep_size}")
    return ranks.ep_rank * (dims.experts // ranks.ep_size) + local


def _expert(index: str, local: int, fc: str, kind: str, local_shape: Shape, dims: Dims, ranks: Ranks,
            family: Family, dim: Optional[int]) -> List[Segment]:
    """Local expert `local`'s fc1/fc2 tensor in layer `index` (SequentialMLP orientation: out × in),
    split over expert-TP."""
    e = _global_expert(local, dims, ranks)
    gate, up, down = (f"model.layers.{index}.{family.moe_block}.experts.{e}.{p}.weight" for p in family.experts)
    if kind == "weight" and fc == "linear_fc1" and dims.gated:
        return _fc1((gate, up), local_shape, dims.moe_ffn, ranks.etp_rank, ranks.etp_size)
    if kind == "weight" and fc == "linear_fc2":
        return [_split(down, local_shape, ranks.etp_rank, ranks.etp_size, 1 if dim is None else dim)]
    return [_split(f"decoder.layers.{index}.mlp.experts.local_experts.{e}.{fc}.{kind}", local_shape,
                   ranks.etp_rank, ranks.etp_size, dim)]


def _grouped(index: str, which: int, local_shape: Shape, dims: Dims, ranks: Ranks,
             family: Family) -> List[Segment]:
    """GroupedMLP: `weight1` [H, local · C] is used as a [local, H, C] view whose expert i is its
    fc1 transposed (C = fc1's rows on this expert-TP rank); `weight2` [local · R, H] as [local, R, H]
    whose expert i is its fc2 transposed. Each SequentialMLP-orientation segment of expert i
    becomes a box of that view with its two dimensions swapped."""
    local_experts = dims.experts // ranks.ep_size
    if local_shape[0 if which == 1 else 1] != dims.hidden:
        raise ValueError(f"GroupedMLP weight{which} of shape {local_shape} does not hold hidden size {dims.hidden}")
    inner = (local_shape[1] if which == 1 else local_shape[0]) // local_experts
    view = (local_experts, dims.hidden, inner) if which == 1 else (local_experts, inner, dims.hidden)
    sequential = (inner, dims.hidden) if which == 1 else (dims.hidden, inner)
    out = []
    for i in range(local_experts):
        for seg in _expert(index, i, f"linear_fc{which}", "weight", sequential, dims, ranks, family, which - 1):
            (r0, c0), (rl, cl) = seg.local
            out.append(Segment(seg.name, seg.shape, ((i, c0, r0), (1, cl, rl)), seg.offsets, view, (2, 1)))
    return out


def _mamba(name: str, local_shape: Shape, dims: Dims, tp_rank: int, tp_size: int) -> List[Segment]:
    """A Mamba mixer's fused TP-split tensors: `in_proj` rows are [z, x, B, C, dt] and the causal
    convolution's channels [x, B, C], each part split over TP on its own (megatron's own
    sharded_state_dict splits in_proj into these parts). Canonical: the TP1 layout, parts whole."""
    d_inner, bc = dims.mamba_heads * dims.mamba_head_dim, dims.mamba_groups * dims.mamba_state
    if not d_inner:
        raise ValueError(f"{name}: the model's Mamba sizes are unknown (Dims.mamba_*)")
    parts = [d_inner, d_inner, bc, bc, dims.mamba_heads] if "in_proj" in name else [d_inner, bc, bc]
    if any(n % tp_size for n in parts):
        raise ValueError(f"{name}: Mamba parts {parts} do not split over TP {tp_size}")
    if local_shape[0] * tp_size != sum(parts):
        raise ValueError(f"{name} has {local_shape[0]} rows on a TP rank; expected {sum(parts)} / {tp_size}")
    shape = (sum(parts),) + tuple(local_shape[1:])
    out, local_at, global_at = [], 0, 0
    for n in parts:
        out.append(Segment(name, shape, (_at(local_shape, local_at), _rows(local_shape, n // tp_size)),
                           _at(local_shape, global_at + tp_rank * n // tp_size)))
        local_at, global_at = local_at + n // tp_size, global_at + n
    return out


def _split(target: str, local_shape: Shape, tp_rank: int, tp_size: int, dim: Optional[int]) -> Segment:
    offsets = [0] * len(local_shape)
    shape = list(local_shape)
    if dim is not None and tp_size > 1:
        offsets[dim] = tp_rank * local_shape[dim]
        shape[dim] *= tp_size
    return Segment(target, tuple(shape), ((0,) * len(local_shape), local_shape), tuple(offsets))


def _qkv(prefix: str, kind: str, local_shape: Shape, dims: Dims, tp_rank: int, tp_size: int) -> List[Segment]:
    """Rows are grouped per query group: [q heads of the group, k, v] × the rank's groups."""
    hd, per_group = dims.head_dim, dims.heads // dims.groups
    if dims.groups % tp_size:
        raise ValueError(f"{dims.groups} query groups do not split over TP {tp_size}")
    local_groups = dims.groups // tp_size
    rows = (per_group + 2) * hd
    if local_shape[0] != local_groups * rows:
        raise ValueError(f"linear_qkv has {local_shape[0]} rows on a TP rank; expected {local_groups} query "
                         f"groups of {rows} ({per_group} query heads + k + v, head dim {hd})")
    tail = tuple(local_shape[1:])
    out = []
    for j in range(local_groups):
        g = tp_rank * local_groups + j
        base = j * rows
        for proj, first, n, at, total in (("q", base, per_group * hd, g * per_group * hd, dims.heads * hd),
                                          ("k", base + per_group * hd, hd, g * hd, dims.groups * hd),
                                          ("v", base + (per_group + 1) * hd, hd, g * hd, dims.groups * hd)):
            out.append(Segment(f"{prefix}self_attn.{proj}_proj.{kind}", (total,) + tail,
                               (_at(local_shape, first), _rows(local_shape, n)), _at(local_shape, at)))
    return out


def _fc1(names: Tuple[str, str], local_shape: Shape, ffn: int, rank: int, size: int) -> List[Segment]:
    """SwiGLU: each (expert-)TP rank holds its gate rows, then its up rows."""
    n = local_shape[0] // 2
    if 2 * n * size != 2 * ffn:
        raise ValueError(f"linear_fc1 has {local_shape[0]} rows on a TP rank; expected 2 * {ffn} / {size}")
    shape = (ffn,) + tuple(local_shape[1:])
    return [Segment(name, shape, (_at(local_shape, first), _rows(local_shape, n)), _at(local_shape, rank * n))
            for name, first in zip(names, (0, n))]


def _vocab(target: str, local_shape: Shape, dims: Dims, tp_rank: int, tp_size: int) -> List[Segment]:
    """Vocabulary rows split over TP; rows past the real vocabulary are padding."""
    per_rank = local_shape[0]
    if per_rank * tp_size < dims.vocab:
        raise ValueError(f"{per_rank} vocabulary rows per TP rank × {tp_size} < the vocabulary ({dims.vocab})")
    first = tp_rank * per_rank
    real = max(0, min(per_rank, dims.vocab - first))
    out = []
    if real:
        out.append(Segment(target, (dims.vocab,) + tuple(local_shape[1:]),
                           (_at(local_shape, 0), _rows(local_shape, real)), _at(local_shape, first)))
    if real < per_rank:
        out.append(Segment(None, local_shape, (_at(local_shape, real), _rows(local_shape, per_rank - real)),
                           _at(local_shape, real)))
    return out
