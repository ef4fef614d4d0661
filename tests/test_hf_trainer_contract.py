"""The HF Trainer's contract with the plugin switched on: the same short training (gradient
accumulation with a partial last step per epoch, two epochs), stock and through hf_ext, uninterrupted
and interrupted-and-resumed, gives the outcomes a Trainer user sees: steps, epochs, learning rates,
checkpoint directories `from_pretrained` reads, trainer_state.json, and (resumed) the same batches,
losses and weights. The one deliberate difference: the plugin's sampler draws its own (seeded)
order, so stock and plugin runs train on other batches."""
import json
import os
import shutil

import torch

from distributed import exit_without_teardown, run_env_ranks
from hf_models import tiny_llama
from test_hf_trainer import Tokens

SAMPLES = 36  # 9 micro-batches of 2 x 2 per epoch: 5 optimizer steps, the last with one micro-batch
MAX_STEPS, SAVE_STEPS = 8, 3
TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}


class Samples(Tokens):
    """Each sample names itself (`idx`), so a run's batches can be compared."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {**super().__getitem__(i % len(self.ids)), "idx": i}


def run(rank, world, out_dir, resume, plugin, per_device, result_path):
    from transformers import Trainer, TrainingArguments, default_data_collator

    import hf_ext.trainer
    seen = []
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=2,
                             max_steps=MAX_STEPS, save_strategy="steps", save_steps=SAVE_STEPS, logging_steps=1,
                             learning_rate=1e-2, lr_scheduler_type="linear", use_cpu=True, report_to=[], seed=0,
                             ddp_backend="gloo", disable_tqdm=True, remove_unused_columns=False)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=Samples(), data_collator=default_data_collator)
    native = trainer.training_step

    def training_step(model, inputs, *rest):
        seen.append((trainer.state.global_step, inputs.pop("idx").tolist()))
        return native(model, inputs, *rest)

    trainer.training_step = training_step
    if plugin:
        hf_ext.trainer.enable(trainer)
    trainer.train(resume_from_checkpoint=resume)
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, seen) if world > 1 else gathered.__setitem__(0, seen)
    if rank == 0:
        by_step = {}
        for rank_seen in gathered:
            for step, ids in rank_seen:
                by_step.setdefault(step + 1, []).extend(ids)
        torch.save({"log": [{k: v for k, v in h.items() if k not in TIMING} for h in trainer.state.log_history],
                    "samples": {s: sorted(ids) for s, ids in by_step.items()},
                    "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}, result_path)
    exit_without_teardown()


def trainer_state(path) -> dict:
    state = json.loads(open(os.path.join(path, "trainer_state.json")).read())
    state["log_history"] = [{k: v for k, v in h.items() if k not in TIMING} for h in state["log_history"]]
    return state


def per_step(log, key):
    return {h["step"]: h[key] for h in log if key in h}


def test_trainer_with_the_plugin_keeps_the_trainers_steps_epochs_checkpoints_and_resumes_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    runs = {}
    for name, plugin in (("stock", False), ("ours", True)):
        out = tmp_path / name
        run_env_ranks(2, run, str(out), None, plugin, 2, tmp_path / f"{name}.pt")
        resumed = tmp_path / f"{name}-resumed"  # in the run's own output_dir: it saves steps 6 and 8 again
        shutil.copytree(out, resumed)
        run_env_ranks(2, run, str(resumed), str(resumed / "checkpoint-3"), plugin, 2, tmp_path / f"{name}-r.pt")
        runs[name], runs[f"{name}-resumed"] = torch.load(tmp_path / f"{name}.pt"), torch.load(tmp_path / f"{name}-r.pt")
    ours, stock = runs["ours"], runs["stock"]
    # what the Trainer's user sees is the stock Trainer's: steps, epochs, learning rates, directories
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "stock")) == \
        ["checkpoint-3", "checkpoint-6", "checkpoint-8"]
    for key in ("epoch", "learning_rate"):
        assert per_step(ours["log"], key) == per_step(stock["log"], key), key
    assert sorted(per_step(ours["log"], "loss")) == list(range(1, MAX_STEPS + 1))
    for ckpt in ("checkpoint-3", "checkpoint-6", "checkpoint-8"):
        a, b = trainer_state(tmp_path / "ours" / ckpt), trainer_state(tmp_path / "stock" / ckpt)
        assert {k: v for k, v in a.items() if k != "log_history"} == {k: v for k, v in b.items() if k != "log_history"}
        assert [sorted(h) for h in a["log_history"]] == [sorted(h) for h in b["log_history"]]
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours" / ckpt)  # still an HF model directory
        assert hf.state_dict().keys() == AutoModelForCausalLM.from_pretrained(tmp_path / "stock" / ckpt).state_dict().keys()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "ours" / "checkpoint-8").state_dict()
    assert all(torch.equal(v, ours["weights"][k]) for k, v in final.items())
    # every sample once per epoch, the partial last step included
    epoch0 = [i for s in range(1, 6) for i in ours["samples"][s]]
    assert sorted(epoch0) == list(range(SAMPLES))
    # interrupted at step 3 and resumed in the same output_dir (checkpoints 6 and 8 are replaced): the
    # uninterrupted run, as stock resumes
    for name in ("ours", "stock"):
        full, resumed = runs[name], runs[f"{name}-resumed"]
        assert sorted(os.listdir(tmp_path / f"{name}-resumed")) == ["checkpoint-3", "checkpoint-6", "checkpoint-8"]
        after = [h for h in full["log"] if h.get("step", 0) > 3]
        assert [h for h in resumed["log"] if h.get("step", 0) > 3] == after, name
        assert {s: v for s, v in resumed["samples"].items()} == {s: v for s, v in full["samples"].items() if s > 3}
        assert all(torch.equal(resumed["weights"][k], v) for k, v in full["weights"].items()), name
        assert trainer_state(tmp_path / f"{name}-resumed" / "checkpoint-8") == trainer_state(tmp_path / name / "checkpoint-8")
    # resumed on one process with the same global batch: the same samples, steps, epochs, rates
    one = tmp_path / "ours-one"
    shutil.copytree(tmp_path / "ours" / "checkpoint-6", one / "checkpoint-6")
    run_env_ranks(1, run, str(one), str(one / "checkpoint-6"), True, 4, tmp_path / "one.pt")
    single = torch.load(tmp_path / "one.pt")
    assert single["samples"] == {s: v for s, v in ours["samples"].items() if s > 6}
    for key in ("epoch", "learning_rate"):
        assert per_step(single["log"], key) == per_step(ours["log"], key)  # steps 1-6 from trainer_state.json
