"""GPU snapshot benchmark: how long an async save of CUDA tensors blocks, against the machine's
device-to-host copy limit and against PyTorch DCP's async_save, in one process on one GPU.

Workload: 8 x Linear(4096, 4096) fp32 + AdamW on the GPU (1.5 GiB of state). The limit is one
`copy_` of all those bytes, already on the device in one tensor, into touched pinned memory.
Medians of --reps saves after one warm-up save each; every checkpoint is checked bit for bit
once and deleted.

Run (on a machine with a CUDA GPU): python bench/cuda_snapshot.py      (about 2 minutes)
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trained(layers: int, width: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(16, width, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def tensors(model, opt):
    out = dict(model.state_dict())
    for i, state in enumerate(opt.state.values()):
        out.update({f"{i}/{k}": v for k, v in state.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    import ckpt_plugins as cp
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model, opt = trained(args.layers, args.width)
    live = tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in live.values() if t.is_cuda)
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    root = tempfile.mkdtemp(prefix="cuda_bench_", dir=args.dir)
    ckpt, planner = cp.Checkpointer(), DefaultSavePlanner(enable_plan_caching=True)
    times = {"limit": [], "ours_async": [], "ours_overlap": [], "dcp_async_save": []}
    snapshots = {}  # until wait_snapshot() returns: the copy itself
    try:
        for rep in range(args.reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            pinned.copy_(flat, non_blocking=True)
            torch.cuda.synchronize()
            times["limit"].append(time.perf_counter() - t)
            for name in ("ours_async", "ours_overlap", "dcp_async_save"):
                path = os.path.join(root, f"{name}_{rep}")
                expected = {k: v.detach().cpu().clone() for k, v in live.items()} if rep == 0 else None
                torch.cuda.synchronize()
                t = time.perf_counter()
                if name == "dcp_async_save":
                    pending = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                             checkpoint_id=path, planner=planner)
                    stall = time.perf_counter() - t
                    pending.result()
                else:
                    handle = ckpt.save_async(path, {"model": model, "optim": opt}, overlap=name == "ours_overlap")
                    stall = time.perf_counter() - t
                    handle.wait_snapshot()  # what the training loop calls before its next step
                    snapshots.setdefault(name, []).append(time.perf_counter() - t)
                    handle.wait()
                times[name].append(stall)
                if expected is not None and name != "dcp_async_save":
                    fresh, fresh_opt = trained(args.layers, args.width)
                    cp.load(path, {"model": fresh, "optim": fresh_opt})
                    got = tensors(fresh, fresh_opt)
                    assert all(torch.equal(got[k].cpu(), expected[k]) for k in expected), name
                    del fresh, fresh_opt
                shutil.rmtree(path, ignore_errors=True)
    finally:
        ckpt.close()
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first is the warm-up
    print(f"{torch.cuda.get_device_name()}: {len(live)} tensors, {nbytes / 2**30:.2f} GiB on the GPU; "
          f"medians of {args.reps} after a warm-up")
    print(f"device-to-host limit (one copy_ into pinned memory): {med['limit']:.3f} s "
          f"({nbytes / med['limit'] / 1e9:.1f} GB/s)")
    for name in ("ours_async", "ours_overlap", "dcp_async_save"):
        copied = (f"; snapshot done after {statistics.median(snapshots[name][1:]):.3f} s"
                  if name in snapshots else "")
        print(f"  {name:<15} save call blocks {med[name]:.3f} s = {med[name] / med['limit']:.2f}x the limit, "
              f"{med[name] / med['dcp_async_save']:.2f}x dcp_async_save{copied}")


if __name__ == "__main__":
    main()
