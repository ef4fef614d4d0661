"""`--ckpt-backend bytecheckpoint`: Megatron's own `save_checkpoint`/`load_checkpoint` through ckpt_plugins.

Enable it in your `pretrain_gpt.py` with two lines (the flag then switches it per run)::

    import megatron_ext.training as bcp
    bcp.install()                                   # before pretrain()
    pretrain(..., extra_args_provider=bcp.add_arguments)
    # with your own provider: extra_args_provider=bcp.with_arguments(my_provider)

`install()` rebinds the two functions in `megatron.training.checkpointing` and in the modules that
imported them by name (`training`), and `training.maybe_finalize_async_save`, which `train()` and
`pretrain()` call blocking as they end: it also waits for ckpt_plugins' pending save. Without the
flag (`--ckpt-backend native`, the default) they call Megatron's own. Kept: `--save`/`--load`,
`iter_NNNNNNN` directories, `latest_checkpointed_iteration.txt` (written by rank 0 once the
checkpoint has committed), `--ckpt-step`, `--finetune`, `--no-save-optim`/`--no-load-optim`,
`--no-save-rng`/`--no-load-rng`, `--use-checkpoint-args` (the model arguments come from the
checkpoint, through Megatron's own rules), `--async-save` (an overlapped ckpt_plugins save: it
returns at once, the snapshot running beside the next forward and backward until the optimizer step;
`--no-ckpt-overlap`: it returns once the snapshot is taken, as Megatron's own; `--ckpt-host-memory
8GiB`: staging within that budget, a bigger save streaming through it; `--ckpt-compress`: tensors
stored losslessly compressed where that shrinks them; `--ckpt-compress auto`: only where that also
shortens the commit), `--non-persistent-save-interval` (saves to the memory tier, replicated to
another host; a restart with `--load` = `--save` takes the newest of memory and the tracker's
iteration, agreed by every rank), the iteration, FLOPs so far, consumed samples, the LR scheduler
and RNG states (Python, NumPy, torch and Megatron's TP RNG tracker, per rank). `--load` may also
name a ckpt_plugins checkpoint itself (one written by another framework): its weights (and optimizer
state, when it has Megatron-compatible entries) load at iteration 0 unless it records one. A native
Megatron checkpoint in `--load` is loaded by Megatron's own code.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
from typing import Any, Dict, Optional

import ckpt_plugins as cp
from ckpt_plugins.ext import (FAMILIES, FORMAT_NAME, HF_CONFIG, Handler, LoadItems, SaveHooks, SaveItems, StepGate,
                              committed_first, overlapped, read_pointer, require_version, storage_for, stored_entries,
                              take_finished)

from .family import OWN_NAMES
from .gpt import MegatronModel, MegatronOptimizer, hf_config_json

log = logging.getLogger("megatron_ext")
BACKEND = "bytecheckpoint"
TRACKER = "latest_checkpointed_iteration.txt"
BACKEND_FILE = "metadata.json"  # Megatron's, in each native checkpoint: {"sharded_backend": "torch_dist", ...}
NATIVE_FORMAT = "Megatron torch_dist"  # as checkpoint_format names it (native.READER)
TORCH_DCP_FORMAT = "Megatron torch_dcp"  # Megatron's own too (native.TORCH_DCP_READER)
SUPPORTED = ("0.19", "0.20")  # megatron-core versions whose layouts and checkpointing hooks this extension maps
RESUMED_ARGS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")


def add_arguments(parser):
    group = parser.add_argument_group("ckpt_plugins")
    group.add_argument("--ckpt-backend", choices=["native", BACKEND], default="native",
                       help="'bytecheckpoint': save and load through ckpt_plugins (parallelism-agnostic, HF names)")
    group.add_argument("--ckpt-hf-family", choices=sorted(FAMILIES) + [OWN_NAMES.name], default=None,
                       help="the HF family whose tensor names the checkpoint uses (default: from the model's "
                            "config; a MoE model without q/k norms or shared experts is taken for Mixtral)")
    group.add_argument("--ckpt-overlap", action=argparse.BooleanOptionalAction, default=None,
                       help="with --ckpt-backend bytecheckpoint: a save returns at once (asynchronous), its snapshot "
                            "runs beside the next forward and backward, and the next optimizer step waits for it; "
                            "the default with --async-save (--no-ckpt-overlap: it returns once the snapshot is taken)")
    group.add_argument("--ckpt-verify", action="store_true",
                       help="with --ckpt-backend bytecheckpoint: a load then proves the live model and optimizer hold "
                            "what was loaded (ckpt_plugins.load(verify=True))")
    group.add_argument("--ckpt-compress", nargs="?", const=True, default=False, choices=[True, "auto"],
                       help="with --ckpt-backend bytecheckpoint: store each tensor losslessly compressed where that "
                            "shrinks it, or with 'auto' only where that also shortens the save's commit (needs "
                            "zstandard: pip install 'ckpt_plugins[zstd]')")
    group.add_argument("--ckpt-host-memory", default=None, metavar="SIZE",
                       help="with --ckpt-backend bytecheckpoint: the most host memory a rank stages saves in (bytes, or "
                            "a size such as 8GiB); a bigger save streams through it")
    return parser


def with_arguments(provider):
    """An extra_args_provider that adds ours after `provider`'s."""
    return lambda parser: add_arguments(provider(parser))


