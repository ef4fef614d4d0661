"""The HF Trainer (real, DDP over gloo on CPU) saving through hf_ext and resuming on 1 and 2
processes: the resumed run continues the uninterrupted one's loss curve and ends with its weights."""
import json
import os
import shutil

import torch

import ckpt_plugins as cp
from ckpt_plugins._src.storage import storage_for
from ckpt_plugins._src.trace import load_telemetry
from distributed import run_env_ranks
from hf_models import SEQ, VOCAB, tiny_llama

SAMPLES, STEPS, GLOBAL_BATCH = 32, 6, 4
NATIVE = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "rng_state_0.pth", "rng_state_1.pth", "pytorch_model.bin")


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(rank, world, out_dir, resume, result_path, async_save, save_total_limit):
    from transformers import Trainer, TrainingArguments

    import hf_ext.trainer
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=GLOBAL_BATCH // world,
                             max_steps=STEPS, save_strategy="steps", save_steps=2, logging_steps=1,
                             learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1,
                             use_cpu=True, report_to=["tensorboard"], seed=0, dataloader_drop_last=True, ddp_backend="gloo",
                             save_total_limit=save_total_limit, disable_tqdm=True)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=Tokens())
    hf_ext.trainer.enable(trainer, async_save=async_save)
    trainer.train(resume_from_checkpoint=resume)
    if rank == 0:
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        saves = [h for h in trainer.state.log_history if any(k.startswith("ckpt/") for k in h)]
        torch.save({"losses": losses, "weights": weights, "lr": trainer.lr_scheduler.get_last_lr(), "saves": saves},
                   result_path)


