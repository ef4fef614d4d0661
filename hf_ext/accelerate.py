"""accelerate's `save_state`/`load_state` through ckpt_plugins.

    accelerator = Accelerator(project_config=ProjectConfiguration(...))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    hf_ext.accelerate.enable(accelerator)      # once: accelerator.save_state/load_state go through us
    accelerator.save_state("ckpt")             # or save_state() with automatic checkpoint naming
    accelerator.load_state("ckpt")             # on any number of processes

With `enable`, `Accelerator.save_state` and `load_state` keep accelerate's semantics: the folder
(`output_dir`, or `project_dir/checkpoints/checkpoint_<iteration>` with automatic naming, an
existing one refused there, `total_limit` rotation, the iteration counter), the save and load
pre-hooks (a model a hook saves or loads itself, popping it from the lists, is left to it), what is
kept: every prepared model, optimizer and LR scheduler (the first of each under
`model`/`optim`/`sched`, further ones `model_1`, ...), the objects registered with
`register_for_checkpointing` (`custom_<i>`), stateful data loaders' positions (`dataloader_<i>`, per
process), the grad scaler, the accelerator's step counter and this process's RNG states. A folder is
overwritten as accelerate overwrites it. `end_training()` first waits for a save still committing
(`async_save`), which needs the process group it destroys, and raises its error. What differs is
deliberate: the files (`metadata.json` and `data/` instead of `model.safetensors`, `optimizer.bin`,
`scheduler.bin`, `random_states_<i>.pkl`, `custom_checkpoint_<i>.pkl`), and a checkpoint loads on
any number of processes and in every other framework extension. A folder without ckpt_plugins
metadata is loaded by accelerate's own code, and DeepSpeed runs keep accelerate's path (their engine
checkpoints through `deepspeed_ext` when its config says so).

The module-level `save_state(accelerator, path)` / `load_state(accelerator, path)` do the same
for one explicit path, with `extra` entries (a `cp.DataState`, say), and `save_state_async`.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Union

import ckpt_plugins as cp
from ckpt_plugins.ext import DCP, FORMAT_NAME, committed_first, fit_state, require_version, take_finished

from .safetensors_io import HF_CONFIG

log = logging.getLogger("hf_ext.accelerate")
ACCELERATE = ("1.1", "2")  # the Accelerator internals (hooks, registered objects) this routing keeps


class _Counters:
    def __init__(self, accelerator):
        self.accelerator = accelerator

    def state_dict(self) -> dict:
        return {"step": self.accelerator.step}

    def load_state_dict(self, state: dict) -> None:
        self.accelerator.step = state["step"]


def _named(items, base: str) -> Dict[str, Any]:
    return {base if i == 0 else f"{base}_{i}": item for i, item in enumerate(items)}


def accelerator_state(accelerator, rng: bool = True, models: Optional[list] = None) -> Dict[str, Any]:
    """The ckpt_plugins state of everything `accelerator` prepared or registered (`models`: those
    of its models ckpt_plugins handles, by default all)."""
    state: Dict[str, Any] = {}
    state.update({name: model for name, model in _named(accelerator._models, "model").items()
                  if models is None or any(model is m for m in models)})
    state.update(_named(accelerator._optimizers, "optim"))
    state.update(_named(accelerator._schedulers, "sched"))
    state.update({f"custom_{i}": obj for i, obj in enumerate(accelerator._custom_objects)})
    state.update({f"dataloader_{i}": cp.PerRank(loader.state_dict()) for i, loader in enumerate(accelerator._dataloaders)
                  if getattr(loader, "use_stateful_dataloader", False)})
    if getattr(accelerator, "scaler", None) is not None:
        state["scaler"] = accelerator.scaler
    state["accelerator"] = _Counters(accelerator)
    if rng:
        state["rng"] = cp.RNGState()
    return state


def saved_state(accelerator, models: Optional[list] = None) -> Dict[str, Any]:
    """What a save passes to ckpt_plugins: `accelerator_state` and the first model's HF config."""
    state = accelerator_state(accelerator, models=models)
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


