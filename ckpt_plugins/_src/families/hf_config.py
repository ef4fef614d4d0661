"""The HF families' `config.json` ↔ a model's sizes (pure functions).

A framework describes its model with its own config; its export needs the config.json the HF
library would have written, and an import of a checkpoint without run arguments needs the sizes
back from one. `ModelConfig` is what both directions share.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Tuple

from .family import FAMILIES
from .dims import Dims

# The object holding the model's HF config.json text, when a save knows it: exports write it out.
HF_CONFIG = "hf_config"

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's sizes beyond the tensor mapping's `Dims`."""
    dims: Dims
    layers: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 4096
    dtype: str = "float32"
    topk: int = 0              # experts per token
    dense_layers: Tuple[int, ...] = ()  # a MoE model's dense-MLP layers
    norm_topk: bool = True     # routing weights renormalised over the chosen experts
    routed_scaling: float = 1.0
    q_lora_rank: int = 0       # MLA (DeepSeek-V3)
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0


def hf_config(m: ModelConfig) -> Dict[str, Any]:
    """The config.json `transformers` writes for this family and these sizes."""
    d = m.dims
    if d.family not in _ARCHITECTURES:
        raise ValueError(f"no HF config for family {d.family!r}; known: {', '.join(sorted(_ARCHITECTURES))}")
    out: Dict[str, Any] = {
        "architectures": [_ARCHITECTURES[d.family]], "model_type": d.family, "hidden_size": d.hidden,
        "intermediate_size": d.ffn, "num_hidden_layers": m.layers, "num_attention_heads": d.heads,
        "num_key_value_heads": d.groups, "head_dim": d.head_dim, "vocab_size": d.vocab,
        "tie_word_embeddings": d.tied, "rms_norm_eps": m.norm_eps, "hidden_act": "silu",
        "max_position_embeddings": m.max_positions, "rope_parameters": {"rope_type": "default",
                                                                        "rope_theta": m.rope_theta},
        "dtype": m.dtype, "attention_dropout": 0.0,
    }
    if d.family in ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3"):
        out["attention_bias"] = False
    if m.dense_layers and (d.family == "mixtral" or (d.family == "deepseek_v3"
                                                      and m.dense_layers != tuple(range(len(m.dense_layers))))):
        raise ValueError(f"{d.family} has no dense MLP layers {list(m.dense_layers)} in its config.json "
                         "(DeepSeek-V3: only leading ones); keep the framework's own names instead")
    if d.family in ("qwen3_moe", "qwen2_moe"):
        out.update(num_experts=d.experts, num_experts_per_tok=m.topk, moe_intermediate_size=d.moe_ffn,
                   decoder_sparse_step=1, mlp_only_layers=list(m.dense_layers), norm_topk_prob=m.norm_topk)
        if d.family == "qwen2_moe":
            out["shared_expert_intermediate_size"] = d.shared_ffn
    elif d.family == "mixtral":
        out.update(num_local_experts=d.experts, num_experts_per_tok=m.topk, intermediate_size=d.moe_ffn)
    elif d.family == "deepseek_v3":
        out.update(n_routed_experts=d.experts, num_experts_per_tok=m.topk, moe_intermediate_size=d.moe_ffn,
                   n_shared_experts=d.shared_ffn // d.moe_ffn if d.moe_ffn else 0,
                   first_k_dense_replace=len(m.dense_layers),
                   n_group=1, topk_group=1, routed_scaling_factor=m.routed_scaling, norm_topk_prob=m.norm_topk,
                   q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_dim,
                   qk_rope_head_dim=m.qk_rope_dim, v_head_dim=m.v_head_dim, head_dim=m.qk_rope_dim,
                   rope_interleave=True, num_key_value_heads=d.heads)
    return out


def model_config(config: Dict[str, Any]) -> ModelConfig:
    """The sizes an HF config.json describes (the inverse of `hf_config`)."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"config.json has model_type {family!r}; mapped families: {', '.join(sorted(FAMILIES))}")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    rope = config.get("rope_parameters") or {}
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0
    moe_ffn = config.get("moe_intermediate_size") or (config["intermediate_size"] if family == "mixtral" else 0)
    shared = config.get("shared_expert_intermediate_size") or (config.get("n_shared_experts") or 0) * moe_ffn
    mla = family == "deepseek_v3"
    dims = Dims(hidden=hidden, ffn=config["intermediate_size"], heads=heads,
                groups=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or hidden // heads, vocab=config["vocab_size"],
                tied=bool(config.get("tie_word_embeddings", False)), family=family, experts=experts,
                moe_ffn=moe_ffn if experts else 0, shared_ffn=shared if experts else 0, mla=mla)
    m = ModelConfig(dims=dims, layers=config["num_hidden_layers"], norm_eps=config.get("rms_norm_eps", 1e-6),
                    rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
                    max_positions=config.get("max_position_embeddings", 4096),
                    dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
                    topk=config.get("num_experts_per_tok", 0),
                    dense_layers=tuple(config.get("mlp_only_layers") or range(config.get("first_k_dense_replace", 0))),
                    norm_topk=bool(config.get("norm_topk_prob", family != "qwen2_moe")),
                    routed_scaling=config.get("routed_scaling_factor", 1.0))
    if mla:
        m = replace(m, q_lora_rank=config.get("q_lora_rank") or 0, kv_lora_rank=config["kv_lora_rank"],
                    qk_nope_dim=config["qk_nope_head_dim"], qk_rope_dim=config["qk_rope_head_dim"],
                    v_head_dim=config["v_head_dim"])
    return m
