"""deepspeed_ext: DeepSpeed ZeRO 0-3 through ckpt_plugins, switched on by a config entry.

    "checkpoint": {"backend": "bytecheckpoint", "async": false, "overlap": null, "warm_up": true,
                   "verify": false, "host_memory": null, "compress": false}

in the DeepSpeed config, then either `engine, optimizer, _, scheduler = deepspeed_ext.initialize(...)`
(same arguments as `deepspeed.initialize`) or `deepspeed_ext.install()` once, which makes every
`deepspeed.initialize` call (the HF Trainer's and accelerate's included) do the same. Without the
entry DeepSpeed behaves exactly as before. `async`: `save_checkpoint` returns at once, the snapshot
runs beside the next forward and backward, and the optimizer's next step waits for it (overlapped;
`"overlap": false` returns once the snapshot is taken instead; `"overlap": true` implies `async`).
`warm_up` (default true): after the first optimizer step, plan the first save and fault its
staging memory in beside training, so that save is as fast as any later one. `verify`: `load_checkpoint` then proves the live model and
optimizer hold what was loaded (`ckpt_plugins.load(verify=True)`). `host_memory` (bytes, or a size
such as "8GiB"): the most host memory a rank stages saves in; a bigger save streams through it
(`Checkpointer(host_memory=...)`). `compress`: store each tensor losslessly compressed where that
shrinks it, or with "auto" only where that also shortens the commit (`Checkpointer(compress=...)`;
needs zstandard).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ckpt_plugins.ext import require_version

from .engine import add_state, engine_state, enable
from .zero import DeepSpeedModel, DeepSpeedOptimizer

BACKEND = "bytecheckpoint"
INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation 'ckpt_plugins[deepspeed]'"
SUPPORTED = ("0.19", "0.20")  # ZeRO's partition bookkeeping (_hp_mapping, grad_position) as these versions keep it

__all__ = ["initialize", "install", "enable", "add_state", "engine_state", "options_of", "DeepSpeedModel",
           "DeepSpeedOptimizer"]


def _deepspeed():
    """deepspeed, of a version whose partition bookkeeping this extension reads."""
    return require_version("deepspeed", "deepspeed", SUPPORTED, "deepspeed_ext", INSTALL)


def options_of(engine) -> Optional[Dict[str, Any]]:
    """The engine's `checkpoint` config section when it selects ckpt_plugins, else None."""
    config = getattr(engine, "config", None) or {}
    section = config.get("checkpoint") if isinstance(config, dict) else None
    if isinstance(section, dict) and section.get("backend") == BACKEND:
        return section
    return None


def _activate(result):
    engine = result[0]
    options = options_of(engine)
    if options is not None:
        enable(engine, options)
    return result


def initialize(*args, **kwargs):
    """`deepspeed.initialize`, then ckpt_plugins checkpointing when the config asks for it."""
    deepspeed = _deepspeed()
    return _activate(_native_initialize(deepspeed)(*args, **kwargs))


def _native_initialize(deepspeed):
    return getattr(deepspeed.initialize, "_ckpt_plugins_native", deepspeed.initialize)


def install() -> None:
    """Make `deepspeed.initialize` itself activate ckpt_plugins (for callers you do not control,
    such as the HF Trainer). Idempotent."""
    deepspeed = _deepspeed()
    if hasattr(deepspeed.initialize, "_ckpt_plugins_native"):
        return
    native = deepspeed.initialize

    def initialize_with_checkpoints(*args, **kwargs):
        return _activate(native(*args, **kwargs))

    initialize_with_checkpoints._ckpt_plugins_native = native
    initialize_with_checkpoints.__doc__ = native.__doc__
    deepspeed.initialize = initialize_with_checkpoints
