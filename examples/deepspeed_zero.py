"""DeepSpeed ZeRO-3 in bf16 whose `engine.save_checkpoint` / `engine.load_checkpoint` go through ckpt_plugins.

    torchrun --standalone --nproc-per-node 2 examples/deepspeed_zero.py --ckpt-dir /tmp/ckpt_deepspeed_zero --steps 4
    torchrun --standalone --nproc-per-node 1 examples/deepspeed_zero.py --ckpt-dir /tmp/ckpt_deepspeed_zero --steps 6

The first command trains steps 1-4 on 2 processes and saves `global_step4` (and `latest`); the
second resumes from it on 1 process, where DeepSpeed's own checkpoints would refuse the new world
size, and trains to step 6.

What switches ckpt_plugins on (see `main`): one config entry, and initializing through deepspeed_ext,
    config["checkpoint"] = {"backend": "bytecheckpoint"}
    engine, *_ = deepspeed_ext.initialize(model=model, optimizer=opt, config=config)
after which `engine.save_checkpoint(dir)` / `engine.load_checkpoint(dir)` are called as usual.

CPU-only (see `without_gpus`): DeepSpeed would compile a shared-memory all-reduce kernel when it
starts on CPU (minutes, once per machine); this example skips it, gloo carries the few bytes.
The optimizer is torch's AdamW on GPUs and CPU alike: nothing to compile.
"""
import argparse
import importlib
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import deepspeed_ext

VOCAB, SEQ = 100, 16
GLOBAL_BATCH = 4  # rows per step, split evenly over the processes
HELD_OUT_SEED = 2**32  # a seed no training step uses


def without_gpus():
    """CPU only: keep DeepSpeed from compiling its shared-memory communication kernel, which this
    example does not need (patched on the module object DeepSpeed calls it from)."""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def tokens(seed, rows):
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def eval_loss(engine):
    """Loss on a fixed held-out batch, the whole batch on every process (ZeRO-3 gathers the
    weights for it: a collective), so the value does not depend on the number of processes."""
    ids = tokens(HELD_OUT_SEED, 8).to(engine.device)
    engine.eval()
    with torch.no_grad():
        loss = engine(input_ids=ids, labels=ids).loss.float().item()
    engine.train()
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, required=True, help="the global step to train until")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        without_gpus()

    torch.manual_seed(0)  # the same initial weights on every process
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # --8<-- [start:switch]
    config = {
        "train_batch_size": GLOBAL_BATCH,  # DeepSpeed derives each process's share from the world size
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,  # the loop prints its own lines
        # save_checkpoint/load_checkpoint through ckpt_plugins; a load proves the engine holds what it loaded
        "checkpoint": {"backend": "bytecheckpoint", "verify": True},
    }
    engine, *_ = deepspeed_ext.initialize(model=model, optimizer=opt, config=config)
    # --8<-- [end:switch]
    rank, world = dist.get_rank(), dist.get_world_size()

    # DeepSpeed's `latest` names the newest checkpoint; it is written once that one has committed
    if os.path.isfile(os.path.join(args.ckpt_dir, "latest")):
        engine.load_checkpoint(args.ckpt_dir)  # the step counter comes back with the weights
        loss = eval_loss(engine)
        if rank == 0:
            print(f"resumed at step {engine.global_steps} on {world} processes", flush=True)
            print(f"eval loss {loss!r}", flush=True)

    for step in range(engine.global_steps + 1, args.steps + 1):
        ids = tokens(step, GLOBAL_BATCH)[rank::world].to(engine.device)  # this rank's rows of the step's batch
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)  # (gloo has no AVG)
        if rank == 0:
            print(f"step {step} loss {total.item() / world}", flush=True)

    loss = eval_loss(engine)
    if rank == 0:
        print(f"eval loss {loss!r}", flush=True)
    engine.save_checkpoint(args.ckpt_dir)  # global_step<N>/, then `latest`
    if rank == 0:
        print(f"saved step {engine.global_steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
