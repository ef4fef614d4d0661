"""megatron-core GPT models and optimizers as fragments under HF Llama canonical names.

Every rank describes what it holds, from Megatron's own bookkeeping, as views; nothing is gathered:
- weights (`model/<hf name>`) in the training dtype: each TP-local tensor cut into segments
  (llama.hf_segments); DP replicas hold the same boxes, which the save plan writes once;
- optimizer state (`optim/<hf name>/exp_avg`, ...) and, when training in bf16, fp32 masters
  (`optim/<hf name>/master`): per main parameter the optimizer steps. The distributed optimizer's
  main parameter is elements [start, end) of the flattened TP-local parameter, cut at an arbitrary
  position: its flat-range boxes are intersected with the segments.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ckpt_plugins.format import Metadata
from ckpt_plugins.fragment import Fragment, flat_views, intersect, sub_view
from ckpt_plugins.state import (MASTER, MODEL, Handler, Ignore, LoadItems, OptimizerHandler, ParamLayout,
                                SaveItems, add_master_sources)

from .llama import Dims, Segment, hf_segments


def _pieces(segments: Sequence[Segment], local_shape, tensor: torch.Tensor,
            start: Optional[int]) -> Iterator[Tuple[Segment, torch.Tensor, Tuple[int, ...]]]:
    """(segment, view, offsets in the segment's tensor) for every part of `tensor` in a segment.
    `tensor` is shaped like the local parameter, or (start given) 1-D: its elements [start, ...)."""
    if start is None:
        boxes = [((0,) * len(local_shape), tuple(local_shape), tensor)]
    else:
        boxes = [(offsets, lengths, tensor[begin:begin + math.prod(lengths)].view(lengths))
                 for (offsets, lengths), begin in flat_views(local_shape, start, tensor.numel())]
    for seg in segments:
        for offsets, lengths, view in boxes:
            inter = intersect((offsets, lengths), seg.local)
            if inter is not None:
                at = tuple(o + (i - l) for o, i, l in zip(seg.offsets, inter[0], seg.local[0]))
                yield seg, sub_view(view, offsets, inter), at


def segment_fragments(segments: Sequence[Segment], local_shape, tensor: torch.Tensor,
                      key_of: Callable[[str], str], start: Optional[int] = None) -> List[Fragment]:
    return [Fragment(key_of(seg.name), seg.shape, view.dtype, at, view)
            for seg, view, at in _pieces(segments, local_shape, tensor, start) if seg.name is not None]


def zero_padding(segments: Sequence[Segment], local_shape, tensor: torch.Tensor, start: Optional[int] = None) -> None:
    """Padding (padded vocabulary rows) is never stored: a load leaves it zero."""
    for seg, view, _ in _pieces(segments, local_shape, tensor, start):
        if seg.name is None:
            view.zero_()


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


class GPTLayout:
    """Each local parameter's global Megatron name and segments, over all model chunks."""

    def __init__(self, model, vocab_size: Optional[int] = None):
        from megatron.core import parallel_state as ps
        from megatron.core.utils import unwrap_model

        tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.params: List[Tuple[torch.nn.Parameter, str, List[Segment]]] = []
        self.low_precision = False
        for chunk in _chunks(model):
            gpt = unwrap_model(chunk)
            cfg = gpt.config
            dims = Dims(hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size, heads=cfg.num_attention_heads,
                        groups=cfg.num_query_groups or cfg.num_attention_heads, head_dim=cfg.kv_channels,
                        vocab=vocab_size or gpt.vocab_size, tied=gpt.share_embeddings_and_output_weights,
                        gated=cfg.gated_linear_unit)
            self.low_precision |= bool(cfg.bf16 or cfg.fp16)
            for local, p in gpt.named_parameters():
                name = _global_name(gpt, local)
                dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
                self.params.append((p, name, hf_segments(name, tuple(p.shape), dims, tp_rank, tp_size, dim)))
        self.by_id = {id(p): (name, segs) for p, name, segs in self.params}

    def names(self, param) -> Tuple[Tuple[str, ...], Tuple[Tuple[int, ...], ...]]:
        segs = self.by_id[id(param)][1]
        named = {s.name: s.shape for s in segs if s.name is not None}
        return tuple(named), tuple(named.values())

    def weight_fragments(self, prefix: str) -> List[Fragment]:
        return [f for p, _, segs in self.params
                for f in segment_fragments(segs, p.shape, p.detach(), lambda n: f"{prefix}/{n}")]

    def main_layout(self, param, start: Optional[int]) -> ParamLayout:
        """The layout of an optimizer's main parameter for `param`: the whole local parameter
        (start None) or its flattened elements [start, start + numel)."""
        segs, shape = self.by_id[id(param)][1], tuple(param.shape)
        names, shapes = self.names(param)
        return ParamLayout(names, shapes, lambda t, key_of: segment_fragments(segs, shape, t, key_of, start))


def _global_name(gpt, local: str) -> str:
    """`decoder.layers.<i>.…` with the global layer index (layer_number is global and 1-based)."""
    parts = local.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(gpt.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


class MegatronModel(Handler):
    """The weights of a (list of) Megatron model chunk(s), DDP / Float16Module wrapped or not.
    `vocab_size`: the real vocabulary when the model's is padded (rows past it are not stored)."""

    def __init__(self, model, vocab_size: Optional[int] = None):
        self.model, self.vocab_size = model, vocab_size

    def save_items(self, prefix: str) -> SaveItems:
        return SaveItems(fragments=GPTLayout(self.model, self.vocab_size).weight_fragments(prefix))

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        layout = GPTLayout(self.model, self.vocab_size)
        frags = add_master_sources(prefix, layout.weight_fragments(prefix))
        for frag in frags:  # bf16 weights are a rounding of the fp32 masters: any stored copy will do
            frag.cast = layout.low_precision

        def pad() -> None:
            with torch.no_grad():
                for p, _, segs in layout.params:
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
_GROUP_KIND = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "default_config")


class MegatronOptimizer(Handler):
    """Optimizer state and fp32 masters of Megatron's optimizers (distributed or not, fp32 or
    bf16), per canonical parameter, through the core's OptimizerHandler. With
    `optimizer_state=False` a load fills the masters only (from the weights) and accepts the rest."""

    def __init__(self, optimizer, model, vocab_size: Optional[int] = None, optimizer_state: bool = True):
        inners = _inner_optimizers(optimizer)
        if len(inners) != 1:
            raise NotImplementedError("megatron_ext handles one chained optimizer (dense models); got "
                                      f"{len(inners)}")
        self.optimizer, self.inner = optimizer, inners[0]
        self.layout = GPTLayout(model, vocab_size)
        self.optimizer_state = optimizer_state

    def _parts(self):
        mains = main_params(self.inner)
        layouts = {id(m): self.layout.main_layout(p, start) for p, m, start in mains}
        masters = [(m, layouts[id(m)]) for p, m, _ in mains if m.dtype != p.dtype]
        return OptimizerHandler(self.inner.optimizer, layouts), masters

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
        cached = getattr(self.inner, "_ckpt_plugins_group_names", None)
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
            self.inner._ckpt_plugins_group_names = cached
        return [{**g, "params": list(cached[tuple(g.get(k) for k in _GROUP_KIND)])} for g in groups]

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        handler, masters = self._parts()
        items = handler.load_items(prefix, metadata) if self.optimizer_state else Ignore().load_items(prefix, metadata)
        for frag in self._master_fragments(masters, prefix):
            name = frag.key[len(prefix) + 1:-len(MASTER) - 1]
            frag.sources, frag.cast = (f"{MODEL}/{name}",), True
            items.fragments.append(frag)
        return items
