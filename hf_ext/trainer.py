"""The HF Trainer saving and resuming through ckpt_plugins.

    trainer = Trainer(model=model, args=args, ...)
    hf_ext.trainer.enable(trainer)          # or enable(trainer, async_save=True), or overlap=True
    trainer.train()                          # checkpoint-N/ are ckpt_plugins checkpoints
    trainer.train(resume_from_checkpoint=True)   # on any number of processes

What it changes, on this one Trainer instance (documented because these are Trainer internals):
- `save_model` during a checkpoint save (`_internal_call`): every rank saves the model,
  optimizer, LR scheduler, grad scaler and its RNG states in one collective ckpt_plugins save into
  `checkpoint-N/` (metadata.json + data/), replacing one a rerun left there as the Trainer does; the
  main process writes config.json, the tokenizer and training_args.bin. Once the save has
  committed, the ranks write the model's HF files from it (`model.safetensors`, sharded as
  `save_pretrained` shards; a PEFT model's adapter files), so `checkpoint-N/` stays a directory
  `from_pretrained` reads (`hf_weights=False` turns that off). No optimizer.pt / scheduler.pt /
  rng_state*.pth are written: their contents are in the ckpt_plugins checkpoint. A final
  `trainer.save_model()` from user code stays native.
- `_save_optimizer_and_scheduler`, `_save_rng_state`, `_save_scaler`: nothing left to do.
- `_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_scaler`, `_load_rng_state`,
  `_load_best_model`: read a ckpt_plugins checkpoint-N (resharding to the current layout and
  process count); anything else goes to the native code. The model is loaded together with the
  optimizer, after the Trainer has built it, so its bytes are read once.
- `_get_train_sampler`: the default RandomSampler is replaced by `trainer_data.EpochSampler`;
  `_init_training_state`: a checkpoint with a data position says how many batches the Trainer
  skips (see below). After the first optimizer step a callback warms the first checkpoint save
  up (`Checkpointer.warm_up`).
- Everything else stays native: trainer_state.json (global step, logs, best model, stateful
  callbacks), `save_total_limit` rotation, `on_save`. Each save's figures go to the loggers
  (TensorBoard, W&B, ... through `on_log`), not into `log_history`.
- A PEFT model whose base is frozen: each checkpoint holds the adapters, their optimizer state
  and the rest of the training state, and refers to a base checkpoint for the frozen weights:
  `peft_base=` (the checkpoint the base was loaded from), else `<output_dir>/base`, written once
  at the first save. `adapters_only=False` stores everything in every checkpoint.
- `async_save=True`: a save returns at once, its snapshot runs beside the next forward and
  backward passes, and the optimizer's next step waits for it (with gradient accumulation, the
  step at the accumulation boundary); `overlap=False` returns once the snapshot is taken instead
  (`overlap=True` implies `async_save`). Rotation then waits until the save has committed (at the
  next save or at the end of training), so the newest whole checkpoint is never deleted for one
  still being written.

The training data (with the Trainer's default random sampling): the sampler is replaced by one
whose order is fixed by the seed and the epoch, and each checkpoint stores the data position
globally (`trainer_data`). A resume with the same global batch
(per_device_train_batch_size x processes x gradient_accumulation_steps), on any number of
processes, sees the batches, steps, epochs and learning rates of the uninterrupted run. With
another global batch every remaining sample of the epoch is still consumed once: the Trainer
skips the consumed samples (rounded up to whole steps with placeholders that are never loaded).
When the dataset or sampling changed since the checkpoint, a warning names the change and the
Trainer fast-forwards as it does without ckpt_plugins (`on_data_change="error"` refuses instead);
`ignore_data_skip=True` starts the epoch from the beginning, as the Trainer does. RNG states are
per process; a process the checkpoint has none for keeps its own.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional, Union

import torch

import ckpt_plugins as cp
from ckpt_plugins.ext import (FORMAT_NAME, Order, SaveHooks, StepGate, fit_state, overlapped, read_object,
                              require_version, storage_for)

from .mapping import is_peft_model
from .safetensors_io import HF_CONFIG, write_model_files
from .trainer_data import EpochSampler, TrainerData

log = logging.getLogger("hf_ext.trainer")


def is_ckpt_plugins_checkpoint(path: Optional[str]) -> bool:
    return path is not None and cp.is_checkpoint(path)


DATA_CHANGES = ("warn", "error")
TRANSFORMERS = ("5", "6")  # the Trainer internals this hook replaces, and transformers 5's fused experts


class _Integration:
    def __init__(self, trainer, async_save: bool, overlap: Optional[bool], checkpointer: Optional[cp.Checkpointer],
                 peft_base: Optional[str], adapters_only: bool, hf_weights: bool, on_data_change: str):
        if on_data_change not in DATA_CHANGES:
            raise ValueError(f"on_data_change must be one of {DATA_CHANGES}, not {on_data_change!r}")
        self.trainer = trainer
        self.overlap = overlapped(async_save, overlap)
        self.async_save = async_save or self.overlap
        self.gate = StepGate()  # an overlapped save's snapshot runs until the optimizer's next step
        self.checkpointer = checkpointer
        self.peft_base, self.adapters_only = peft_base, adapters_only
        self.hf_weights, self.on_data_change = hf_weights, on_data_change
        self.native = {}
        self.in_checkpoint = False
        self.pending: Optional[cp.SaveHandle] = None
        self.pending_rotation = None
        self.warmed = False
        self.data: Optional[TrainerData] = None  # the training data's position, once the Trainer built its sampler
        self.init_from: Optional[str] = None
        self.verify = False  # loads prove the live state holds what was loaded

    def ckpt(self) -> cp.Checkpointer:
        return self.checkpointer or cp.checkpointer()

    # ---------------------------------------------------------------- what is saved

    def state(self, with_training_state: bool) -> Dict[str, Any]:
        t = self.trainer
        state: Dict[str, Any] = {"model": t.model}
        if with_training_state:
            if t.optimizer is not None:
                state["optim"] = t.optimizer
            if t.lr_scheduler is not None:
                state["sched"] = t.lr_scheduler
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = cp.RNGState()
            if self.data is not None:
                state["data"] = self.data
        return state

    # ---------------------------------------------------------------- saving

    def _save_checkpoint(self, model, trial) -> None:
        args = self.trainer.args
        self.finish_pending()
        limit = args.save_total_limit
        if self.async_save:
            args.save_total_limit = None  # rotate once this save has committed
        self.in_checkpoint = True
        try:
            self.native["_save_checkpoint"](model, trial)
        finally:
            self.in_checkpoint = False
            args.save_total_limit = limit
        if self.async_save and limit:
            self.pending_rotation = self.trainer._get_output_dir(trial)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        if not (self.in_checkpoint and _internal_call):
            return self.native["save_model"](output_dir, _internal_call)
        t = self.trainer
        output_dir = output_dir or t.args.output_dir
        options = dict(framework="hf-trainer", layout={"world_size": t.args.world_size}, step=t.state.global_step,
                       base=self.base(), overwrite=True,
                       hooks=SaveHooks(then=_model_files(output_dir) if self.hf_weights else None))
        if self.async_save:
            result = self.ckpt().save_async(output_dir, self.saved_state(), overlap=self.overlap, **options)
            self.pending = result
            self.gate.hold(result, t.optimizer)
        else:
            result = self.ckpt().save(output_dir, self.saved_state(), **options)
            self.log_save(result)
        if t.args.should_save:
            _save_side_files(t, output_dir)

    def saved_state(self) -> Dict[str, Any]:
        """What a checkpoint save passes to ckpt_plugins."""
        state = self.state(with_training_state=not self.trainer.args.save_only_model)
        config = _config_json(self.trainer)
        if config is not None:  # a plain torch module has none
            state[HF_CONFIG] = config
        return state

    def warm_up(self) -> None:
        """After the first optimizer step, the first checkpoint save's one-time costs (plan, staging)
        in the background (`Checkpointer.warm_up`). Not when the run saves no checkpoints, nor while
        a PEFT run's base checkpoint is still to be written (its first save writes it)."""
        self.warmed = True
        base = self.base(write=False)
        if self.trainer.args.save_strategy == "no" or (base is None and self.needs_base()):
            return
        self.ckpt().warm_up(self.saved_state(), base=base)

    def needs_base(self) -> bool:
        t = self.trainer
        return self.adapters_only and is_peft_model(t.accelerator.unwrap_model(t.model))

    def base(self, write: bool = True) -> Optional[str]:
        """The base checkpoint a PEFT model's adapter-only saves refer to (None: save everything),
        written at the first save unless `peft_base` named one."""
        t = self.trainer
        if not self.needs_base():
            return None
        if self.peft_base is None:
            path = os.path.join(t.args.output_dir, "base")
            if not write:
                return path if cp.is_checkpoint(path) else None
            if not cp.is_checkpoint(path):
                self.ckpt().save(path, {"model": t.model}, framework="hf-trainer")
            self.peft_base = path
        return self.peft_base

    def finish_pending(self) -> None:
        """Wait for the last async save (raising its error), then apply the rotation it deferred."""
        if self.pending is not None:
            handle, self.pending = self.pending, None
            self.log_save(handle.wait())
        if self.pending_rotation is not None:
            run_dir, self.pending_rotation = self.pending_rotation, None
            if self.trainer.args.should_save:
                from transformers.trainer_utils import rotate_checkpoints
                rotate_checkpoints(output_dir=run_dir, save_total_limit=self.trainer.args.save_total_limit,
                                   best_model_checkpoint=self.trainer.state.best_model_checkpoint, use_mtime=True)

    def log_save(self, info: cp.SaveInfo) -> None:
        """The save's stall, time to commit, size and throughput to every logging callback
        (TensorBoard, W&B, ...) as the Trainer's `log()` sends them, but not into `log_history`:
        that is the training's record, which trainer_state.json keeps and runs are compared by."""
        t = self.trainer
        t.control = t.callback_handler.on_log(t.args, t.state, t.control, info.metrics())

    @staticmethod
    def _nothing(*args, **kwargs) -> None:
        return None

    # ---------------------------------------------------------------- data

    def _get_train_sampler(self, train_dataset=None):
        """The Trainer's random sampler, replaced by one a checkpoint can resume mid-epoch at any
        global batch and process count (`trainer_data`); other strategies stay native."""
        sampler = self.native["_get_train_sampler"](train_dataset)
        if type(sampler) is not torch.utils.data.RandomSampler:
            self.data = None
            return sampler
        t = self.trainer
        seed = t.args.data_seed if t.args.data_seed is not None else t.args.seed
        epochs = EpochSampler(len(sampler.data_source), seed, lambda: t.state.global_step)
        self.data = TrainerData(epochs, lambda: t.args.per_device_train_batch_size * max(1, t.args.world_size)
                                * t.args.gradient_accumulation_steps)
        return epochs

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):
        """The Trainer's own, except that a checkpoint holding the data position says where the
        resumed epoch stands: the position is loaded now (the sampler starts the epoch with the
        consumed samples, which the Trainer skips without loading them), whatever the global
        batch is now."""
        epochs, steps = self.native["_init_training_state"](max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                            resume_from_checkpoint, trial)
        args = self.trainer.args
        if self.data is None or args.ignore_data_skip or not is_ckpt_plugins_checkpoint(resume_from_checkpoint):
            return epochs, steps
        storage = storage_for(resume_from_checkpoint)
        metadata = cp.read_metadata(storage)
        if "data/position" not in metadata.objects:  # saved before the data was kept
            return epochs, steps
        changes = self.data.sampler.order.changes(Order(**read_object(storage, metadata, "data/position", None)["order"]))
        if changes:
            what = ", ".join(f"{name} {was!r} -> {now!r}" for name, (was, now) in changes.items())
            if self.on_data_change == "error":
                raise cp.DataChangedError(f"the training data changed since {resume_from_checkpoint}: {what}")
            log.warning("the training data changed since %s (%s): its position cannot be resumed; the Trainer "
                        "skips %d batch(es) of the new data, as it does without ckpt_plugins", resume_from_checkpoint,
                        what, steps)
            return epochs, steps
        self.ckpt().load(resume_from_checkpoint, {"data": self.data}, strict=False)
        batch = args.per_device_train_batch_size * max(1, args.world_size)
        epoch, skipped = self.data.sampler.resume_front(batch * args.gradient_accumulation_steps)
        return epoch, skipped // batch

    # ---------------------------------------------------------------- loading

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not is_ckpt_plugins_checkpoint(resume_from_checkpoint):
            return self.native["_load_from_checkpoint"](resume_from_checkpoint, model)
        cp.read_metadata(resume_from_checkpoint)  # fail early on a bad checkpoint; weights come with the optimizer

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if not is_ckpt_plugins_checkpoint(checkpoint):
            return self.native["_load_optimizer_and_scheduler"](checkpoint)
        # RNG states are restored where the Trainer restores them: after skipping batches; the data
        # position was loaded with the training state (or does not apply)
        state = {**self.state(with_training_state=True), "rng": cp.Ignore(), HF_CONFIG: cp.Ignore(),
                 "data": cp.Ignore()}
        self.ckpt().load(checkpoint, state, verify=self.verify)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's own. `resume_from_checkpoint` at another framework's checkpoint (a DCP one,
        an HF directory: no trainer_state.json, so nothing to resume) starts the run from it, as
        `init_from` does, at step 0."""
        path = resume_from_checkpoint
        fmt = cp.checkpoint_format(path) if isinstance(path, (str, os.PathLike)) and not os.path.isfile(
            os.path.join(path, "trainer_state.json")) else None
        if fmt not in (None, FORMAT_NAME):
            log.info("%s is a %s checkpoint, not the Trainer's: the run starts from it at step 0", path, fmt)
            self.init_from, resume_from_checkpoint = str(path), None
        return self.native["train"](resume_from_checkpoint, *args, **kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The Trainer's own; then a run that does not resume starts from `init_from`."""
        out = self.native["_prepare_for_training"](max_steps, train_dataloader, resume_from_checkpoint)
        if resume_from_checkpoint is None and self.init_from is not None:
            self._init(self.init_from)
        return out

    def _init(self, path: str) -> None:
        """A new run starts from another checkpoint (`init_from`: an HF directory, a DCP checkpoint
        such as torchtitan's, one of ours): the model and whatever optimizer state it holds, into
        the prepared (wrapped, sharded) model, reading each byte once; the rest is named."""
        state = {k: v for k, v in self.state(with_training_state=True).items() if k in ("model", "optim")}
        state, absent = fit_state(state, cp.read_metadata(path))
        if absent:
            log.warning("%s (%s) holds no %s: starting it fresh", path, cp.checkpoint_format(path), ", ".join(absent))
        self.ckpt().load(path, state, verify=self.verify)

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        if not is_ckpt_plugins_checkpoint(checkpoint):
            return self.native["_load_rng_state"](checkpoint)
        result = self.ckpt().load(checkpoint, {"rng": cp.RNGState()}, strict=False)
        if result.kept_per_rank:
            log.info("checkpoint %s has no RNG state for this process; keeping the current one", checkpoint)

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        if not is_ckpt_plugins_checkpoint(checkpoint):
            return self.native["_load_scaler"](checkpoint)

    def _load_best_model(self) -> None:
        best = self.trainer.state.best_model_checkpoint
        if not is_ckpt_plugins_checkpoint(best):
            return self.native["_load_best_model"]()
        rest = {k: cp.Ignore() for k in ("optim", "sched", "scaler", "rng", "data", HF_CONFIG)}
        self.ckpt().load(best, {"model": self.trainer.model, **rest}, verify=self.verify)

    def on_train_end(self) -> None:
        self.finish_pending()


