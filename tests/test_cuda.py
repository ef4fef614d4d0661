"""The engine's CUDA paths: pinned staging, device-to-host snapshots, loads into device tensors,
and the framework hooks' overlapped saves of state that trains on the GPU.

CI has no GPU, so these run where one is present (docs/benchmarks.md, "GPU checks"); elsewhere they are skipped.
"""
import pytest
import torch
from torch import nn

import ckpt_plugins as cp
from distributed import run_env_ranks, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def two_layers(device):
    return nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512, bias=False)).to(device)


def trained(device, seed=0, **flags):
    torch.manual_seed(seed)
    model = two_layers(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags)
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
    fresh = two_layers("cuda").to(torch.bfloat16)
    with pytest.raises(cp.LoadMismatchError, match="bf16|bfloat16"):
        cp.load(tmp_path / "c", {"model": fresh})
    fresh = fresh.float()
    cp.load(tmp_path / "c", {"model": fresh})
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k].cpu(), v), k


@pytest.mark.parametrize("saved, live", [({}, {}), ({}, {"capturable": True}), ({"capturable": True}, {}),
                                         ({"fused": True}, {"fused": True})])
def test_optimizer_state_a_load_creates_lies_where_torchs_own_load_puts_it(tmp_path, saved, live):
    """An optimizer that has not stepped gets its state from the load: a "step" stays on the CPU
    unless the group is capturable or fused (the checkpoint's flags, which the load applies), the
    moments go to the GPU, as `load_state_dict` does it."""
    model, opt = trained("cuda", **saved)
    cp.save(tmp_path / "s", {"model": model, "optim": opt})
    fresh, own = two_layers("cuda"), two_layers("cuda")
    ours, torchs = (torch.optim.AdamW(m.parameters(), lr=1e-3, **live) for m in (fresh, own))
    cp.load(tmp_path / "s", {"model": fresh, "optim": ours})
    torchs.load_state_dict(opt.state_dict())
    for p, q in zip(fresh.parameters(), own.parameters()):
        for name, value in torchs.state[q].items():
            got = ours.state[p][name]
            assert (got.device, got.dtype) == (value.device, value.dtype) and torch.equal(got, value), name
    assert [g.get("capturable") for g in ours.param_groups] == [g.get("capturable") for g in torchs.param_groups]
    ours.step()


def test_an_overlapped_trainer_save_of_cuda_state_holds_the_optimizer_step(tmp_path):
    """The HF Trainer on the GPU: step 3's forward and backward passes (gradient accumulation)
    enqueue their kernels beside the save's device-to-host copies; its optimizer step waits."""
    from test_hf_trainer import check_overlapped_trainer_save
    check_overlapped_trainer_save(tmp_path, "cuda")


def test_an_overlapped_deepspeed_save_of_cuda_state_holds_the_step(tmp_path):
    """DeepSpeed's CUDA accelerator, ZeRO-3 in bf16 with gradient accumulation: the parameter
    gathers of the next micro-steps run beside the snapshot of the partitions."""
    pytest.importorskip("deepspeed")
    from test_deepspeed import overlapped_saves_hold_the_step
    run_env_ranks(1, overlapped_saves_hold_the_step, str(tmp_path))


def test_an_overlapped_megatron_save_of_cuda_state_holds_the_step(tmp_path):
    """Megatron's own training step on the GPU (NCCL, one rank), `--async-save` (overlapped by
    default) with the distributed optimizer's parameter all-gather overlapped with the next forward: the snapshot
    holds the step saved, and the state loads bit for bit."""
    pytest.importorskip("megatron.core")
    from test_megatron_training import overlapped_save_worker
    run_ranks(1, overlapped_save_worker, str(tmp_path), backend="nccl")
