"""hf_ext: HuggingFace-side training through ckpt_plugins.

- FSDP1 models save and load from their flat shards (importing this package registers the
  handler); FSDP2 and DDP go through the core's DTensor and replicated handlers as they are.
- `hf_ext.trainer`: the Trainer integration; `hf_ext.accelerate`: save/load for accelerate loops;
  `hf_ext.safetensors_io`: export to and import from HF model directories.
"""
from . import fsdp1  # noqa: F401  (registers the FSDP1 handler)
from .fsdp1 import FSDP1ModuleHandler

__all__ = ["FSDP1ModuleHandler"]
