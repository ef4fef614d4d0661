"""DeepSpeed AutoEP's grouped local experts ↔ the per-expert canonical names (pure functions).

AutoEP (the `expert_parallel` config section) replaces a transformers MoE block by its own layer:
- `experts.w1`/`w3` [E_local, I, H] (gate/up) and `experts.w2` [E_local, H, I] (down), EP rank r
  holding experts r·E_local … (r+1)·E_local − 1 (deepspeed.moe.ep_repack.repack_expert_weights):
  local expert i of w1 is global expert e's gate, the box ((i, 0, 0), (1, I, H));
- the router as `router.gate` (also reachable as `gate.gate`, an alias of the router module), the
  score-correction bias on the router, the shared experts as `shared_experts`/`shared_experts_gate`.
Each is mapped to the family's safetensors names, so an AutoEP job's checkpoint is the same as any
other framework's and loads at any EP size.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ckpt_plugins.ext import FAMILIES, Segment, canonical_name, whole

_LAYER = re.compile(r"((?:.*\.)?layers\.\d+\.)mlp\.(.+)")
_ROUTER = {"router.gate.weight": "gate.weight", "gate.gate.weight": "gate.weight",
           "router.e_score_correction_bias": "gate.e_score_correction_bias"}


@dataclass(frozen=True)
class Placement:
    """One AutoEP layer's experts: this rank's EP rank and the EP size, all experts."""
    ep_rank: int
    ep_size: int
    experts: int


@functools.lru_cache(maxsize=None)
def autoep_segments(family: Optional[str], placements: Tuple[Tuple[str, Placement], ...],
                    others: Callable[[str, Tuple[int, ...]], Optional[Tuple[Segment, ...]]], name: str,
                    shape: Tuple[int, ...]) -> Optional[Tuple[Segment, ...]]:
    """The canonical tensors of AutoEP tensor `name` (local `shape`); `placements`: (layer prefix
    such as `model.layers.3.`, its Placement) for every replaced layer. Other tensors: as `others`
    (the model's own map) says."""
    match = _LAYER.fullmatch(name)
    placement = dict(placements).get(match.group(1)) if match else None
    if placement is None or family not in FAMILIES:
        return others(name, shape)
    fam = FAMILIES[family]
    block, rest = f"{match.group(1)}{fam.moe_block}.", match.group(2)
    projections = dict(zip(("experts.w1", "experts.w3", "experts.w2"), fam.experts))
    if rest in projections and len(shape) == 3:
        local = placement.experts // placement.ep_size
        if shape[0] != local:
            raise ValueError(f"{name}: {shape[0]} local experts, expected {placement.experts} / EP {placement.ep_size}")
        first = placement.ep_rank * local
        return tuple(Segment(f"{block}experts.{first + i}.{projections[rest]}.weight", shape[1:],
                             ((i, 0, 0), (1,) + shape[1:]), (0, 0), axes=(1, 2)) for i in range(local))
    if rest in _ROUTER:
        return whole(block + _ROUTER[rest], shape)
    if rest.startswith("shared_experts_gate.") and fam.shared_gate:
        return whole(f"{block}{fam.shared_gate}.{rest.split('.', 1)[1]}", shape)
    if rest.startswith("shared_experts.") and fam.shared:
        return whole(f"{block}{fam.shared}.{rest.split('.', 1)[1]}", shape)
    return None


def placements(modules) -> Tuple[Tuple[str, Placement], ...]:
    """Every AutoEP layer among `modules` (a model's `named_modules()`), by its layer prefix
    (empty: AutoEP is not in use)."""
    out: Dict[str, Placement] = {}
    for name, sub in modules:
        if hasattr(sub, "ep_rank") and hasattr(sub, "num_local_experts") and name.endswith(".mlp"):
            out[canonical_name(name)[:-len("mlp")]] = Placement(sub.ep_rank, sub.ep_size, sub.num_experts)
    return tuple(sorted(out.items()))
