"""An accelerate training loop whose `accelerator.save_state` / `accelerator.load_state` go through ckpt_plugins.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --ckpt-dir /tmp/ckpt_accelerate_loop --steps 4
    torchrun --standalone --nproc-per-node 1 examples/accelerate_loop.py --ckpt-dir /tmp/ckpt_accelerate_loop --steps 6

The first command trains steps 1-4 on 2 processes and saves `step_4`; the second resumes from it on
1 process (the checkpoint reshards on load) and trains to step 6.

What switches ckpt_plugins on (see `main`): one call once the objects are prepared,
    import hf_ext.accelerate
    hf_ext.accelerate.enable(accelerator)
after which accelerate's own `save_state(dir)` / `load_state(dir)` write and read ckpt_plugins
checkpoints: the prepared model, optimizer, registered objects and RNG states, as accelerate keeps them.
"""
import argparse
import os

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import ckpt_plugins as cp
import hf_ext.accelerate

VOCAB, SEQ = 100, 16
GLOBAL_BATCH = 4  # rows per step, split evenly over the processes
HELD_OUT_SEED = 2**32  # a seed no training step uses


class Progress:
    """The training step. Registered with the accelerator, so every checkpoint carries it."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def tokens(seed, rows):
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def eval_loss(model, device):
    """Loss on a fixed held-out batch, the whole batch on every process: the value does not
    depend on the number of processes."""
    ids = tokens(HELD_OUT_SEED, 8).to(device)
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    model.train()
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, required=True, help="the global step to train until")
    args = parser.parse_args()

    # one process per GPU; without GPUs accelerate joins torchrun's processes only when told cpu=True
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)  # the same initial weights on every process
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # --8<-- [start:switch]
    model, opt = accelerator.prepare(model, opt)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    # save_state/load_state now go through ckpt_plugins; a load proves the state holds what it loaded
    hf_ext.accelerate.enable(accelerator, verify=True)
    # --8<-- [end:switch]

    os.makedirs(args.ckpt_dir, exist_ok=True)
    runs = cp.CheckpointManager(args.ckpt_dir)  # its step_N directories; only committed ones count
    newest = runs.latest()
    if newest is not None:
        accelerator.load_state(runs.path(newest))
        loss = eval_loss(model, accelerator.device)
        accelerator.print(f"resumed at step {progress.step} on {accelerator.num_processes} processes", flush=True)
        accelerator.print(f"eval loss {loss!r}", flush=True)

    for step in range(progress.step + 1, args.steps + 1):
        # this process's rows of the step's batch
        ids = tokens(step, GLOBAL_BATCH)[accelerator.process_index::accelerator.num_processes].to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = accelerator.gather(loss.detach().reshape(1)).mean().item()
        accelerator.print(f"step {step} loss {mean}", flush=True)
        progress.step = step

    loss = eval_loss(model, accelerator.device)
    accelerator.print(f"eval loss {loss!r}", flush=True)
    accelerator.save_state(runs.path(progress.step))
    accelerator.print(f"saved step {progress.step}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