class RunState(Handler):
    """Iteration, FLOPs so far and the arguments a resume restores; the run's other plain arguments
    are saved too, for inspection. Loads only what the checkpoint has (a foreign one has none)."""

    def __init__(self, iteration: int = 0, flops: float = 0, args=None):
        self.values: Dict[str, Any] = {"iteration": iteration, "num_floating_point_operations_so_far": flops}
        if args is not None:
            self.values["args"] = {k: p for k, p in ((k, _as_json(v)) for k, v in sorted(vars(args).items()))
                                   if p is not _UNSTORED}

    def save_items(self, prefix: str) -> SaveItems:
        return SaveItems(objects={f"{prefix}/{k}": v for k, v in self.values.items()})

    def load_items(self, prefix: str, metadata) -> LoadItems:
        return LoadItems(objects={f"{prefix}/{k}": (lambda v, k=k: self.values.__setitem__(k, v))
                                  for k in ("iteration", "num_floating_point_operations_so_far", "args")
                                  if f"{prefix}/{k}" in metadata.objects})


_UNSTORED = object()


def _as_json(value):
    """`value` as plain JSON data (an enum such as `exit_signal` becomes its number, a tuple a list),
    so the arguments are stored as JSON that any process reads; `_UNSTORED` when it has none.
    Plain scalars, most of a run's hundreds of arguments, are their own (a round trip each cost
    milliseconds per save)."""
    if value is None or type(value) in (bool, int, str) or (type(value) is float and math.isfinite(value)):
        return value
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return _UNSTORED


class TrackerRNG(Handler):
    """Megatron's tensor-parallel RNG tracker states (model-parallel dropout streams), per rank."""

    def save_items(self, prefix: str) -> SaveItems:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        return SaveItems(per_rank={prefix: get_cuda_rng_tracker().get_states()})

    def load_items(self, prefix: str, metadata) -> LoadItems:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        return LoadItems(per_rank={prefix: lambda states: get_cuda_rng_tracker().set_states(states)})


def _real_vocab(args) -> Optional[int]:
    """The unpadded vocabulary: rows past it (Megatron's padding) are not stored."""
    if getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    from megatron.training import global_vars
    tokenizer = getattr(global_vars, "_GLOBAL_TOKENIZER", None)
    return int(tokenizer.vocab_size) if tokenizer is not None else None


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_state(args, iteration, model, optimizer, opt_param_scheduler,
                num_floating_point_operations_so_far) -> Dict[str, Any]:
    """What a save passes to ckpt_plugins."""
    vocab, family = _real_vocab(args), getattr(args, "ckpt_hf_family", None)
    state: Dict[str, Any] = {"model": MegatronModel(model, vocab, family),
                             "megatron": RunState(iteration, num_floating_point_operations_so_far, args)}
    config = hf_config_json(model, vocab, family)
    if config is not None:  # the model has an HF family: exports write it as config.json
        state[HF_CONFIG] = config
    if optimizer is not None and not args.no_save_optim:
        state["optim"] = MegatronOptimizer(optimizer, model, vocab, family=family)
        if opt_param_scheduler is not None:
            state["sched"] = opt_param_scheduler
    if not args.no_save_rng:
        state["rng"], state["rng_tracker"] = cp.RNGState(), TrackerRNG()
    return state


