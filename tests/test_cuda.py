"""The engine's CUDA paths: pinned staging, device-to-host snapshots, loads into device tensors.

CI has no GPU, so these run where one is present (docs/benchmarks.md, "GPU checks"); elsewhere they are skipped.
"""
import pytest
import torch
from torch import nn

import ckpt_plugins as cp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def trained(device, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512, bias=False)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 512, device=device)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def host_values(model, opt):
    out = {f"p/{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for i, (p, s) in enumerate(opt.state.items()):
        out.update({f"o/{i}/{k}": v.detach().cpu().clone() for k, v in s.items()})
    return out


def mutate(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)


@pytest.mark.parametrize("mode, budget", [("async", None), ("overlap", None), ("async", 4), ("overlap", 4)])
def test_saves_of_cuda_tensors_stage_in_pinned_memory_and_load_anywhere(tmp_path, mode, budget):
    """`budget`: host_memory of a quarter of the rank's bytes, the pinned staging counted in it;
    the save streams through it, device-to-host copies of parts of tensors."""
    model, opt = trained("cuda")
    expected = host_values(model, opt)
    rank_bytes = sum(v.nbytes for v in expected.values())
    ckpt = cp.Checkpointer(host_memory=None if budget is None else rank_bytes // budget)
    handle = ckpt.save_async(tmp_path / "g", {"model": model, "optim": opt}, overlap=mode == "overlap")
    handle.wait_snapshot()
    mutate(model)  # the next step runs on the GPU at once: the snapshot must already be whole
    handle.wait()
    staged = [s.buffer for s in ckpt.pool._slots if s.buffer is not None]
    assert staged and all(b.is_pinned() for b in staged)
    assert budget is None or ckpt.pool.allocated_bytes <= rank_bytes // budget
    for device in ("cpu", "cuda"):
        fresh, fresh_opt = trained(device, seed=1)
        cp.load(tmp_path / "g", {"model": fresh, "optim": fresh_opt})
        got = host_values(fresh, fresh_opt)
        assert sorted(got) == sorted(expected)
        for k in expected:
            assert torch.equal(got[k], expected[k]), (device, k)
        assert all(p.device.type == device for p in fresh.parameters())


def test_a_cpu_checkpoint_loads_into_cuda_tensors_and_refuses_another_dtype(tmp_path):
    model, _ = trained("cpu")
    cp.save(tmp_path / "c", {"model": model})
    fresh = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512, bias=False)).to("cuda", torch.bfloat16)
    with pytest.raises(cp.LoadMismatchError, match="bf16|bfloat16"):
        cp.load(tmp_path / "c", {"model": fresh})
    fresh = fresh.float()
    cp.load(tmp_path / "c", {"model": fresh})
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k].cpu(), v), k
