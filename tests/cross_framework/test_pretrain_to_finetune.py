"""The worked example of docs/guides/across-frameworks.md: a Qwen3-MoE pre-trained in Megatron with EP2 on 2 processes, exported
with its config.json, fine-tuned in the HF Trainer on 1 process (its experts fused), whose
checkpoint loads back into Megatron EP2, weights and Adam moments bit for bit. (On CPU accelerate
runs the Trainer's FSDP settings as DDP; FSDP2's handling of the same model is the matrix's.)"""
import os


import ckpt_plugins as cp
from bcp_cli import bcp
from checkpoint_compare import assert_matches
from distributed import run_env_ranks, run_ranks
from endpoints import Tokens, build, close, pretrain



def finetune(rank, world, root):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    import hf_ext.trainer
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf"))
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"  # fused
    args = TrainingArguments(output_dir=os.path.join(root, "finetune"), per_device_train_batch_size=4, max_steps=2,
                             save_strategy="steps", save_steps=2, learning_rate=1e-3, use_cpu=True, report_to=[],
                             seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(10, 2))
    hf_ext.trainer.enable(trainer)
    trainer.train()


def back_to_megatron(rank, world, root):
    endpoint = build("megatron_ep2", 7, "qwen3_moe")
    path = os.path.join(root, "finetune", "checkpoint-2")
    result = cp.load(path, {"model": endpoint.state["model"], "optim": endpoint.state["optim"]}, strict=False)
    assert not result.missing_keys, result.missing_keys
    assert_matches(path, endpoint.state)
    close(endpoint)


def test_megatron_ep_pretraining_to_trainer_finetuning_and_back(tmp_path):
    root = str(tmp_path)
    run_ranks(2, pretrain, root, "megatron_ep2", "qwen3_moe")
    bcp("export", os.path.join(root, "megatron_ep2"), os.path.join(root, "hf"), "--format", "hf")
    run_env_ranks(1, finetune, root)
    meta = cp.read_metadata(os.path.join(root, "finetune", "checkpoint-2"))
    assert meta.step == 2 and "optim/model.layers.1.mlp.experts.2.gate_proj.weight/exp_avg" in meta.tensors
    run_ranks(2, back_to_megatron, root)
