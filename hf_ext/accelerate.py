"""A plain accelerate loop saving and resuming through ckpt_plugins.

    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    hf_ext.accelerate.save_state(accelerator, "ckpt/step_100", step=100)     # instead of save_state
    hf_ext.accelerate.load_state(accelerator, "ckpt/step_100")               # instead of load_state
    hf_ext.accelerate.warm_up(accelerator)   # once, after the first step: a first save as fast as the rest

What `Accelerator.save_state` keeps, in ckpt_plugins form: every prepared model, optimizer and
LR scheduler (the first of each under `model`/`optim`/`sched`, further ones `model_1`, ...), the
objects registered with `register_for_checkpointing` (`custom_<i>`), the grad scaler, the
accelerator's step counter and this process's RNG states. A checkpoint loads on any number of
processes, and its `model`/`optim` load in every other framework extension.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import ckpt_plugins as cp
from ckpt_plugins.results import take_finished

from .safetensors_io import HF_CONFIG


class _Counters:
    def __init__(self, accelerator):
        self.accelerator = accelerator

    def state_dict(self) -> dict:
        return {"step": self.accelerator.step}

    def load_state_dict(self, state: dict) -> None:
        self.accelerator.step = state["step"]


def _named(items, base: str) -> Dict[str, Any]:
    return {base if i == 0 else f"{base}_{i}": item for i, item in enumerate(items)}


def accelerator_state(accelerator, rng: bool = True) -> Dict[str, Any]:
    """The ckpt_plugins state of everything `accelerator` prepared or registered."""
    state: Dict[str, Any] = {}
    state.update(_named(accelerator._models, "model"))
    state.update(_named(accelerator._optimizers, "optim"))
    state.update(_named(accelerator._schedulers, "sched"))
    state.update({f"custom_{i}": obj for i, obj in enumerate(accelerator._custom_objects)})
    if getattr(accelerator, "scaler", None) is not None:
        state["scaler"] = accelerator.scaler
    state["accelerator"] = _Counters(accelerator)
    if rng:
        state["rng"] = cp.RNGState()
    return state


def saved_state(accelerator) -> Dict[str, Any]:
    """What `save_state` passes to ckpt_plugins: `accelerator_state` and the first model's HF config."""
    state = accelerator_state(accelerator)
    if accelerator._models:
        config = getattr(accelerator.unwrap_model(accelerator._models[0]), "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            state[HF_CONFIG] = config.to_json_string()
    return state


def warm_up(accelerator, extra: Optional[Dict[str, Any]] = None) -> None:
    """Call once after the first optimizer step, with the `extra` entries the saves will pass: the
    first `save_state`'s one-time costs (its plan, its staging memory faulted in) then run in the
    background, beside the next steps, and that save is as fast as any later one
    (`Checkpointer.warm_up`)."""
    cp.checkpointer().warm_up({**saved_state(accelerator), **(extra or {})})


def save_state(accelerator, path, *, step=None, async_: bool = False, extra: Optional[Dict[str, Any]] = None,
               **options):
    """Save what `accelerator` tracks to `path` (every process calls it), and the entries of
    `extra` (a `cp.DataState`, say: `extra={"data": data}`). `async_=True` returns a handle once
    the snapshot is taken; call `handle.wait()` before relying on the checkpoint.

    Each save's stall, time to commit, size and throughput go to the accelerator's trackers
    (`accelerator.log`, after `init_trackers`): a sync save's at once, an async one's at the
    first save_state after it committed."""
    result = cp.save(path, {**saved_state(accelerator), **(extra or {})}, step=step, async_=async_, framework="accelerate",
                     layout={"num_processes": accelerator.num_processes}, **options)
    unlogged = accelerator.__dict__.setdefault("_ckpt_plugins_unlogged", [])
    unlogged.append(result)
    for info in take_finished(unlogged):
        accelerator.log(info.metrics(), step=info.summary()["step"])
    return result


def load_state(accelerator, path, *, strict: bool = True, extra: Optional[Dict[str, Any]] = None) -> cp.LoadResult:
    """Restore what `accelerator` tracks, and the entries of `extra`, from `path`, resharding to the
    current processes. (The HF config saved beside the weights is not needed to resume.)"""
    return cp.load(path, {**accelerator_state(accelerator), **(extra or {}), HF_CONFIG: cp.Ignore()}, strict=strict)
