"""torchtitan's own parameter names (its Llama 3, Qwen3 and DeepSeek-V3 models, before and after
its fused-QKV renaming) as the HF family names, as its state-dict adapters map them: pure
functions, given to the core's DCP reader (entry point `ckpt_plugins.dcp_names`).

Stacked routed experts ([E, F, D] `w1_EFD`/`w3_EFD`, [E, D, F] `w2_EDF`) are per-expert HF tensors
along their first axis. Llama 3's adapter permutes the q/k rows of each attention head (Meta's
rotary layout to HF's), so the reader undoes that; Qwen3's and DeepSeek-V3's do not permute.
"""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

from ckpt_plugins.ext import DcpNaming

_L = r"layers\.(\d+)\."
_NAMES: List[Tuple[str, str]] = [  # (torchtitan regex, HF name; {0} the layer)
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"(?:output|lm_head)\.weight", "lm_head.weight"),
    (_L + r"attention\.(?:qkv_linear\.)?wq\.weight", "model.layers.{0}.self_attn.q_proj.weight"),
    (_L + r"attention\.(?:qkv_linear\.)?wk\.weight", "model.layers.{0}.self_attn.k_proj.weight"),
    (_L + r"attention\.(?:qkv_linear\.)?wv\.weight", "model.layers.{0}.self_attn.v_proj.weight"),
    (_L + r"attention\.wo\.weight", "model.layers.{0}.self_attn.o_proj.weight"),
    (_L + r"attention\.q_norm\.weight", "model.layers.{0}.self_attn.q_norm.weight"),  # Qwen3
    (_L + r"attention\.k_norm\.weight", "model.layers.{0}.self_attn.k_norm.weight"),
    (_L + r"attention\.wq_a\.weight", "model.layers.{0}.self_attn.q_a_proj.weight"),  # DeepSeek-V3 MLA
    (_L + r"attention\.wq_b\.weight", "model.layers.{0}.self_attn.q_b_proj.weight"),
    (_L + r"attention\.wkv_a\.weight", "model.layers.{0}.self_attn.kv_a_proj_with_mqa.weight"),
    (_L + r"attention\.kv_norm\.weight", "model.layers.{0}.self_attn.kv_a_layernorm.weight"),
    (_L + r"attention\.wkv_b\.weight", "model.layers.{0}.self_attn.kv_b_proj.weight"),
    (_L + r"(?:feed_forward|mlp)\.w1\.weight", "model.layers.{0}.mlp.gate_proj.weight"),
    (_L + r"(?:feed_forward|mlp)\.w3\.weight", "model.layers.{0}.mlp.up_proj.weight"),
    (_L + r"(?:feed_forward|mlp)\.w2\.weight", "model.layers.{0}.mlp.down_proj.weight"),
    (_L + r"attention_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (_L + r"ffn_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (_L + r"(?:moe|mlp)\.router\.gate\.weight", "model.layers.{0}.mlp.gate.weight"),
    (_L + r"moe\.expert_bias(?:_E)?", "model.layers.{0}.mlp.gate.e_score_correction_bias"),
    (_L + r"moe\.shared_experts\.w1\.weight", "model.layers.{0}.mlp.shared_experts.gate_proj.weight"),
    (_L + r"moe\.shared_experts\.w3\.weight", "model.layers.{0}.mlp.shared_experts.up_proj.weight"),
    (_L + r"moe\.shared_experts\.w2\.weight", "model.layers.{0}.mlp.shared_experts.down_proj.weight"),
]
_STACKED: List[Tuple[str, str]] = [  # (regex, HF name; {0} the layer, {1} the expert)
    (_L + r"(?:moe\.routed_experts\.inner_experts\.w1_EFD|(?:moe|mlp)\.experts\.w1)",
     "model.layers.{0}.mlp.experts.{1}.gate_proj.weight"),
    (_L + r"(?:moe\.routed_experts\.inner_experts\.w3_EFD|(?:moe|mlp)\.experts\.w3)",
     "model.layers.{0}.mlp.experts.{1}.up_proj.weight"),
    (_L + r"(?:moe\.routed_experts\.inner_experts\.w2_EDF|(?:moe|mlp)\.experts\.w2)",
     "model.layers.{0}.mlp.experts.{1}.down_proj.weight"),
]
_COMPILED = [(re.compile(p), n) for p, n in _NAMES]
_COMPILED_STACKED = [(re.compile(p), n) for p, n in _STACKED]


def is_torchtitan(names) -> bool:
    """Whether model tensor names are torchtitan's (its embedding and attention names)."""
    return any(n == "tok_embeddings.weight" or re.match(_L + r"attention\.", n) for n in names)


def hf_name(name: str) -> Optional[str]:
    """The HF name of a torchtitan tensor that is not stacked; None when it has none."""
    for pattern, template in _COMPILED:
        m = pattern.fullmatch(name)
        if m:
            return template.format(*m.groups())
    return None


def stacked_hf_name(name: str) -> Optional[str]:
    """For stacked experts: the HF name with `{}` where the expert index goes; else None."""
    for pattern, template in _COMPILED_STACKED:
        m = pattern.fullmatch(name)
        if m:
            return template.format(m.group(1), "{}")
    return None


def rotary_permuted(hf_names) -> bool:
    """Llama 3 (no q/k norms, no MLA) is stored with its q/k rows in Meta's rotary order."""
    names = set(hf_names)
    return not any(".q_norm." in n or ".kv_a_proj_with_mqa." in n or ".q_a_proj." in n for n in names)


NAMING = DcpNaming("torchtitan", is_torchtitan, hf_name, stacked_hf_name, rotary_permuted)
