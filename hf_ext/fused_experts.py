"""transformers' in-memory MoE layout ↔ the per-expert safetensors names (pure functions).

transformers 5 holds a MoE block's routed experts as two fused parameters, while its files (and
every other framework here) name each expert's projections separately:
- `<layer>.mlp.experts.gate_up_proj` [E, 2·I, H]: expert e's gate rows, then its up rows;
- `<layer>.mlp.experts.down_proj` [E, H, I]: expert e's down projection.
Expert e's gate is the box ((e, 0, 0), (1, I, H)) of gate_up_proj seen without its expert
dimension, so every framework's shard of a fused tensor (an FSDP2 row block, an FSDP1 or ZeRO flat
range) is cut into views of per-expert tensors: nothing is gathered or copied.

Mixtral's files also call the block `block_sparse_moe` (its router too) and the projections
w1/w3/w2. Families whose fused layout is not such a box (interleaved gate/up columns, experts
stored input-major) are not listed in `FUSED` and keep their in-memory names.
"""
from __future__ import annotations

import functools
import re
from typing import Optional, Tuple

from ckpt_plugins.ext import FAMILIES, Segment, whole

# model_type -> whether transformers fuses its experts as above (gate rows, then up rows, per expert)
FUSED = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")

_MOE = re.compile(r"((?:.*\.)?layers\.(\d+)\.)mlp\.(.+)")


@functools.lru_cache(maxsize=None)
def expert_segments(family: Optional[str], name: str, shape: Tuple[int, ...]) -> Optional[Tuple[Segment, ...]]:
    """The per-expert canonical tensors that transformers' in-memory tensor `name` (of global
    `shape`) is made of, as segments of the whole tensor; None when it is stored under its own
    name (a dense family, a tensor outside the MoE block)."""
    if family not in FUSED:
        return None
    match = _MOE.fullmatch(name)
    if match is None:
        return None
    fam = FAMILIES[family]
    layer, rest = match.group(1), match.group(3)
    block = f"{layer}{fam.moe_block}."
    gate, up, down = (f"{block}experts.{{}}.{p}.weight" for p in fam.experts)
    if rest == "experts.gate_up_proj" and len(shape) == 3 and shape[1] % 2 == 0:
        experts, rows, cols = shape
        half = rows // 2
        return tuple(Segment(pattern.format(e), (half, cols), ((e, first, 0), (1, half, cols)), (0, 0), axes=(1, 2))
                     for e in range(experts) for pattern, first in ((gate, 0), (up, half)))
    if rest == "experts.down_proj" and len(shape) == 3:
        experts, rows, cols = shape
        return tuple(Segment(down.format(e), (rows, cols), ((e, 0, 0), (1, rows, cols)), (0, 0), axes=(1, 2))
                     for e in range(experts))
    if fam.moe_block != "mlp" and not rest.startswith("experts."):  # Mixtral's router: another block name
        return whole(block + rest, shape)
    return None
