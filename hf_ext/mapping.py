"""How models of the HF libraries are stored (`ckpt_plugins.ext.register_model_mapping`): a PEFT
model's base under the base model's names and its adapters under theirs, with each adapter's
config beside them; transformers' fused MoE experts as the per-expert tensors their files name.
Registered when hf_ext is imported, and through the `ckpt_plugins.model_mappings` entry point for
every installed job (a DeepSpeed run of a transformers model included)."""
from __future__ import annotations

import functools
import json
from typing import Any, Dict, Optional

from ckpt_plugins.ext import ModelMapping, TensorMap

from .fused_experts import FUSED, expert_segments
from .peft_names import config_key, peft_segments


def is_peft_model(module: Any) -> bool:
    """A PEFT `PeftModel` (or a wrapper forwarding to one), by what it has rather than its class."""
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def adapter_configs(module: Any, prefix: str) -> Dict[str, str]:
    """A PEFT model's adapter configs (JSON, as PEFT writes `adapter_config.json`), by stored key;
    what `bcp export --format peft` and `--merge-adapters` need. A load keeps the live model's own."""
    out = {}
    for name, config in module.peft_config.items():
        values = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
        out[f"{prefix}/{config_key(name)}"] = json.dumps(values, default=str)
    return out


def model_mapping(module: Any) -> Optional[ModelMapping]:
    peft = is_peft_model(module)
    base = module.get_base_model() if peft else module
    family = getattr(getattr(base, "config", None), "model_type", None)
    if peft:
        return ModelMapping(TensorMap(functools.partial(peft_segments, family)),
                            functools.partial(adapter_configs, module))
    if family in FUSED:
        return ModelMapping(TensorMap(functools.partial(expert_segments, family)))
    return None
