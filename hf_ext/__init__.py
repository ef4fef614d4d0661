"""hf_ext: HuggingFace-side training through ckpt_plugins.

- FSDP1 models save and load from their flat shards (importing this package registers the
  handler); FSDP2 and DDP go through the core's DTensor and replicated handlers as they are.
- `hf_ext.mapping`: how PEFT models and transformers' fused experts are stored (registered here,
  and found by the core through an entry point in any job).
- `hf_ext.trainer`: the Trainer integration; `hf_ext.accelerate`: save/load for accelerate loops;
  `hf_ext.safetensors_io`: export to and import from HF model directories.
"""
import sys

from ckpt_plugins.ext import register_handler, register_model_mapping

from .mapping import model_mapping


def _has_fsdp1_units(value) -> bool:
    if "torch.distributed.fsdp" not in sys.modules:  # nothing can be wrapped in FSDP1 yet
        return False
    from .fsdp1 import has_fsdp1_units  # imported on first use: torch's FSDP1 costs ~1 s to import
    return has_fsdp1_units(value)


def _fsdp1_handler(value):
    from .fsdp1 import FSDP1ModuleHandler
    return FSDP1ModuleHandler(value)


register_handler(_has_fsdp1_units, _fsdp1_handler)
register_model_mapping(model_mapping)
