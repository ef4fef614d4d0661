"""The HF model families whose canonical (safetensors) names every framework's layout maps onto."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Family:
    """How one HF family names its MoE block's tensors in its safetensors files, the names that
    Megatron's layouts and transformers' in-memory (fused) experts are mapped to. None: no HF
    counterpart (such a tensor keeps its framework's name)."""
    name: str
    moe_block: str = "mlp"
    experts: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    shared: Optional[str] = None          # the shared expert's module
    shared_gate: Optional[str] = None     # the shared expert's sigmoid gate
    expert_bias: Optional[str] = None     # the aux-loss-free router bias, under the MoE block


FAMILIES: Dict[str, Family] = {f.name: f for f in (
    Family("llama"), Family("qwen2"), Family("qwen3"), Family("qwen3_moe"),
    Family("mixtral", moe_block="block_sparse_moe", experts=("w1", "w3", "w2")),
    Family("qwen2_moe", shared="shared_expert", shared_gate="shared_expert_gate"),
    Family("deepseek_v3", shared="shared_experts", expert_bias="gate.e_score_correction_bias"),
)}