def _checkpointer(args) -> cp.Checkpointer:
    """The default Checkpointer, within --ckpt-host-memory, compressing with --ckpt-compress."""
    ckpt = cp.checkpointer()
    ckpt.compress = getattr(args, "ckpt_compress", False)
    if getattr(args, "ckpt_host_memory", None) is not None:
        ckpt.host_memory = args.ckpt_host_memory
    return ckpt


def save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far):
    from megatron.training import get_args
    args = get_args()
    state = saved_state(args, iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far)

    def write_tracker() -> None:  # only once the checkpoint is whole
        storage_for(args.save).put_atomic(TRACKER, str(iteration).encode())

    asynchronous = bool(getattr(args, "async_save", False))
    overlap = overlapped(asynchronous, getattr(args, "ckpt_overlap", None))
    path = checkpoint_dir(args.save, iteration)
    options = dict(framework="megatron", step=int(iteration), overwrite=True, layout=_layout(args),
                   hooks=SaveHooks(on_commit=write_tracker))
    if overlap or asynchronous:
        result = _checkpointer(args).save_async(path, state, overlap=overlap, **options)
        # the forward and backward leave the saved tensors alone (train() finishes the distributed
        # optimizer's overlapped parameter all-gather before it saves); the step changes them
        _gate.hold(result, optimizer)
    else:
        result = _checkpointer(args).save(path, state, **options)
    _logged(result)
    return result


_gate = StepGate()  # an overlapped save's snapshot runs until the optimizer's next step


def save_to_memory(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far):
    """A non-persistent save (`--non-persistent-save-interval`): to the memory tier, replicated to
    another host (asynchronous: returns once the snapshot is taken)."""
    from megatron.training import get_args
    args = get_args()
    state = saved_state(args, iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far)
    handle = memory_tier(args).save_async(int(iteration), state, framework="megatron", layout=_layout(args))
    _logged(handle)
    return handle


_tiers: Dict[str, Any] = {}


def memory_tier(args):
    """The run's memory tier (one per --save directory)."""
    from ckpt_plugins.ext import MemoryTier
    if args.save not in _tiers:
        _tiers[args.save] = MemoryTier(_checkpointer(args), args.save)
    return _tiers[args.save]


def _uses_memory(args, load_dir: str) -> bool:
    """A restart of a run with non-persistent saves: --load is its --save directory."""
    return bool(getattr(args, "non_persistent_save_interval", None) and args.save and load_dir
                and os.path.abspath(str(load_dir)) == os.path.abspath(str(args.save)))


def _layout(args) -> Dict[str, Any]:
    return {"tp": _ps().get_tensor_model_parallel_world_size(), "pp": _ps().get_pipeline_model_parallel_world_size(),
            "ep": _ps().get_expert_model_parallel_world_size(), "etp": _ps().get_expert_tensor_parallel_world_size(),
            "dp": _ps().get_data_parallel_world_size(),
            "distributed_optimizer": bool(getattr(args, "use_distributed_optimizer", False))}


def _logged(result) -> None:
    _unlogged.append(result)
    for info in take_finished(_unlogged):  # an async save is logged once it has committed
        _log_save(info)


_unlogged: list = []  # SaveInfo or SaveHandle of saves whose figures are not logged yet


def warm_up(model, optimizer, opt_param_scheduler) -> None:
    """The first save's one-time costs (plan, staging) now, in the background: call it once after
    the first optimizer step (`install()` does, after Megatron's first `train_step`, when the run
    saves: `--save` and `--save-interval`)."""
    from megatron.training import get_args
    args = get_args()
    _checkpointer(args).warm_up(saved_state(args, 0, model, optimizer, opt_param_scheduler, 0.0))


def _log_save(info: cp.SaveInfo) -> None:
    """A save's stall, time to commit, size and throughput into Megatron's own TensorBoard and W&B
    writers (those --tensorboard-dir / --wandb-project set up), at the iteration it saved."""
    from megatron.training import global_vars
    scalars, iteration = info.metrics(), info.telemetry.info.get("step") if info.telemetry else None
    writer = global_vars.get_tensorboard_writer()
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
    wandb = global_vars.get_wandb_writer()
    if wandb is not None:
        wandb.log(scalars, iteration)


