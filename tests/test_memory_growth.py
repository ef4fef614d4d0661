"""Host memory with real processes (2 ranks, one host). No growth: a rank's resident memory after
20 consecutive saves is what it was after the first (within 5%), for sync, async and memory-tier
saves. A budget: a save of four times the rank's host-memory budget stays within it."""
import gc
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


def reset_peak() -> None:
    """VmHWM restarts from the resident memory now (Linux clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def budget_phase(rank, root):
    """192 MiB of this rank's own tensors saved with a budget of a quarter of them: the peak
    resident memory grows by at most the budget and 64 MiB (staged whole, it would grow by 192),
    and the checkpoint loads bit for bit."""
    torch.manual_seed(100 + rank)
    state = {f"r{rank}/w{i}": torch.randn(4 << 20) for i in range(12)}
    budget = sum(t.nbytes for t in state.values()) // 4
    ckpt = cp.Checkpointer(host_memory=budget)
    ckpt.coordinator()  # its process groups exist before the measurement, as after any first save
    gc.collect()
    reset_peak()
    before = rss()
    ckpt.save(os.path.join(root, "budget"), state)
    grew = peak() - before
    print(f"rank {rank}: a {4 * budget / MIB:.0f} MiB save within {budget / MIB:.0f} MiB grew the peak by {grew / MIB:.0f} MiB")
    assert grew <= budget + 64 * MIB, f"rank {rank}: {grew / MIB:.0f} MiB"
    fresh = {k: torch.empty_like(v) for k, v in state.items()}
    ckpt.load(os.path.join(root, "budget"), fresh)
    assert all(torch.equal(fresh[k], v) for k, v in state.items())
    ckpt.close()


def memory_worker(rank, world, root, shm_dir):
    growth_phase(rank, root, shm_dir)
    budget_phase(rank, root)


def growth_phase(rank, root, shm_dir):
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


def test_resident_memory_does_not_grow_over_twenty_saves_nor_pass_the_host_memory_budget(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    run_ranks(2, memory_worker, str(tmp_path / "ckpt"), str(shm_dir))
