"""A plain PyTorch training loop with FSDP2 and AdamW that saves and resumes with `cp.save` / `cp.load`.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_loop.py --ckpt-dir /tmp/ckpt_fsdp2_loop --steps 4
    torchrun --standalone --nproc-per-node 1 examples/fsdp2_loop.py --ckpt-dir /tmp/ckpt_fsdp2_loop --steps 6

The first command trains steps 1-4 on 2 processes and saves `step_4`; the second resumes from it on
1 process (the checkpoint reshards on load) and trains to step 6.

What switches ckpt_plugins on (see `main`): the state dict of live objects,
    state = {"model": model, "optim": opt, "extra": {"step": 0}}
    cp.load(path, state)                 # in place, into whatever sharding the model has now
    cp.save(path, state, step=step)      # every rank calls it; returns once committed
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckpt_plugins as cp

VOCAB, HIDDEN, LAYERS, SEQ = 100, 32, 3, 16
GLOBAL_BATCH = 4  # rows per step, split evenly over the processes
HELD_OUT_SEED = 2**32  # a seed no training step uses


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    """A next-token model just big enough to have something to shard."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        """Next-token logits, one row per position of `ids`."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))


def loss_of(model, ids):
    return nn.functional.cross_entropy(model(ids[:, :-1]), ids[:, 1:].flatten())


def tokens(seed, rows):
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def eval_loss(model, device):
    """Loss on a fixed held-out batch; every rank computes the whole batch (FSDP's forward is a
    collective), so the value does not depend on the number of processes."""
    model.eval()
    with torch.no_grad():
        loss = loss_of(model, tokens(HELD_OUT_SEED, 8).to(device)).item()
    model.train()
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, required=True, help="the global step to train until")
    args = parser.parse_args()

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    # --8<-- [start:switch]
    # the whole training state, as live objects: cp.load fills them in place
    state = {"model": model, "optim": opt, "extra": {"step": 0}}
    os.makedirs(args.ckpt_dir, exist_ok=True)
    runs = cp.CheckpointManager(args.ckpt_dir)  # its step_N directories; only committed ones count
    newest = runs.latest()
    if newest is not None:
        cp.load(runs.path(newest), state, verify=True)  # and prove the live state holds what it loaded
        loss = eval_loss(model, device)
        if rank == 0:
            print(f"resumed at step {state['extra']['step']} on {world} processes", flush=True)
            print(f"eval loss {loss!r}", flush=True)
    # --8<-- [end:switch]

    for step in range(state["extra"]["step"] + 1, args.steps + 1):
        ids = tokens(step, GLOBAL_BATCH)[rank::world].to(device)  # this rank's rows of the step's batch
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)  # (gloo has no AVG)
        if rank == 0:
            print(f"step {step} loss {total.item() / world}", flush=True)
        state["extra"]["step"] = step

    loss = eval_loss(model, device)
    if rank == 0:
        print(f"eval loss {loss!r}", flush=True)
    step = state["extra"]["step"]
    # --8<-- [start:save]
    cp.save(runs.path(step), state, step=step)
    # --8<-- [end:save]
    if rank == 0:
        print(f"saved step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