def save_state(accelerator, path, *, step=None, extra: Optional[Dict[str, Any]] = None, models: Optional[list] = None,
               overwrite: bool = True, **options) -> cp.SaveInfo:
    """Save what `accelerator` tracks to `path` (every process calls it), and the entries of
    `extra` (a `cp.DataState`, say: `extra={"data": data}`), replacing a checkpoint already there
    as accelerate does; returns once committed.

    Each save's stall, time to commit, size and throughput go to the accelerator's trackers
    (`accelerator.log`, after `init_trackers`): a sync save's at once, an async one's at the
    first save after it committed."""
    return _logged(accelerator, cp.save(path, _saved(accelerator, extra, models), **_options(accelerator, step,
                                                                                          overwrite, options)))


def save_state_async(accelerator, path, *, step=None, extra: Optional[Dict[str, Any]] = None,
                     models: Optional[list] = None, overwrite: bool = True, **options) -> cp.SaveHandle:
    """`save_state` in the background: returns a handle once the snapshot is taken; call
    `handle.wait()` before relying on the checkpoint."""
    return _logged(accelerator, cp.save_async(path, _saved(accelerator, extra, models),
                                              **_options(accelerator, step, overwrite, options)))


def _saved(accelerator, extra, models) -> Dict[str, Any]:
    return {**saved_state(accelerator, models), **(extra or {})}


def _options(accelerator, step, overwrite: bool, options: Dict[str, Any]) -> Dict[str, Any]:
    return dict(step=step, framework="accelerate", layout={"num_processes": accelerator.num_processes},
                overwrite=overwrite, **options)


def _logged(accelerator, result):
    unlogged = accelerator.__dict__.setdefault("_ckpt_plugins_unlogged", [])
    unlogged.append(result)
    for info in take_finished(unlogged):
        accelerator.log(info.metrics(), step=info.summary()["step"])
    return result


def load_state(accelerator, path, *, strict: bool = True, extra: Optional[Dict[str, Any]] = None,
               models: Optional[list] = None, verify: bool = False) -> cp.LoadResult:
    """Restore what `accelerator` tracks, and the entries of `extra`, from `path`, resharding to the
    current processes. (The HF config saved beside the weights is not needed to resume.) `verify`:
    then prove the live state holds what was loaded (`ckpt_plugins.load(verify=True)`)."""
    state = {**accelerator_state(accelerator, models=models), **(extra or {}), HF_CONFIG: cp.Ignore()}
    loaders = {k: v for k, v in state.items() if k.startswith("dataloader_")}
    for key in loaders:
        state[key] = cp.PerRank(None)
    for i, model in enumerate(accelerator._models):
        if models is not None and not any(model is m for m in models):
            state["model" if i == 0 else f"model_{i}"] = cp.Ignore()  # a load hook took it
    if cp.checkpoint_format(path) == DCP:  # another framework's: what it holds, the rest named
        state, absent = fit_state(state, cp.read_metadata(path))
        if absent:
            log.warning("%s (a DCP checkpoint) holds no %s: left as they are", path, ", ".join(absent))
    result = cp.load(path, state, strict=strict, verify=verify)
    for i, loader in enumerate(accelerator._dataloaders):
        value = state.get(f"dataloader_{i}")
        if value is not None and value.value is not None:
            loader.load_state_dict(value.value)
    return result


# ---------------------------------------------------------------- Accelerator.save_state / load_state


def _iteration_of(folder: str) -> int:
    return int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)[0])


