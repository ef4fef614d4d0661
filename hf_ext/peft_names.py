"""PEFT's wrapped names ↔ the base model's canonical names and the adapters' own (pure functions).

PEFT wraps a model (`base_model.model.` before every name) and each adapted layer: its frozen
weight becomes `<layer>.base_layer.weight`, a `modules_to_save` layer's original
`<layer>.original_module.weight`, and every adapter adds tensors named by kind and adapter. The
base is stored under the base model's canonical names, so any base checkpoint loads into a PEFT
model and a PEFT run's base loads anywhere; adapter tensors under
`adapter/<adapter name>/<the base tensor they adapt>/<kind>`:
- LoRA `lora_A`, `lora_B` (`<layer>.weight`; LoRA biases adapt `<layer>.bias`), embeddings'
  `lora_embedding_A`/`lora_embedding_B`;
- DoRA's `lora_magnitude_vector`;
- a `modules_to_save` copy, `modules_to_save`.
"""
from __future__ import annotations

import functools
import re
from typing import Optional, Tuple

from ckpt_plugins.ext import Segment, whole

from .fused_experts import expert_segments

ADAPTER = "adapter"
PREFIX = "base_model.model."
_KINDS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "modules_to_save")
_ADAPTED = re.compile(rf"(.+)\.({'|'.join(_KINDS)})\.([^.]+)(?:\.(\w+))?")
_BASE = re.compile(r"\.(base_layer|original_module)(?=\.)")


def stored_name(name: str) -> str:
    """Where PEFT model tensor `name` is stored."""
    if name.startswith(PREFIX):
        name = name[len(PREFIX):]
    adapted = _ADAPTED.fullmatch(name)
    if adapted:
        layer, kind, adapter, param = adapted.groups()
        return f"{ADAPTER}/{adapter}/{_BASE.sub('', layer)}.{param or 'weight'}/{kind}"
    return _BASE.sub("", name)


def is_adapter(name: str) -> bool:
    return name.startswith(ADAPTER + "/")


@functools.lru_cache(maxsize=None)
def peft_segments(family: Optional[str], name: str, shape: Tuple[int, ...]) -> Optional[Tuple[Segment, ...]]:
    """The canonical tensors of PEFT model tensor `name`: an adapter's under its adapter name, a base
    tensor as the base model's own map says (fused experts per expert)."""
    stored = stored_name(name)
    if is_adapter(stored):
        return whole(stored, shape)
    return expert_segments(family, stored, shape) or whole(stored, shape)


def adapted_weight(stored: str) -> Tuple[str, str, str]:
    """(adapter name, base tensor name, kind) of a stored adapter tensor name."""
    _, adapter, rest = stored.split("/", 2)
    weight, _, kind = rest.rpartition("/")
    return adapter, weight, kind


_FILE_KIND = re.compile(rf"(.+)\.({'|'.join(k for k in _KINDS if k != 'modules_to_save')})(?:\.(\w+))?")


def config_key(adapter: str) -> str:
    """Where an adapter's PEFT config (JSON) is stored, beside its tensors."""
    return f"{ADAPTER}/{adapter}/config"


def file_name(stored: str) -> str:
    """The name PEFT's `adapter_model.safetensors` gives stored adapter tensor `stored`."""
    _, weight, kind = adapted_weight(stored)
    if kind == "modules_to_save":
        return PREFIX + weight
    layer, _, param = weight.rpartition(".")
    if kind in ("lora_A", "lora_B"):
        return f"{PREFIX}{layer}.{kind}.{param}"
    return f"{PREFIX}{layer}.{kind}"


def from_file_name(name: str, adapter: str, modules_to_save) -> str:
    """The stored name of tensor `name` of a PEFT adapter file (`adapter`: its adapter name;
    `modules_to_save`: its config's list): an adapter tensor, or a base tensor the file carries."""
    bare = name[len(PREFIX):] if name.startswith(PREFIX) else name
    found = _FILE_KIND.fullmatch(bare)
    if found:
        layer, kind, param = found.groups()
        return f"{ADAPTER}/{adapter}/{_BASE.sub('', layer)}.{param or 'weight'}/{kind}"
    layer = bare.rpartition(".")[0]
    if any(layer == m or layer.endswith("." + m) for m in modules_to_save or ()):
        return f"{ADAPTER}/{adapter}/{bare}/modules_to_save"
    return _BASE.sub("", bare)
