"""A real save on 4 ranks where one rank's disk is slow, then what `bcp trace` shows about it.

Rank 3's data-file writes are throttled (a storage wrapper sleeps before each write), the way a
failing disk or a congested NIC would slow one host. Run:
    .venv/bin/python examples/straggler.py OUT_DIR
then open OUT_DIR/step_2-heatmap.png, or load OUT_DIR/step_2-trace.json in ui.perfetto.dev.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SLOW_RANK, DELAY = 3, 0.15  # seconds before each of its 8 MiB writes


def worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import ckpt_plugins as cp
    from ckpt_plugins._src import storage
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if rank == SLOW_RANK:
        write = storage._FileWriter.write
        storage._FileWriter.write = lambda self, data: (time.sleep(DELAY), write(self, data))[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = cp.CheckpointManager(root)
    for step in (1, 2):
        model(torch.randn(8, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()
        manager.save(step, {"model": model, "optim": opt})
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    with tempfile.TemporaryDirectory() as root:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(4, port, root), nprocs=4, join=True)
        bcp = os.path.join(os.path.dirname(sys.executable), "bcp")
        subprocess.run([bcp, "trace", os.path.join(root, "step_2"), "--out", out], check=True)
        subprocess.run([bcp, "trace", root, "--history", "--out", out], check=True)


if __name__ == "__main__":
    main()
