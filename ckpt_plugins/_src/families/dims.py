"""A decoder model's sizes, as every framework's layout and the HF config.json describe them."""
from __future__ import annotations

from dataclasses import dataclass


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
    family: str = "llama"
    experts: int = 0      # routed experts (0: a dense model)
    moe_ffn: int = 0      # a routed expert's intermediate size
    shared_ffn: int = 0   # the shared experts' intermediate size
    mla: bool = False     # multi-latent attention (its projections are plain TP splits)
    mamba_heads: int = 0  # Mamba mixers: heads, head size, B/C groups, state size
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
