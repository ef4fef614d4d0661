"""What telemetry costs a save: 2 ranks (gloo, CPU) save the same state with telemetry on and
off, alternating, sync and async; medians and their ratio. Also the direct bound: the number of
records a save makes times what one costs, against the save's time. Target: under 1%.

Run: .venv/bin/python bench/telemetry_overhead.py [--mib 256] [--reps 7]   (about 2 minutes)
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port, args, root):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import ckpt_plugins as cp
    from ckpt_plugins._src.fragment import box_fragment
    from ckpt_plugins._src.state import Handler, LoadItems, SaveItems

    class Shard(Handler):  # this rank's rows of 64 tensors
        def __init__(self, tensors):
            self.tensors = tensors

        def save_items(self, prefix):
            return SaveItems(fragments=[box_fragment(f"{prefix}/{i}", (world * t.shape[0], t.shape[1]),
                                                     (rank * t.shape[0], 0), t) for i, t in enumerate(self.tensors)])

        def load_items(self, prefix, metadata):
            return LoadItems()

    rows = args.mib * 2**20 // 64 // 4 // 1024
    state = {"model": Shard([torch.randn(rows, 1024) for _ in range(64)])}
    ckpts = {on: cp.Checkpointer(telemetry=on) for on in (True, False)}
    times = {(on, mode): [] for on in (True, False) for mode in ("sync", "async")}
    records = []
    for rep in range(args.reps + 1):  # the first round warms up both
        for mode in ("sync", "async"):
            for on in ((True, False) if rep % 2 else (False, True)):
                path = os.path.join(root, f"{mode}-{on}")
                dist.barrier()
                t = time.perf_counter()
                info = (ckpts[on].save_async(path, state, overwrite=True).wait() if mode == "async"
                        else ckpts[on].save(path, state, overwrite=True))
                elapsed = time.perf_counter() - t
                if rep:
                    times[(on, mode)].append(elapsed)
                if on and info.telemetry is not None:
                    records.append(sum(p.count for p in info.telemetry.phases))
    # one record's cost, measured alone
    from ckpt_plugins._src.telemetry import Recorder
    recorder, n = Recorder("save", "local", rank), 100_000
    t = time.perf_counter()
    for _ in range(n):
        recorder.add("write", 0.0, 1.0, 4096, files=1)
    per_record = (time.perf_counter() - t) / n
    if rank == 0:
        med = statistics.median
        print(f"2 ranks x {args.mib} MiB (64 tensors each), medians of {args.reps}:")
        for mode in ("sync", "async"):
            on, off = med(times[(True, mode)]), med(times[(False, mode)])
            print(f"  {mode:<5} save to commit: telemetry on {on:.3f} s, off {off:.3f} s, on / off {on / off:.3f}")
        save = med(times[(True, "sync")])
        per_save = med(records)
        print(f"  direct bound: {per_save:.0f} records per save x {per_record * 1e6:.2f} us = "
              f"{per_save * per_record * 1e3:.3f} ms = {per_save * per_record / save * 100:.3f}% of a sync save "
              f"(target < 1%)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes per rank, MiB")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt_telemetry_")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(2, port, args, root), nprocs=2, join=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
