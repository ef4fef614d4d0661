"""Host-memory budget sweep: async saves staged within a budget of 100% down to 12.5% of a rank's
bytes, beside unbounded staging, against the machine's write limit, in one process tree.

Workload: bench/save_load.py's FSDP2 model and AdamW on 2 processes (gloo, CPU). For each budget a
fresh Checkpointer with `host_memory` set, warmed up as the framework hooks do, one unmeasured
save, then `--reps` async saves: the stall (until `save_async` returns: every byte copied or
written) and the time to commit (fsync included); and the rank's peak resident memory from the
Checkpointer's creation to its last commit, above training's own memory (budgets are f x the
rank's bytes + 1 MiB for its objects and page alignment). The O_DIRECT write limit of a rank's bytes is sampled beside every save
(both ranks at once). The last checkpoint of each budget is loaded and checked bit for bit.

Run: .venv/bin/python bench/host_memory.py              (about 5 minutes here)
     .venv/bin/python bench/host_memory.py --params-m 16 --reps 1   (a quick smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from save_load import (WIDTH, Limits, build, local_state, peak, release_memory, reset_peak, resident,  # noqa: E402
                       same, train_step)

FRACTIONS = [None, 1.0, 0.5, 0.25, 0.125]  # None: unbounded (two slots of the whole save)
SLACK = 1 << 20  # beside f x the rank's bytes: its objects and page alignment (100%: staged whole, once)


def worker(rank: int, world: int, port: int, args, root: str, out_path: str) -> None:
    import ckpt_plugins as cp
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, opt = build(args.layers, fsdp=True)
    train_step(model, opt, 0)
    reference = local_state(model, opt)
    rank_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    limits = Limits(root, rank_bytes)
    state = {"model": model, "optim": opt}
    results = {"rank_bytes": rank_bytes, "budgets": []}
    for fraction in FRACTIONS:
        budget = None if fraction is None else int(fraction * rank_bytes) + SLACK
        release_memory()
        reset_peak()
        before = resident()  # training's own memory: the peak above it is the checkpointer's
        ckpt = cp.Checkpointer(host_memory=budget)
        ckpt.warm_up(state, background=False)
        ckpt.save(os.path.join(root, "unmeasured"), state)
        row = {"fraction": fraction, "stall": [], "commit": [], "write": [], "ok": True}
        for rep in range(args.reps):
            path = os.path.join(root, f"b{fraction}_{rep}")
            row["write"].append(slowest(limits.write()))
            dist.barrier()
            t0 = time.perf_counter()
            handle = ckpt.save_async(path, state)
            stall = time.perf_counter() - t0
            handle.wait()
            commit = time.perf_counter() - t0
            row["stall"].append(slowest(stall))
            row["commit"].append(slowest(commit))
            if rep < args.reps - 1 and rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        row["peak"] = slowest(peak() - before)
        fresh, fresh_opt = build(args.layers, fsdp=True)
        train_step(fresh, fresh_opt, 99)  # other values, and optimizer state to load into
        ckpt.load(path, {"model": fresh, "optim": fresh_opt})
        row["ok"] = slowest(0.0 if same(local_state(fresh, fresh_opt), reference) else 1.0) == 0.0
        del fresh, fresh_opt
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(os.path.join(root, "unmeasured"), ignore_errors=True)
        ckpt.close()
        del ckpt
        release_memory()
        results["budgets"].append(row)
    limits.read()  # removes the limit's file
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def slowest(value: float) -> float:
    import torch
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def report(args, results) -> None:
    med = statistics.median
    rank_bytes = results["rank_bytes"]
    print(f"\nFSDP2, 2 processes (gloo, CPU), {args.layers} x Linear({WIDTH},{WIDTH}) + AdamW: "
          f"{rank_bytes / 2**20:.0f} MiB per rank; async saves, medians of {args.reps}, slowest rank")
    print(f"{'host_memory':>14}{'stall s':>9}{'commit s':>10}{'write limit s':>15}{'commit/limit':>14}"
          f"{'stall/commit':>14}{'peak +MiB':>11}  bit-exact")
    for row in results["budgets"]:
        stall, commit, write = med(row["stall"]), med(row["commit"]), med(row["write"])
        name = "unbounded" if row["fraction"] is None else f"{row['fraction']:.1%}"
        print(f"{name:>14}{stall:>9.3f}{commit:>10.3f}{write:>15.3f}{commit / write:>14.2f}"
              f"{stall / commit:>14.2f}{row['peak'] / 2**20:>11.0f}  {'yes' if row['ok'] else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-m", type=float, default=96, help="model parameters, millions (as bench/save_load.py)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    args.layers = max(1, round(args.params_m * 1e6 / WIDTH ** 2))
    root = tempfile.mkdtemp(prefix="ckpt_bench_budget_", dir=args.dir)
    out_path = os.path.join(root, "results.json")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(2, port, args, root, out_path), nprocs=2, join=True)
        with open(out_path) as f:
            report(args, json.load(f))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
