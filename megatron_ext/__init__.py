"""megatron_ext: megatron-core GPT models (dense and MoE; TP, PP, DP, EP, expert-TP, distributed
optimizer) through ckpt_plugins, stored under the HF family's canonical names. See docs/guides/megatron.md
and docs/guides/moe.md."""
from .gpt import MegatronModel, MegatronOptimizer, hf_config_json

__all__ = ["MegatronModel", "MegatronOptimizer", "hf_config_json"]
