"""Model-family mappings every extension shares: pure functions over names, shapes and configs (no
framework imported), unit-tested without processes.

- `family`: each HF family's MoE names in its safetensors files; `ModelMapping`, the registry the
  extensions fill with what they know of their framework's models.
- `dims`: a model's dimensions.
- `segments`: a local tensor's sub-boxes and where they sit in canonical tensors; the fragments
  (views) they cut it into.
- `hf_config`: the HF families' `config.json` ↔ model dimensions.

Framework layouts live in their extension: Megatron's in `megatron_ext.family`, transformers' fused
experts in `hf_ext.fused_experts`, PEFT's names in `hf_ext.peft_names`.
"""
