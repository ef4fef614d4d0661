"""Demo: save an FSDP2-sharded model + AdamW on 2 processes, reshard, load it in 1 process.

Run: .venv/bin/python examples/demo.py   (CPU, gloo on 127.0.0.1; cleans up after itself)
"""
import os
import shutil
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

import ckpt_plugins as cp


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(101, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 101))


def step(model, opt, seed):
    ids = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(seed))
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def trainer(rank, world, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = make_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(2):
        step(model, opt, i)
    info = cp.save(path, {"model": model, "optim": opt, "extra": {"step": 2}}, framework="fsdp2",
                   layout={"dp_shard": world}, step=2)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(full, os.path.join(os.path.dirname(path), "reference.pt"))
        print(f"[save] 2 ranks, FSDP2 Shard(0): {info.total_bytes / 1e3:.1f} kB, "
              f"byte balance {info.balance:.2f}, committed in {info.timings['stall'] * 1e3:.0f} ms "
              f"(slowest: rank {info.summary()['slowest_rank']}, {info.summary()['slowest_phase']})")
    dist.destroy_process_group()


def main():
    root = tempfile.mkdtemp(prefix="ckpt_demo_")
    try:
        path = os.path.join(root, "step2")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(trainer, args=(2, port, path), nprocs=2, join=True)
        model = nn.Sequential(nn.Embedding(101, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 101))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        extra = {"step": 0}
        cp.load(path, {"model": model, "optim": opt, "extra": extra})
        reference = torch.load(os.path.join(root, "reference.pt"))
        assert all(torch.equal(p, reference[n]) for n, p in model.named_parameters())
        print(f"[load] 1 process, plain tensors: {len(reference)} tensors equal bit for bit, "
              f"AdamW state restored, step {extra['step']}")
        loss = step(model, opt, 2)
        print(f"[train] step 3 on 1 process after resharding: loss {loss:.4f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
