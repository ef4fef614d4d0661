"""megatron_ext: megatron-core GPT models (dense and MoE; TP, PP, DP, EP, expert-TP, distributed
optimizer) through ckpt_plugins, stored under the HF family's canonical names. See README,
"Megatron-core" and "MoE and model families"."""
from .gpt import MegatronModel, MegatronOptimizer, hf_config_json

__all__ = ["MegatronModel", "MegatronOptimizer", "hf_config_json"]
