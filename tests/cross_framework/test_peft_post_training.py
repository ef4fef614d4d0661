"""Post-training with PEFT: a Llama pre-trained in Megatron at TP2 → LoRA fine-tuning in the HF
Trainer on 2 processes, whose checkpoints hold only the adapters and their training state and
refer to the Megatron checkpoint for the frozen base → resumed on 1 process, the losses going on
→ exported as a PEFT adapter and as a merged model, both computing the fine-tuned logits →
loaded under FSDP2, bit for bit."""
import json
import os
import shutil

import torch

import ckpt_plugins as cp
from bcp_cli import bcp
from distributed import run_env_ranks, run_ranks
from endpoints import Tokens, batch, hf_model, pretrain

IDS = batch(20)


def lora(model):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))


def finetune(rank, world, root, out, resume):
    from transformers import Trainer, TrainingArguments
    import hf_ext.trainer
    megatron = os.path.join(root, "megatron_tp2")
    model = lora(hf_model("llama", 9))
    if resume is None:  # the base from the pre-training checkpoint; its optimizer state is not wanted
        result = cp.load(megatron, {"model": model}, strict=False)
        assert all(k.startswith("model/adapter/") for k in result.missing_keys), result.missing_keys
    args = TrainingArguments(output_dir=os.path.join(root, out), per_device_train_batch_size=4 // world, max_steps=4,
                             save_strategy="steps", save_steps=2, logging_steps=1, learning_rate=1e-2,
                             lr_scheduler_type="linear", use_cpu=True, report_to=[], seed=0, disable_tqdm=True,
                             dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(30, 4))
    hf_ext.trainer.enable(trainer, peft_base=megatron)
    trainer.train(resume_from_checkpoint=resume)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        torch.save({"losses": losses, "logits": logits}, os.path.join(root, out + ".pt"))


def fsdp2_load(rank, world, root):
    from torch.distributed.fsdp import fully_shard
    model = lora(hf_model("llama", 11))
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    path = os.path.join(root, "ft", "checkpoint-4")
    result = cp.load(path, {"model": model, "optim": opt}, strict=False)
    assert result.missing_keys == [], result.missing_keys
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    full.update({f"{n}/exp_avg": opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()
                 if p.requires_grad})
    if rank == 0:
        torch.save(full, os.path.join(root, "fsdp2.pt"))




def test_megatron_pretraining_to_lora_finetuning_resumes_exports_and_reshards(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    root = str(tmp_path)
    run_ranks(2, pretrain, root, "megatron_tp2", "llama")
    run_env_ranks(2, finetune, root, "ft", None)
    ckpt2, ckpt4 = (os.path.join(root, "ft", f"checkpoint-{s}") for s in (2, 4))
    meta = cp.read_metadata(ckpt2)
    base = cp.read_metadata(os.path.join(root, "megatron_tp2"))
    assert not [k for k in meta.tensors if k.startswith("model/") and not k.startswith("model/adapter/")]
    assert "optim/adapter/default/model.layers.3.self_attn.v_proj.weight/lora_B/exp_avg" in meta.tensors
    weights = lambda m: sum(b.nbytes for k, t in m.tensors.items() if k.startswith("model/") for b in t.boxes)  # noqa
    assert weights(meta) < weights(base) / 10  # the adapters alone

    # resume on 1 process: the base comes from the Megatron checkpoint, the rest from checkpoint-2
    shutil.copytree(ckpt2, os.path.join(root, "resume", "checkpoint-2"))
    run_env_ranks(1, finetune, root, "resume", os.path.join(root, "resume", "checkpoint-2"))
    full, resumed = torch.load(os.path.join(root, "ft.pt")), torch.load(os.path.join(root, "resume.pt"))
    assert sorted(resumed["losses"]) == [1, 2, 3, 4]
    for step in (3, 4):  # one process sums the batch in another order than two do
        assert abs(resumed["losses"][step] - full["losses"][step]) <= 1e-5 * abs(full["losses"][step])

    # PEFT's own format on the exported base, and the merged model: the fine-tuned logits
    bcp("export", ckpt4, tmp_path / "base_hf", "--format", "hf")
    bcp("export", ckpt4, tmp_path / "adapter", "--format", "peft")
    assert json.load(open(tmp_path / "adapter" / "adapter_config.json"))["r"] == 4
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf"),
                                      tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(tuned(input_ids=IDS).logits, full["logits"], rtol=0, atol=1e-5)
    bcp("export", ckpt4, tmp_path / "merged", "--format", "hf", "--merge-adapters")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, full["logits"], rtol=0, atol=1e-5)

    # PEFT's adapter directory imported: the same adapter tensors
    bcp("import-hf", tmp_path / "adapter", tmp_path / "imported")
    imported = cp.read_metadata(tmp_path / "imported")
    stored = cp.read_metadata(ckpt4)
    assert sorted(imported.tensors) == sorted(k for k in stored.tensors if k.startswith("model/adapter/"))

    # the same checkpoint under FSDP2 on 2 processes: what one process loads, bit for bit
    run_ranks(2, fsdp2_load, root)
    sharded = torch.load(os.path.join(root, "fsdp2.pt"))
    model = lora(hf_model("llama", 12))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cp.load(ckpt4, {"model": model, "optim": opt}, strict=False)
    for name, p in model.named_parameters():
        assert torch.equal(p, sharded[name]), name
        if p.requires_grad:
            assert torch.equal(opt.state[p]["exp_avg"], sharded[f"{name}/exp_avg"]), name