def tensorboard_events(log_dir, tag: str) -> list:
    """(step, value) of every `tag` event in the TensorBoard event files under `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = []
    for root, _, files in os.walk(log_dir):
        if any(f.startswith("events.out.tfevents") for f in files):
            acc = EventAccumulator(root)
            acc.Reload()
            if tag in acc.Tags()["scalars"]:
                out += [(e.step, e.value) for e in acc.Scalars(tag)]
    return out


def tensorboard_scalars(log_dir, tag: str) -> dict:
    """step -> value of `tag` in the TensorBoard event files under `log_dir`."""
    return dict(tensorboard_events(log_dir, tag))


def test_trainer_saves_through_ckpt_plugins_and_resumes_on_any_process_count(tmp_path):
    run = tmp_path / "run"
    run_env_ranks(2, train, str(run), None, tmp_path / "full.pt", False, None)
    full = torch.load(tmp_path / "full.pt")
    ckpt4 = run / "checkpoint-4"
    files = set(os.listdir(ckpt4))
    assert {"metadata.json", "trainer_state.json", "config.json", "training_args.bin", "model.safetensors"} <= files
    assert not files & set(NATIVE), files & set(NATIVE)  # kept in ours
    # checkpoint-N stays an HF model directory: from_pretrained reads the weights the checkpoint holds
    from transformers import AutoModelForCausalLM
    ours = tiny_llama(1)
    cp.load(ckpt4, {"model": ours}, strict=False)
    hf = AutoModelForCausalLM.from_pretrained(ckpt4)
    assert hf.state_dict().keys() == ours.state_dict().keys()
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in hf.state_dict().items())
    meta = cp.read_metadata(ckpt4)
    assert meta.step == 4 and meta.world_size == 2 and "sched/last_epoch" in meta.objects
    assert json.loads(open(ckpt4 / "trainer_state.json").read())["global_step"] == 4
    # every save's figures went to the loggers (the TensorBoard callback, in its default log dir, with
    # its "train/" prefix), not into the training's own record
    assert full["saves"] == []
    for tag in ("stall_s", "save_gib", "commit_s"):
        scalars = tensorboard_scalars(run / "runs", f"train/ckpt/{tag}")
        assert sorted(scalars) == [2, 4, 6] and all(v > 0 for v in scalars.values()), (tag, scalars)
    # the warm-up after step 1 planned the first save and faulted its staging in beside training
    for r in load_telemetry(storage_for(str(run / "checkpoint-2")))["ranks"]:
        assert r.phase("plan").info["cached"] and r.phase("staging").bytes == 0, r

    for world in (2, 1):
        out = tmp_path / f"resume{world}"
        shutil.copytree(ckpt4, out / "checkpoint-4")
        run_env_ranks(world, train, str(out), str(out / "checkpoint-4"), tmp_path / f"r{world}.pt", False, None)
        resumed = torch.load(tmp_path / f"r{world}.pt")
        assert sorted(resumed["losses"]) == list(range(1, STEPS + 1))  # steps 1-4 from trainer_state.json
        assert resumed["lr"] == full["lr"]  # the scheduler carried on
        for step, loss in resumed["losses"].items():
            if world == 2:  # same processes, same arithmetic: identical
                assert loss == full["losses"][step]
            else:  # one process sums the 4-sample batch in another order than two processes do
                assert abs(loss - full["losses"][step]) <= 1e-5 * abs(full["losses"][step])
        for k, w in full["weights"].items():
            if world == 2:
                assert torch.equal(resumed["weights"][k], w), k
            else:
                torch.testing.assert_close(resumed["weights"][k], w, rtol=1e-4, atol=1e-6)


def test_trainer_async_saves_rotate_only_committed_checkpoints(tmp_path):
    run = tmp_path / "run"
    run_env_ranks(2, train, str(run), None, tmp_path / "full.pt", True, 2)
    assert sorted(os.listdir(run)) == ["checkpoint-4", "checkpoint-6", "runs"]
    # async: each save is logged once it has committed (at a later step), under its own step
    assert sorted(value for _, value in tensorboard_events(run / "runs", "train/ckpt/step")) == [2, 4, 6]
    for name in ("checkpoint-4", "checkpoint-6"):
        assert cp.read_metadata(run / name).step == int(name.split("-")[1])  # committed, whole


def overlapped_run(rank, world, out_dir, result_path, device):
    """async_save=True (overlapped by default) with gradient accumulation: the save at step 2 returns before its snapshot,
    which here starts only once the optimizer's next step is due; the two forward and backward
    passes of step 3 run beside it, and the step waits for it. With a host-memory budget below the
    save, which then streams through it, compressed. `device`: where the Trainer trains."""
    import threading

    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hf_ext.trainer
    from faults import snapshots_held
    seen = {}

    class Watch(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:  # what checkpoint-2 must hold (the run saves again at its end)
                seen["saved"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                seen["snapshot taken before the save returned"] = cp.checkpointer()._last._snapshot.is_set()
                seen["handle"] = cp.checkpointer()._last

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if "saved" in seen and "timer" not in seen:  # the snapshot may start 0.3 s after the step was due
                seen["timer"] = threading.Timer(0.3, go.set)
                seen["timer"].start()

    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=3, save_strategy="steps", save_steps=2, learning_rate=1e-2,
                             use_cpu=device == "cpu", report_to=[], seed=0, disable_tqdm=True)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=Tokens(), callbacks=[Watch()])
    assert trainer.model.device.type == device
    hf_ext.trainer.enable(trainer, async_save=True, host_memory="64KiB", compress=True)
    with snapshots_held() as go:
        trainer.train()
    # bigger than the budget: streamed through it, the snapshot waiting for the writes
    assert seen["handle"].wait().rank_bytes > 64 << 10 >= cp.checkpointer().pool.allocated_bytes > 0
    assert any(b.group for t in cp.read_metadata(seen["handle"].path).tensors.values() for b in t.boxes)
    torch.save({"saved": seen["saved"], "early": seen["snapshot taken before the save returned"],
                "final": {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}}, result_path)


def test_an_overlapped_trainer_save_holds_the_optimizer_step_not_the_accumulation_steps(tmp_path):
    check_overlapped_trainer_save(tmp_path, "cpu")


def check_overlapped_trainer_save(tmp_path, device):
    """The overlapped save of `overlapped_run` holds step 2's weights (loaded on CPU), and step 3 trained."""
    run_env_ranks(1, overlapped_run, str(tmp_path / "run"), tmp_path / "seen.pt", device)
    seen = torch.load(tmp_path / "seen.pt")
    assert seen["early"] is False
    model = tiny_llama(5)
    cp.load(tmp_path / "run" / "checkpoint-2", {"model": model}, strict=False)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in seen["saved"].items())
    assert not all(torch.equal(seen["final"][k], v) for k, v in seen["saved"].items())  # step 3 trained


