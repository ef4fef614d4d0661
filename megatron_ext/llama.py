"""Megatron GPT parameter names and TP-local layouts ↔ HF Llama canonical tensors (pure functions).

A TP-local Megatron tensor is cut into `Segment`s: a sub-box of the local tensor and where it sits
in a canonical HF tensor. Fused tensors give several (`linear_qkv` one q/k/v triple per query
group, SwiGLU `linear_fc1` a gate and an up block); a TP-split tensor gives one box offset by the
TP rank; padded-vocabulary rows give a segment with no name (never stored, zeroed on load).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

Shape = Tuple[int, ...]
Box = Tuple[Shape, Shape]  # (offsets, lengths)


@dataclass(frozen=True)
class Dims:
    """The global model's sizes (TransformerConfig and the real, unpadded vocabulary)."""
    hidden: int
    ffn: int
    heads: int
    groups: int  # query groups (= kv heads)
    head_dim: int
    vocab: int
    tied: bool = False
    gated: bool = True


@dataclass(frozen=True)
class Segment:
    """Local sub-box `local` of a TP-local tensor is the box at `offsets` of canonical `name`
    (global `shape`). `name` None: padding, stored nowhere."""
    name: Optional[str]
    shape: Shape
    local: Box
    offsets: Shape


class UnmappedParameter(ValueError):
    """A Megatron parameter with no HF Llama counterpart."""


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {  # local spec names and the TE spec's fused-norm names
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"decoder.final_layernorm.weight": "model.norm.weight",
              "embedding.word_embeddings.weight": "model.embed_tokens.weight"}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def _rows(local_shape: Shape, n: int) -> Shape:
    return (n,) + tuple(local_shape[1:])


def _at(local_shape: Shape, start: int) -> Shape:
    return (start,) + (0,) * (len(local_shape) - 1)


def hf_segments(name: str, local_shape: Shape, dims: Dims, tp_rank: int = 0, tp_size: int = 1,
                partition_dim: Optional[int] = None) -> List[Segment]:
    """The segments of Megatron parameter `name` (global layer numbers) as held by TP rank
    `tp_rank`: `partition_dim` is the dimension TP splits (None: replicated over TP)."""
    local_shape = tuple(int(s) for s in local_shape)
    layer = _LAYER.fullmatch(name)
    if layer:
        prefix, rest = f"model.layers.{layer.group(1)}.", layer.group(2)
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            return _qkv(prefix, rest.rsplit(".", 1)[1], local_shape, dims, tp_rank, tp_size)
        if rest == "mlp.linear_fc1.weight":
            return _fc1(prefix, local_shape, dims, tp_rank, tp_size)
        if rest in _LAYER_NAMES:
            return [_split(prefix + _LAYER_NAMES[rest], local_shape, tp_rank, tp_size, partition_dim)]
    elif name in _VOCAB:
        target = "model.embed_tokens.weight" if name == _VOCAB[0] or dims.tied else "lm_head.weight"
        return _vocab(target, local_shape, dims, tp_rank, tp_size)
    elif name in _TOP_NAMES:
        return [_split(_TOP_NAMES[name], local_shape, tp_rank, tp_size, partition_dim)]
    raise UnmappedParameter(f"megatron_ext cannot map Megatron parameter {name!r} to an HF Llama name "
                            "(supported: GPT with RMSNorm, SwiGLU, RoPE, no biases except q/k/v)")


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


def _fc1(prefix: str, local_shape: Shape, dims: Dims, tp_rank: int, tp_size: int) -> List[Segment]:
    """SwiGLU: each TP rank holds its gate rows, then its up rows."""
    if not dims.gated:
        raise UnmappedParameter("linear_fc1 without a gated linear unit has no HF Llama counterpart")
    n = local_shape[0] // 2
    if 2 * n * tp_size != 2 * dims.ffn:
        raise ValueError(f"linear_fc1 has {local_shape[0]} rows on a TP rank; expected 2 * {dims.ffn} / {tp_size}")
    shape = (dims.ffn,) + tuple(local_shape[1:])
    return [Segment(f"{prefix}mlp.{proj}_proj.weight", shape, (_at(local_shape, first), _rows(local_shape, n)),
                    _at(local_shape, tp_rank * n))
            for proj, first in (("gate", 0), ("up", n))]


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
