"""No growth: a rank's resident memory after 20 consecutive saves is what it was after the first
(within 5%), for sync, async and memory-tier saves, with real processes (2 ranks, one host)."""
import os

import torch
from torch import nn

import ckpt_plugins as cp
from distributed import run_ranks

SAVES = 20
MIB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def growth_worker(rank, world, root, shm_dir):
    from ckpt_plugins._src import shm
    os.environ[shm.SHM_DIR_ENV] = shm_dir
    torch.manual_seed(rank)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # 8 MiB of weights, 24 MiB with AdamW
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    runs = {
        "sync": lambda m, step: m.save(step, state),
        "async": lambda m, step: m.save_async(step, state).wait(),
        "memory": lambda m, step: m.save(step, state),
    }
    report = []
    for mode, save in runs.items():
        manager = cp.CheckpointManager(os.path.join(root, mode), keep_last=2,
                                       **({"memory_every": 1, "persist_every": 1000} if mode == "memory" else {}))
        sizes = []
        for step in range(1, SAVES + 1):
            with torch.no_grad():  # the state changes between saves, as in training
                for p in model.parameters():
                    p.add_(1e-3)
            save(manager, step)
            sizes.append(rss())
        first, last = sizes[0], sizes[-1]
        report.append(f"rank {rank} {mode}: {first / MIB:.0f} MiB after the first save, {last / MIB:.0f} MiB after {SAVES}")
        assert last <= first * 1.05, report[-1]
    print("\n".join(report))


def test_twenty_saves_in_a_row_leave_resident_memory_where_the_first_left_it(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    run_ranks(2, growth_worker, str(tmp_path / "ckpt"), str(shm_dir))