class Indexed(Tokens):
    def __getitem__(self, i):
        return {**super().__getitem__(i), "idx": i}


def data_run(rank, world, out_dir, resume, per_device, max_steps, log_path):
    """A Trainer run that logs the index of every sample it trains on (not those its loader
    fetched ahead)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    import hf_ext.trainer
    seen = []

    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=per_device, max_steps=max_steps,
                             save_strategy="steps", save_steps=2, learning_rate=1e-2, use_cpu=True, report_to=[],
                             seed=0, dataloader_drop_last=True, ddp_backend="gloo", disable_tqdm=True,
                             remove_unused_columns=False)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=Indexed(), data_collator=default_data_collator)
    native = trainer.training_step

    def training_step(model, inputs, *rest):
        seen.extend(inputs.pop("idx").tolist())
        return native(model, inputs, *rest)

    trainer.training_step = training_step
    hf_ext.trainer.enable(trainer)
    trainer.train(resume_from_checkpoint=resume)
    with open(f"{log_path}.{rank}", "w") as f:
        json.dump(seen, f)


def consumed(log_path, world):
    return [i for r in range(world) for i in json.loads(open(f"{log_path}.{r}").read())]


def test_trainer_resumes_the_epoch_with_another_global_batch(tmp_path):
    run = tmp_path / "run"
    run_env_ranks(2, data_run, str(run), None, 2, 4, tmp_path / "a")  # global batch 4, 4 steps
    before = consumed(tmp_path / "a", 2)
    assert len(before) == len(set(before)) == 16
    assert cp.read_metadata(run / "checkpoint-4").objects["data/position"]
    # one process, global batch 2: the rest of the epoch (16 samples, 8 steps), each sample once
    run_env_ranks(1, data_run, str(run), str(run / "checkpoint-4"), 2, 12, tmp_path / "b")
    after = consumed(tmp_path / "b", 1)
    assert sorted(before + after) == list(range(SAMPLES)), (sorted(before), sorted(after))


def changed_data_run(rank, world, out_dir, resume, samples, on_data_change, result_path):
    """A Trainer resuming on a dataset of another length than its checkpoint's."""
    import logging

    from transformers import Trainer, TrainingArguments

    import hf_ext.trainer
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hf_ext.trainer").addHandler(handler)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=4, save_strategy="steps",
                             save_steps=2, learning_rate=1e-2, use_cpu=True, report_to=[], seed=0,
                             dataloader_drop_last=True, disable_tqdm=True)
    data = Tokens()
    data.ids = data.ids[:samples] if samples <= len(data.ids) else data.ids.repeat(2, 1)[:samples]
    type(data).__len__ = lambda self: len(self.ids)
    trainer = hf_ext.trainer.enable(Trainer(model=tiny_llama(0), args=args, train_dataset=data),
                                    on_data_change=on_data_change)
    try:
        trainer.train(resume_from_checkpoint=resume)
        outcome = trainer.state.global_step
    except cp.DataChangedError as exc:
        outcome = str(exc)
    torch.save({"outcome": outcome, "warnings": [r.getMessage() for r in records if r.levelname == "WARNING"]},
               result_path)


def test_a_resume_on_changed_data_warns_as_the_trainer_would_go_on_or_refuses_when_asked(tmp_path):
    run = tmp_path / "run"
    run_env_ranks(1, changed_data_run, str(run), None, 32, "warn", tmp_path / "a.pt")
    run_env_ranks(1, changed_data_run, str(run), str(run / "checkpoint-2"), 40, "warn", tmp_path / "b.pt")
    warned = torch.load(tmp_path / "b.pt")
    assert warned["outcome"] == 4  # the Trainer's own fast-forward over the new data, to the end
    assert any("length 32 -> 40" in w for w in warned["warnings"]), warned["warnings"]
    run_env_ranks(1, changed_data_run, str(run), str(run / "checkpoint-2"), 40, "error", tmp_path / "c.pt")
    assert "length 32 -> 40" in torch.load(tmp_path / "c.pt")["outcome"]
