"""FSDP2 (fully_shard) and DDP through the core's generic adapters, on real gloo groups."""
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import ckpt_plugins as cp
from distributed import run_ranks


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(37, 12), nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 37))


def train(model, opt, steps, seed=0):
    for i in range(steps):
        ids = torch.randint(0, 37, (4, 6), generator=torch.Generator().manual_seed(seed + i))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def snapshot(model, opt):
    named = dict(model.named_parameters())
    out = {f"p/{n}": full(p) for n, p in named.items()}
    for n, p in named.items():
        for k in sorted(opt.state[p]):
            out[f"o/{n}/{k}"] = full(opt.state[p][k])
    return {k.replace("module.", ""): v for k, v in out.items()}


def check(model, opt, ref_path):
    ref, got = torch.load(ref_path), snapshot(model, opt)
    assert sorted(ref) == sorted(got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def fsdp2(world):
    model = make()
    for layer in model[1:]:  # the embedding stays with the root, as models keep embeddings and heads
        if list(layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model


def fsdp2_save(rank, world, path, ref_path):
    model = fsdp2(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    with torch.no_grad():  # an evaluation forward leaves the root's parameters gathered, unsharded
        model(torch.zeros(2, 3, dtype=torch.long))
    cp.save(path, {"model": model, "optim": opt})
    ref = snapshot(model, opt)
    if rank == 0:
        torch.save(ref, ref_path)


def ddp_roundtrip(rank, world, path, ref_path, path2):
    model = DDP(make())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cp.load(path, {"model": model, "optim": opt})  # FSDP2 (2 ranks) -> DDP
    check(model, opt, ref_path)
    info = cp.save(path2, {"model": model, "optim": opt})  # replicated: each box written once
    assert info.total_bytes == cp.read_metadata(path2).total_bytes
    assert _tensor_bytes(path2) == _tensor_bytes(path)
    model2 = fsdp2(world)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    train(model2, opt2, 1)
    with torch.no_grad():
        model2(torch.zeros(2, 3, dtype=torch.long))
    cp.load(path2, {"model": model2, "optim": opt2})  # DDP -> FSDP2
    check(model2, opt2, ref_path)
    assert opt2.param_groups[0]["lr"] == 1e-2


def _tensor_bytes(path):
    return sum(b.nbytes for t in cp.read_metadata(path).tensors.values() for b in t.boxes)


def test_fsdp2_to_ddp_to_fsdp2_and_single_process(tmp_path):
    a, b, ref = str(tmp_path / "fsdp2"), str(tmp_path / "ddp"), str(tmp_path / "ref")
    run_ranks(2, fsdp2_save, a, ref)
    run_ranks(2, ddp_roundtrip, a, ref, b)
    meta = cp.read_metadata(b)
    assert "model/0.weight" in meta.tensors and not any("module." in k for k in meta.tensors)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cp.load(b, {"model": model, "optim": opt})
    check(model, opt, ref)
