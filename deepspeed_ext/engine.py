"""`engine.save_checkpoint` / `engine.load_checkpoint` through ckpt_plugins, same signatures.

DeepSpeed has no registry for third-party checkpoint engines, and a custom `checkpoint_engine` only
sees DeepSpeed's own gathered state dicts; rebinding the two methods on the engine instance is the
one place every caller (user code, the HF Trainer) goes through. Semantics kept: `save_dir/<tag>`
(default tag `global_step<N>`), the `latest` file (written by rank 0 once the checkpoint has
committed), `client_state` (returned by load), the LR scheduler, `global_steps`, `global_samples`,
`skipped_steps`, and the `load_optimizer_states`, `load_lr_scheduler_states`, `load_module_only`
flags. A directory without ckpt_plugins metadata (a native DeepSpeed checkpoint) is loaded by
DeepSpeed's own method.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
from typing import Any, Callable, Dict, Optional

import torch

import ckpt_plugins as cp
from ckpt_plugins.ext import (DATA_DIR, FORMAT_NAME, Handler, LoadItems, LocalStorage, SaveHooks, SaveItems, StepGate,
                              committed_first, fit_state, overlapped, read_pointer, storage_for, take_finished)

from . import zero_to_fp32, zero_to_torch
from .native import NAME as NATIVE
from .zero import DeepSpeedModel, DeepSpeedOptimizer, SharedZero, ZeroState

log = logging.getLogger("deepspeed_ext")
LATEST = "latest"
COUNTERS = ("global_steps", "global_samples", "skipped_steps")


class ClientState(Handler):
    """`client_state`: one replicated object (JSON when plain, else the safe torch encoding);
    loaded when the checkpoint has one."""

    def __init__(self, value: Optional[Dict[str, Any]] = None):
        self.value = value

    def save_items(self, prefix: str) -> SaveItems:
        return SaveItems(objects={prefix: dict(self.value or {})})

    def load_items(self, prefix: str, metadata) -> LoadItems:
        if prefix not in metadata.objects:
            return LoadItems()
        return LoadItems(objects={prefix: lambda v: setattr(self, "value", v)})


class Counters(Handler):
    """The engine's step counters; loaded when the checkpoint has them (a checkpoint from another
    framework does not)."""

    def __init__(self, engine):
        self.engine = engine

    def save_items(self, prefix: str) -> SaveItems:
        return SaveItems(objects={f"{prefix}/{name}": int(getattr(self.engine, name)) for name in COUNTERS})

    def load_items(self, prefix: str, metadata) -> LoadItems:
        return LoadItems(objects={f"{prefix}/{name}": lambda v, n=name: setattr(self.engine, n, v)
                                  for name in COUNTERS if f"{prefix}/{name}" in metadata.objects})


def engine_state(engine, *, optimizer: bool = True, scheduler: bool = True, counters: bool = True,
                 gathered: bool = False) -> Dict[str, Any]:
    """The ckpt_plugins state of a DeepSpeed engine: `model`, `optim` (masters always, optimizer
    state when `optimizer`), `sched`, `engine` counters (`gathered`: see `DeepSpeedModel`)."""
    shared = SharedZero(engine)
    state: Dict[str, Any] = {"model": DeepSpeedModel(engine, gathered, shared)}
    if engine.optimizer is not None:
        state["optim"] = DeepSpeedOptimizer(engine, optimizer_state=optimizer, shared=shared)
    if scheduler and engine.lr_scheduler is not None:
        state["sched"] = engine.lr_scheduler
    if counters:
        state["engine"] = Counters(engine)
    return state


def copy_scripts(save_dir: str) -> None:
    """zero_to_fp32.py and zero_to_torch.py into the save directory, executable, as DeepSpeed copies its own."""
    for script in (zero_to_fp32, zero_to_torch):
        target = os.path.join(save_dir, os.path.basename(script.__file__))
        shutil.copyfile(script.__file__, target)
        try:
            os.chmod(target, os.stat(target).st_mode | stat.S_IEXEC)
        except (FileNotFoundError, PermissionError) as exc:  # some file shares refuse it: DeepSpeed goes on too
            log.info("could not make %s executable (%s); continuing", target, exc)


def settled(engine) -> bool:
    """Whether ZeRO-3's parameters already are as DeepSpeed's save leaves them, which it reaches by
    releasing every parameter and gathering the persistent ones again (a collective per save): the
    persistent ones gathered, every other one released, none in flight or in use by a module, and
    no ZeRO++ secondary partition (its save drops them). After a step they are."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() != 3 or not hasattr(optimizer, "persistent_parameters"):
        return False
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    persistent = {id(p) for p in optimizer.persistent_parameters}
    for p in iter_params(engine.module, recurse=True):
        wanted = ZeroParamStatus.AVAILABLE if id(p) in persistent else ZeroParamStatus.NOT_AVAILABLE
        if p.ds_status != wanted or p.ds_active_sub_modules or getattr(p, "ds_secondary_tensor", None) is not None:
            return False
    return True