def _model_files(output_dir: str):
    """A save's step after its commit (`SaveHooks.then`): every rank writes its share of
    the model's HF files from the committed checkpoint; any rank's failure is the save's."""
    def then(coord, info) -> None:
        coord.agreed(lambda: write_model_files(output_dir, output_dir, rank=coord.rank, world=coord.world_size,
                                               config=False),
                     what=f"writing the model's HF files into {output_dir}",
                     then="The checkpoint is committed; from_pretrained cannot read the directory")
    return then


def _config_json(trainer) -> Optional[str]:
    config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
    return config.to_json_string() if config is not None else None


def _save_side_files(trainer, output_dir: str) -> None:
    """What `Trainer._save` writes besides the weights: config, generation config, tokenizer, args."""
    from transformers.trainer import TRAINING_ARGS_NAME
    os.makedirs(output_dir, exist_ok=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    if getattr(model, "config", None) is not None:
        model.config.save_pretrained(output_dir)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(output_dir)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(output_dir)
    elif getattr(trainer.data_collator, "tokenizer", None) is not None:  # as the Trainer's own _save
        trainer.data_collator.tokenizer.save_pretrained(output_dir)
    torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


_HOOKS = ("_save_checkpoint", "save_model", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
          "_load_rng_state", "_load_scaler", "_load_best_model", "_get_train_sampler", "_init_training_state",
          "_prepare_for_training", "train")
_NO_OPS = ("_save_optimizer_and_scheduler", "_save_rng_state", "_save_scaler")


def enable(trainer, *, async_save: bool = False, overlap: Optional[bool] = None, checkpointer: Optional[cp.Checkpointer] = None,
           peft_base: Optional[str] = None, adapters_only: bool = True, hf_weights: bool = True,
           on_data_change: str = "warn", init_from: Optional[str] = None, verify: bool = False,
           host_memory: Union[int, str, None] = None, compress: Union[bool, str, None] = None):
    """Make `trainer` save and resume through ckpt_plugins (see the module docstring). Returns it.

    `async_save`: saves return at once, the optimizer's next step waiting for the snapshot;
    `overlap=False`: once their snapshot is taken. `hf_weights`: write the model's HF files into
    each checkpoint too (from_pretrained reads it).
    `on_data_change`: "warn" (the Trainer's own fast-forward) or "error" when a resume finds the
    training data changed since its checkpoint. `init_from`: a checkpoint a run that does not
    resume starts from (HF safetensors, PyTorch DCP, ours): its model and any optimizer state.
    `verify`: every load then proves the live model and optimizer hold what was loaded
    (`ckpt_plugins.load(verify=True)`). `host_memory` (bytes, or a size such as "8GiB"): the most
    host memory a rank stages saves in; a bigger save streams through it. `compress`: tensors stored
    losslessly compressed where that shrinks them, or with "auto" only where that also shortens the
    commit (needs zstandard); None leaves the checkpointer's setting."""
    require_version("transformers", "transformers", TRANSFORMERS, "hf_ext.trainer")
    from transformers import TrainerCallback

    integration = _Integration(trainer, async_save, overlap, checkpointer, peft_base, adapters_only, hf_weights,
                               on_data_change)
    integration.init_from = None if init_from is None else str(init_from)
    integration.verify = verify
    if host_memory is not None:
        integration.ckpt().host_memory = host_memory
    if compress is not None:
        integration.ckpt().compress = compress
    for name in _HOOKS:
        integration.native[name] = getattr(trainer, name)
        setattr(trainer, name, getattr(integration, name))
    for name in _NO_OPS:
        setattr(trainer, name, integration._nothing)

    class _Saves(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if not integration.warmed:
                integration.warm_up()

        def on_train_end(self, args, state, control, **kwargs):
            integration.on_train_end()

    trainer.add_callback(_Saves())
    trainer._ckpt_plugins = integration
    return trainer