def _save_dir(accelerator, output_dir: Optional[str]) -> str:
    """Where `save_state(output_dir)` writes, as accelerate decides it (rotating old checkpoints)."""
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state needs an output_dir when automatic checkpoint naming is off")
        return os.fspath(output_dir)
    root = os.path.join(accelerator.project_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    folders = sorted((os.path.join(root, f) for f in os.listdir(root)), key=_iteration_of)
    if config.total_limit is not None and len(folders) + 1 > config.total_limit and accelerator.is_main_process:
        log.warning("Deleting %d checkpoints to make room for new checkpoint.", len(folders) + 1 - config.total_limit)
        for folder in folders[:len(folders) + 1 - config.total_limit]:
            shutil.rmtree(folder)
    path = os.path.join(root, f"checkpoint_{accelerator.save_iteration}")
    if os.path.exists(path):
        raise ValueError(f"Checkpoint directory {path} ({accelerator.save_iteration}) already exists. Please manually "
                         "override `self.save_iteration` with what iteration to start with.")
    accelerator.wait_for_everyone()
    return path


def _load_dir(accelerator, input_dir: Optional[str]) -> str:
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return input_dir
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    root = os.path.join(accelerator.project_dir, "checkpoints")
    return sorted((os.path.join(root, f) for f in os.listdir(root)), key=_iteration_of)[-1]


def _handled_models(accelerator, hooks, path: str, load: bool = False) -> List:
    """The prepared models left to ckpt_plugins once accelerate's pre-hooks ran: a hook that saves
    or loads a model itself pops it (save hooks pop its state dict from `weights`)."""
    from accelerate.utils import DistributedType

    models = list(accelerator._models)
    if load:
        for hook in hooks.values():
            hook(models, path)
        return models
    if not hooks or accelerator.distributed_type == DistributedType.FSDP:
        for hook in hooks.values():  # as accelerate: an FSDP model's state dict is not gathered for the hooks
            hook(models, [], path)
        return models
    weights = [accelerator.get_state_dict(m, unwrap=False) for m in models]
    given = list(weights)
    for hook in hooks.values():
        hook(models, weights, path)
    return [accelerator._models[i] for i, w in enumerate(given) if any(w is kept for kept in weights)]


def enable(accelerator, *, async_save: bool = False, verify: bool = False, host_memory: Union[int, str, None] = None,
           compress: Union[bool, str, None] = None):
    """Make `accelerator.save_state`/`load_state` save and load through ckpt_plugins, keeping
    accelerate's folders, hooks and counters (see the module docstring). Returns the accelerator.
    `verify`: every `load_state` then proves the live state holds what was loaded. `host_memory`
    (bytes, or a size such as "8GiB"): the most host memory a rank stages saves in; a bigger save
    streams through it. `compress`: tensors stored losslessly compressed where that shrinks them, or
    with "auto" only where that also shortens the commit (needs zstandard); None leaves the
    checkpointer's setting."""
    require_version("accelerate", "accelerate", ACCELERATE, "hf_ext.accelerate")
    if host_memory is not None:
        cp.checkpointer().host_memory = host_memory
    if compress is not None:
        cp.checkpointer().compress = compress
    from accelerate.utils import DistributedType

    native_save, native_load = accelerator.save_state, accelerator.load_state
    native_types = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)

    def save(output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs):
        if accelerator.distributed_type in native_types:
            return native_save(output_dir, safe_serialization, **kwargs)
        path = _save_dir(accelerator, output_dir)
        os.makedirs(path, exist_ok=True)
        models = _handled_models(accelerator, accelerator._save_model_state_pre_hook, path)
        (save_state_async if async_save else save_state)(accelerator, path, models=models)
        accelerator.project_configuration.iteration += 1
        return path

    def load(input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs):
        path = _load_dir(accelerator, input_dir)
        if accelerator.distributed_type in native_types or cp.checkpoint_format(path) not in (FORMAT_NAME, DCP):
            return native_load(path, load_kwargs, **kwargs)
        models = _handled_models(accelerator, accelerator._load_model_state_pre_hook, path, load=True)
        load_state(accelerator, path, models=models, verify=verify)

    accelerator.save_state, accelerator.load_state = save, load
    # a save still committing needs the process group that accelerate's end destroys
    accelerator.end_training = committed_first(accelerator.end_training)
    accelerator._ckpt_plugins = True
    return accelerator