def check_tag(engine, tag: str) -> Callable[[], None]:
    """DeepSpeed's check that every rank saves under one tag (its "checkpoint": {"tag_validation":
    "WARN" | "FAIL" | "IGNORE"}), with its message and outcome: the AssertionError under FAIL, the
    warning under WARN. One all-reduce of the tag's digest beside its negation (the maximum of both
    gives the minimum too) where DeepSpeed makes two over bytes, started here; the call returned
    waits for it and raises or warns. A save makes that call once the state is captured, which the
    all-reduce runs beside; every rank then raises alike."""
    if not engine.checkpoint_tag_validation_enabled():
        return lambda: None
    from deepspeed import comm
    digest = torch.tensor(list(hashlib.sha1(tag.encode()).digest()), dtype=torch.int32)
    mine = torch.cat([digest, -digest])
    agreed = mine.to(engine.device, copy=True)
    work = comm.all_reduce(agreed, op=comm.ReduceOp.MAX, async_op=True)

    def checked() -> None:
        work.wait()
        if torch.equal(agreed.cpu(), mine):
            return
        message = (f"[rank={comm.get_rank()}] The checkpoint tag name '{tag}' is not consistent across all ranks. "
                   "Including rank unique information in checkpoint tag could cause issues when restoring with "
                   "different world sizes.")
        if engine.checkpoint_tag_validation_fail():
            raise AssertionError(message)
        from deepspeed.utils import logger
        logger.warning(message)
    return checked


def layout(engine) -> Dict[str, Any]:
    return {"zero_stage": engine.zero_optimization_stage(), "dp_world_size": engine.dp_world_size,
            "dtype": "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"}