def _ps():
    from megatron.core import parallel_state
    return parallel_state


def resolve(load_dir: str, step: Optional[int] = None) -> Optional[str]:
    """The checkpoint directory a load reads: `load_dir` itself when it is a checkpoint (ours, or
    one read in place: HF safetensors, DCP), else `iter_N` for `step` or the tracker's iteration;
    None when there is none."""
    if cp.checkpoint_format(load_dir) is not None and tracked_iteration(load_dir) is None:
        return load_dir
    step = tracked_iteration(load_dir) if step is None else step
    return None if step is None else checkpoint_dir(load_dir, step)


def tracked_iteration(save_dir: str) -> Optional[int]:
    """The iteration Megatron's tracker file in `save_dir` names; None without one."""
    text = read_pointer(save_dir, TRACKER)
    if text is None:
        return None
    if not text.isdigit():
        raise cp.NotACheckpointError(f"{save_dir}/{TRACKER} holds {text!r}, not an iteration number")
    return int(text)


def load(model, optimizer, opt_param_scheduler, load_arg: str = "load", strict: bool = True):
    """Returns (iteration, num_floating_point_operations_so_far) as Megatron's load_checkpoint does;
    None when `load_arg`'s directory has no ckpt_plugins checkpoint (the caller falls back)."""
    from megatron.training import get_args, print_rank_0
    args = get_args()
    load_dir = getattr(args, load_arg)
    step = getattr(args, "ckpt_step", None)
    found = None
    if _uses_memory(args, load_dir):  # the newest of memory and the tracker's, agreed by every rank
        try:
            found = memory_tier(args).locate(tracked_iteration(load_dir), step)
        except cp.NotACheckpointError:
            return None
        path = found.storage or checkpoint_dir(load_dir, found.step)
    else:
        path = resolve(load_dir, step) if load_dir else None
    if path is None:
        return None
    fmt = cp.checkpoint_format(path)
    if fmt in (None, NATIVE_FORMAT, TORCH_DCP_FORMAT):
        if any(f.endswith(".distcp") or f.endswith(".pt") for f in storage_for(path).listdir()):
            return None  # a native Megatron checkpoint
        raise cp.IncompleteCheckpointError(f"{path} has no committed ckpt_plugins checkpoint (a save that did not "
                                           "finish?): point --load at a committed one or pass --ckpt-step")
    vocab, family = _real_vocab(args), getattr(args, "ckpt_hf_family", None)
    foreign = fmt != FORMAT_NAME  # another format's (HF, DCP): weights, perhaps optimizer state, no run state
    full = not args.finetune and not foreign
    run = RunState()
    state: Dict[str, Any] = {"model": MegatronModel(model, vocab, family)}
    if not foreign:
        state["megatron"] = run
    metadata = cp.read_metadata(path)
    stored = stored_entries(metadata)
    if optimizer is not None and "optim" in stored:
        state["optim"] = MegatronOptimizer(optimizer, model, vocab, family=family, optimizer_state=(
            full or (foreign and not args.finetune)) and not args.no_load_optim)
    if full and not args.no_load_optim and opt_param_scheduler is not None and "sched" in stored:
        state["sched"] = opt_param_scheduler
    if full and not args.no_load_rng and "rng" in stored:
        state["rng"], state["rng_tracker"] = cp.RNGState(), TrackerRNG()
    state.update({k: cp.Ignore() for k in stored if k not in state})
    cp.load(path, state, strict=strict, verify=bool(getattr(args, "ckpt_verify", False)))
    if found is not None:
        memory_tier(args).settle(found)
    values = run.values
    if full:
        saved = values.get("args", {})
        for name in RESUMED_ARGS:
            setattr(args, name, saved.get(name, 0))
        _update_microbatches(args.consumed_train_samples)
        saved_dp, dp = metadata.layout.get("dp"), _ps().get_data_parallel_world_size()
        if saved_dp not in (None, dp) and args.dataloader_type == "cyclic" and getattr(args, "data_sharding", False):
            log.warning("resuming a DP=%s run at DP=%d with the cyclic sampler's data sharding, whose order depends "
                        "on the DP size: samples are repeated or skipped. Resume with --no-data-sharding (run that "
                        "way from the start) or the single sampler to continue the same sample stream.", saved_dp, dp)
    if optimizer is not None and "optim" not in state:  # weights only: masters must follow them
        optimizer.reload_model_params()
    if foreign:
        print_rank_0(f"loaded {fmt} checkpoint {path} in place: iteration 0")
        return 0, 0
    print_rank_0(f"loaded ckpt_plugins checkpoint {path} at iteration {values['iteration']}")
    return (0 if not full else int(values["iteration"])), values["num_floating_point_operations_so_far"]


