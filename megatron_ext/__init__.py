"""megatron_ext: megatron-core GPT models (TP, PP, DP, distributed optimizer) through ckpt_plugins,
stored under HF Llama canonical names. See README, "Megatron-core"."""
from .gpt import MegatronModel, MegatronOptimizer
from .llama import Dims, Segment, UnmappedParameter, hf_segments

__all__ = ["MegatronModel", "MegatronOptimizer", "Dims", "Segment", "UnmappedParameter", "hf_segments"]
