"""Model-family mappings shared by the framework extensions: pure functions over names, shapes and
configs (no framework imported), unit-tested without processes.

- `family`: each HF family's MoE names in its safetensors files.
- `segments`: a local tensor's sub-boxes and where they sit in canonical tensors; the fragments
  (views) they cut it into.
- `megatron`: megatron-core parameter names and TP/EP-local layouts ↔ canonical tensors.
- `hf_experts`: transformers' fused in-memory experts ↔ the per-expert canonical tensors.
- `peft`: PEFT's wrapped names ↔ the base model's names and the adapters' own.
- `hf_config`: the HF families' `config.json` ↔ model dimensions.
"""