def checkpoint_run(load_dir: str, step: Optional[int] = None):
    """What Megatron's `_load_base_checkpoint(rank0=True)` gives `--use-checkpoint-args` for a
    ckpt_plugins checkpoint in `load_dir` (its saved arguments and iteration); None without one."""
    import argparse
    from ckpt_plugins.ext import read_object
    path = resolve(load_dir, step) if load_dir else None
    if path is None or not cp.is_checkpoint(path):
        return None
    storage = storage_for(path)
    metadata = cp.read_metadata(storage)
    saved = {k: read_object(storage, metadata, f"megatron/{k}", None) for k in ("args", "iteration")
             if f"megatron/{k}" in metadata.objects}
    if not saved:
        return None
    state = {"iteration": saved.get("iteration", 0), "checkpoint_version": 3.0}
    if "args" in saved:
        state["args"] = argparse.Namespace(**saved["args"])
    return state, path, False, None


def _update_microbatches(consumed: int) -> None:
    from megatron.core import num_microbatches_calculator as nmc
    if nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        nmc.update_num_microbatches(consumed_samples=consumed, verbose=True)


def install() -> None:
    """Route Megatron's save_checkpoint/load_checkpoint through ckpt_plugins when the run has
    `--ckpt-backend bytecheckpoint`. Idempotent."""
    require_version("megatron", "megatron-core", SUPPORTED, "megatron_ext",
                    "pip install --no-deps megatron-core (docs/install.md)")
    from megatron.training import checkpointing, get_args, training

    if getattr(checkpointing.save_checkpoint, "ckpt_plugins", False):
        return
    native_save, native_load = checkpointing.save_checkpoint, checkpointing.load_checkpoint

    def ours() -> bool:
        return getattr(get_args(), "ckpt_backend", "native") == BACKEND

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                        *rest, **kwargs):
        if not ours():
            return native_save(iteration, model, optimizer, opt_param_scheduler,
                               num_floating_point_operations_so_far, *rest, **kwargs)
        to = save_to_memory if kwargs.get("non_persistent_ckpt") else save
        to(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far)

    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, *rest, **kwargs):
        result = load(ddp_model, optimizer, opt_param_scheduler, load_arg, strict) if ours() else None
        if result is None:
            return native_load(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *rest, **kwargs)
        return result

    native_step, warm = training.train_step, []

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *rest, **kwargs):
        result = native_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *rest, **kwargs)
        args = get_args()
        if not warm and ours() and args.save and args.save_interval:
            warm.append(True)
            warm_up(model, optimizer, opt_param_scheduler)
        return result

    native_finalize = training.maybe_finalize_async_save
    finalize_committed = committed_first(native_finalize)

    def maybe_finalize_async_save(*args, **kwargs):
        # train() and pretrain() end with a blocking call: every save committed (or its error
        # raised) when they return, as Megatron's own asynchronous saves are
        blocking = kwargs.get("blocking", args[0] if args else False)
        return (finalize_committed if blocking and ours() else native_finalize)(*args, **kwargs)

    native_base = checkpointing._load_base_checkpoint

    def _load_base_checkpoint(load_dir, args, rank0=False, *rest, **kwargs):
        # --use-checkpoint-args reads the arguments through this (before the global args are set)
        if rank0 and getattr(args, "ckpt_backend", "native") == BACKEND:
            found = checkpoint_run(load_dir, getattr(args, "ckpt_step", None))
            if found is not None:
                return found
        return native_base(load_dir, args, rank0, *rest, **kwargs)

    save_checkpoint.ckpt_plugins = load_checkpoint.ckpt_plugins = True
    for module in (checkpointing, training):  # training imported them by name
        module.save_checkpoint, module.load_checkpoint = save_checkpoint, load_checkpoint
    checkpointing._load_base_checkpoint = _load_base_checkpoint
    training.train_step, training.maybe_finalize_async_save = train_step, maybe_finalize_async_save
