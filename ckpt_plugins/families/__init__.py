"""Model-family mappings shared by the framework extensions: pure functions over names, shapes and
configs (no framework imported), unit-tested without processes.

- `megatron`: megatron-core parameter names and TP/EP-local layouts ↔ canonical tensors.
- `hf_config`: the HF families' `config.json` ↔ model dimensions.
"""
