"""The HF Trainer on a tiny Llama whose `checkpoint-N` folders are ckpt_plugins checkpoints that resume on any number of processes.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --ckpt-dir /tmp/ckpt_hf_trainer --steps 4
    torchrun --standalone --nproc-per-node 1 examples/hf_trainer.py --ckpt-dir /tmp/ckpt_hf_trainer --steps 6

The first command trains steps 1-4 on 2 processes and saves `checkpoint-4`; the second resumes from
it on 1 process (same global batch: 2 x 2 rows, then 1 x 4) and trains to step 6.

What switches ckpt_plugins on (see `main`): one call on the Trainer,
    import hf_ext.trainer
    hf_ext.trainer.enable(trainer)
    trainer.train(resume_from_checkpoint=True)    # the newest checkpoint-N, when there is one
"""
import argparse
import os

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainerCallback,
                          TrainingArguments)
from transformers.trainer_utils import get_last_checkpoint

import hf_ext.trainer

VOCAB, SEQ = 100, 16
GLOBAL_BATCH = 4  # rows per step, split evenly over the processes
HELD_OUT_SEED = 2**32  # a seed no training sample uses


class Tokens(torch.utils.data.Dataset):
    """Generated token rows, sample i drawn from a generator seeded with i; the Trainer's seeded
    sampler deals them to steps and processes."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = tokens(i, 1)[0]
        return {"input_ids": ids, "labels": ids}


def tokens(seed, rows):
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def eval_loss(model):
    """Loss on a fixed held-out batch, the whole batch on every process: the value does not
    depend on the number of processes."""
    ids = tokens(HELD_OUT_SEED, 8).to(model.device)
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    model.train()
    return loss


class Report(TrainerCallback):
    """Prints the resume, each step's loss and the held-out loss before each save (main process)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step > 0:  # resumed: trainer_state.json, the weights and optimizer are loaded
            loss = eval_loss(model)
            if state.is_world_process_zero:
                print(f"resumed at step {state.global_step} on {args.world_size} processes", flush=True)
                print(f"eval loss {loss!r}", flush=True)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if "loss" not in logs:
            return
        if state.is_world_process_zero:
            print(f"step {state.global_step} loss {logs['loss']}", flush=True)
        if control.should_save:  # the checkpoint follows this step's log
            loss = eval_loss(model)
            if state.is_world_process_zero:
                print(f"eval loss {loss!r}", flush=True)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"saved step {state.global_step}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, required=True, help="the global step to train until")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    training = TrainingArguments(
        output_dir=args.ckpt_dir, max_steps=args.steps, per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=1e-2, weight_decay=0.1, lr_scheduler_type="constant", seed=0,
        save_strategy="steps", save_steps=args.steps, logging_steps=1, report_to="none", disable_tqdm=True,
        ddp_find_unused_parameters=False,
        use_cpu=not torch.cuda.is_available())  # without GPUs, torchrun's processes join only with use_cpu
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))
    # --8<-- [start:switch]
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=[Report()])
    trainer.remove_callback(PrinterCallback)  # Report prints instead of the raw log dicts
    # checkpoint-N/ are now ckpt_plugins checkpoints; a resume proves the state holds what it loaded
    hf_ext.trainer.enable(trainer, verify=True)

    resume = os.path.isdir(args.ckpt_dir) and get_last_checkpoint(args.ckpt_dir) is not None
    trainer.train(resume_from_checkpoint=resume)
    # --8<-- [end:switch]
    # torch asks each process to destroy its groups before exit, which the Trainer leaves to the
    # script: without it, gloo's threads now and then abort the exit ("terminate called without an
    # active exception", pytorch/pytorch#190489)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
