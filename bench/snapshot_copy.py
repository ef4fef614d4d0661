"""Snapshot copy benchmark: the engine's snapshot against one `copy_` per tensor and against the
memcpy limit (one `copy_` of all the bytes), with 2 ranks copying at once as they do in a save.

Each rank stages 69 x 8 MiB float32 tensors (552 MiB, the save_load workload's share) into a touched
buffer; methods are interleaved repetition by repetition so the machine's drift hits them alike.

Run: .venv/bin/python bench/snapshot_copy.py        (about 1 minute)
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TENSORS, NUMEL, REPS = 69, 2048 * 1024, 12


def worker(rank: int, barrier, out) -> None:
    from ckpt_plugins._src.engine.write import StagedWrite, StageItem
    sources = [torch.randn(NUMEL) for _ in range(TENSORS)]
    whole = torch.randn(TENSORS * NUMEL)
    whole_dst = torch.zeros_like(whole)
    buffer = torch.zeros(TENSORS * NUMEL * 4, dtype=torch.uint8)  # touched, like the staging pool
    job = StagedWrite(None, [StageItem(f"r{rank}-{i % 2}.bin", i // 2 * NUMEL * 4, s) for i, s in enumerate(sources)])
    assert job.nbytes <= buffer.numel()
    dests = [buffer[i * NUMEL * 4:(i + 1) * NUMEL * 4].view(torch.float32) for i in range(TENSORS)]
    methods = {
        "memcpy limit (one copy_)": lambda: whole_dst.copy_(whole),
        "one copy_ per tensor": lambda: [d.copy_(s) for d, s in zip(dests, sources)],
        "engine snapshot": lambda: job.snapshot(buffer, threads=torch.get_num_threads()),
    }
    times = {name: [] for name in methods}
    for _ in range(REPS):
        for name, run in methods.items():
            barrier.wait()
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    if rank == 0:
        out.update({name: statistics.median(v) for name, v in times.items()})


def main() -> None:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Manager().dict()
    mp.spawn(worker, args=(barrier, out), nprocs=2, join=True)
    limit = out["memcpy limit (one copy_)"]
    print(f"2 ranks at once, {TENSORS} x {NUMEL * 4 >> 20} MiB each, medians of {REPS}:")
    for name, t in out.items():
        print(f"  {name:<26} {t:.3f} s  ({t / limit:.2f}x the memcpy limit)")


if __name__ == "__main__":
    main()