class Hooks:
    def __init__(self, engine, options: Dict[str, Any]):
        self.engine = engine
        asynchronous = bool(options.get("async", False))
        self.overlap = overlapped(asynchronous, options.get("overlap"))
        self.async_save = self.overlap or asynchronous
        self.verify = bool(options.get("verify", False))
        self.gate = StepGate()  # an overlapped save's snapshot runs until the optimizer's next step
        self.native_load, self.native_step = engine.load_checkpoint, engine.step
        self.checkpointer = cp.checkpointer()
        if options.get("host_memory") is not None:
            self.checkpointer.host_memory = options["host_memory"]
        if options.get("compress") is not None:
            self.checkpointer.compress = options["compress"]
        self.unlogged: list = []  # SaveInfo or SaveHandle of saves not yet in the monitor
        self.warm = bool(options.get("warm_up", True))
        self.extra: Dict[str, Any] = {}  # more entries every checkpoint carries (add_state)

    def step(self, *args, **kwargs):
        """DeepSpeed's step; after the first optimizer step, the first save's one-time costs (plan,
        staging) in the background (`Checkpointer.warm_up`), unless the config says `"warm_up": false`."""
        result = self.native_step(*args, **kwargs)
        if self.warm and self.engine.global_steps >= 1:
            self.warm = False
            self.checkpointer.warm_up(self.state({}))
        return result

    def state(self, client_state) -> Dict[str, Any]:
        return {**engine_state(self.engine), "client_state": ClientState(client_state), **self.extra}

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False):
        engine = self.engine
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        if exclude_frozen_parameters:
            log.warning("exclude_frozen_parameters is ignored: ckpt_plugins always stores frozen parameters")
        tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
        checked = check_tag(engine, tag)
        path = os.path.join(save_dir, tag)

        def after_commit() -> None:  # only once the checkpoint is whole
            root = storage_for(save_dir)
            if save_latest:
                root.put_atomic(LATEST, tag.encode())
            if isinstance(root, LocalStorage):  # where DeepSpeed puts its recovery scripts: ours, for ours
                copy_scripts(save_dir)

        # as DeepSpeed's own save: ZeRO-3 releases gathered parameters before, gathers persistent ones
        # after; unless they already are as that leaves them (the save reads the partitions)
        settle = engine._optimizer_has_ckpt_event_prologue() and not settled(engine)
        if settle:  # DeepSpeed's order: the tag checked before the parameters are released
            checked()
            checked = None
            engine.optimizer.checkpoint_event_prologue()
        options = dict(framework="deepspeed", layout=layout(engine), step=int(engine.global_steps), overwrite=True,
                       hooks=SaveHooks(captured=checked, on_commit=after_commit))
        if self.async_save:
            result = self.checkpointer.save_async(path, self.state(client_state), overlap=self.overlap, **options)
            # ZeRO's forward and backward leave what is saved alone (stage 3 gathers into other
            # memory than its partitions); its step changes it
            self.gate.hold(result, engine.optimizer)
        else:
            result = self.checkpointer.save(path, self.state(client_state), **options)
        if settle and engine._optimizer_has_ckpt_event_epilogue():
            engine.optimizer.checkpoint_event_epilogue()
        self.unlogged.append(result)
        self.log_saves()
        return True

    def log_saves(self) -> None:
        """Committed saves' stall, time to commit, size and throughput into DeepSpeed's own monitor
        (its TensorBoard, W&B, CSV or Comet writers), at the sample count DeepSpeed logs by; an
        async save once it has committed."""
        for info in take_finished(self.unlogged):
            if self.engine.monitor.enabled:
                self.engine.monitor.write_events([(name, value, self.engine.global_samples)
                                                  for name, value in info.metrics().items()])

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        engine = self.engine
        fmt = cp.checkpoint_format(load_dir) if tag is None else None
        if fmt not in (None, FORMAT_NAME, NATIVE):  # another format's checkpoint (HF, DCP): the directory itself
            path = load_dir
        else:
            if tag is None:
                tag = read_pointer(load_dir, LATEST)
                if tag is None:
                    log.warning("no %s file in %s: pass an explicit tag to load a checkpoint", LATEST, load_dir)
                    return None, None
            path = os.path.join(load_dir, str(tag))
            fmt = cp.checkpoint_format(path)
        foreign = fmt not in (None, FORMAT_NAME, NATIVE)
        if fmt in (None, NATIVE) and not storage_for(path).exists(DATA_DIR):  # DeepSpeed's own
            return self.native_load(load_dir, tag, load_module_strict, load_optimizer_states,
                                    load_lr_scheduler_states, load_module_only, custom_load_fn)
        full = not load_module_only
        # ZeRO-3's parameters as DeepSpeed's load leaves them already (as after a step): its release
        # of them all before and regather of the persistent ones after are skipped, those filled whole
        gathered = not self.verify and settled(engine)
        state = engine_state(engine, optimizer=full and load_optimizer_states,
                             scheduler=full and load_lr_scheduler_states, counters=full, gathered=gathered)
        client = ClientState()
        state["client_state"] = client
        if full:
            state.update(self.extra)
        ignored = {k: cp.Ignore() for k in ("optim", "sched", "engine") if k not in state}
        if foreign:
            state, absent = fit_state(state, cp.read_metadata(path))
            if absent:
                log.warning("%s (%s) holds no %s: left as they are", path, fmt, ", ".join(absent))
        if engine._optimizer_has_ckpt_event_prologue() and not gathered:  # as DeepSpeed's own load
            engine.optimizer.checkpoint_event_prologue()
        result = self.checkpointer.load(path, {**state, **ignored}, strict=load_module_strict, verify=self.verify)
        if result.missing_keys and not load_module_strict:
            log.warning("%s: %d key(s) not in the checkpoint were left as they were: %s", path,
                        len(result.missing_keys), ", ".join(result.missing_keys[:5]))
        if result.unexpected_keys and not load_module_strict:  # another framework's state, e.g. Megatron's
            log.warning("%s: %d key(s) of the checkpoint have no place in this engine and were not loaded: %s",
                        path, len(result.unexpected_keys), ", ".join(result.unexpected_keys[:5]))
        return path, client.value or {}


def add_state(engine, **entries) -> None:
    """More entries every `save_checkpoint` and (unless `load_module_only`) `load_checkpoint` of
    `engine` carry, beside the engine's own: `add_state(engine, data=cp.DataState(loader))` keeps
    the data position, which then resumes at any data-parallel size and in other frameworks."""
    if not hasattr(engine, "_ckpt_plugins"):
        raise ValueError("the engine does not checkpoint through ckpt_plugins: add "
                         '"checkpoint": {"backend": "bytecheckpoint"} to its DeepSpeed config')
    engine._ckpt_plugins.extra.update(entries)


def enable(engine, options: Optional[Dict[str, Any]] = None):
    """Route `engine.save_checkpoint`/`load_checkpoint` through ckpt_plugins. Returns the engine.
    An optimizer set-up it cannot map is refused here, not at the first save."""
    ZeroState(engine)
    hooks = Hooks(engine, options or {})
    engine.save_checkpoint = hooks.save_checkpoint
    engine.load_checkpoint = hooks.load_checkpoint
    engine.step = hooks.step
    # DeepSpeed's own decoupled checkpoint engine commits at destroy; and the optimizer's teardown
    # must not run under a snapshot
    engine.destroy = committed_first(engine.destroy, hooks.checkpointer)
    engine._ckpt_plugins = hooks
    return engine
