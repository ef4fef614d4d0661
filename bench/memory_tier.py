"""Memory-tier benchmark: the memory save's stall against the async save's, and recovery from
memory after a host is lost against a cold load from disk, side by side in one process tree.

Workload: the model of bench/save_load.py (FSDP2 + AdamW, 2 processes, gloo, CPU), each process
a simulated host of its own (host key and shared-memory directory). The first job alternates
async saves to disk and memory saves (every one replicated to the other host; the last one also
persisted to disk from memory), then host b's process is killed while host a's is in a
collective: detection is the time from the kill until the survivor's collective raises. Host b's
memory is removed. A new job of 1 process on host a then loads the same step, 2 -> 1, in turns:
cold from disk (page cache dropped), and by recovery (agreement on the step, then the load from
memory); both are checked bit for bit against each other. Everything written is deleted.

Run: .venv/bin/python bench/memory_tier.py            (about 2 minutes here)
     .venv/bin/python bench/memory_tier.py --params-m 8 --reps 2   (a quick smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from save_load import WIDTH, build, drop_cache, local_state, same, train_step  # noqa: E402


def on_host(hosts_dir: str, name: str) -> None:
    from ckpt_plugins._src import shm
    os.environ[shm.HOST_ENV] = name
    os.environ[shm.SHM_DIR_ENV] = os.path.join(hosts_dir, name)
    os.makedirs(os.environ[shm.SHM_DIR_ENV], exist_ok=True)


def manager(args, root: str):
    import ckpt_plugins as cp
    return cp.CheckpointManager(os.path.join(root, "run"), memory_every=1, persist_every=args.reps + 1)


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def first_job(rank: int, world: int, port: int, args, root: str, hosts_dir: str) -> None:
    on_host(hosts_dir, "ab"[rank])
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, opt = build(args.layers, fsdp=True)
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt}
    mgr = manager(args, root)
    ck = mgr.checkpointer  # the async peer shares the staging pool and the groups

    def timed(save) -> tuple:
        t = time.time()
        handle = save()
        stall = time.time() - t
        handle.wait()
        return slowest(stall), slowest(time.time() - t)

    timed(lambda: ck.save_async(os.path.join(root, "async_warm"), state))  # unmeasured
    timed(lambda: mgr.save(1, state))
    stalls = {"async": [], "memory": []}
    done = {"async": [], "memory": []}
    def async_save(rep: int) -> tuple:
        path = os.path.join(root, f"async_{rep}")
        out = timed(lambda: ck.save_async(path, state))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        return out

    for rep in range(args.reps):
        # the order alternates: the staging pool's two slots alternate too, and they need not be
        # equally fast (huge pages or not), so each method gets each slot
        saves = [("async", lambda: async_save(rep)), ("memory", lambda: timed(lambda: mgr.save(rep + 2, state)))]
        for i, (name, save) in enumerate(saves if rep % 2 == 0 else saves[::-1]):
            train_step(model, opt, 2 * rep + 1 + i)
            s, d = save()  # the last memory save is persisted too
            stalls[name].append(s)
            done[name].append(d)
    rank_bytes = sum(t.numel() * t.element_size() for t in local_state(model, opt).values())
    out = os.path.join(root, "first.json")
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"stalls": stalls, "done": done, "rank_bytes": rank_bytes}, f)
    dist.barrier()
    if rank == 1:  # host b is lost while host a waits in a collective
        time.sleep(0.5)
        with open(os.path.join(root, "killed_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(1))
    except Exception:
        detected = time.time()
        with open(os.path.join(root, "detected_at"), "w") as f:
            f.write(repr(detected))
    os._exit(0)  # no orderly teardown: the group is broken


def second_job(args, root: str, hosts_dir: str, port: int) -> dict:
    import ckpt_plugins as cp
    on_host(hosts_dir, "a")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model, opt = build(args.layers, fsdp=False)
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt}
    mgr = manager(args, root)
    durable = mgr.path(mgr.latest())
    out = {"disk": [], "recovery": [], "agree": [], "load": []}
    reference = None
    for _ in range(args.rounds):
        drop_cache(durable)
        t = time.time()
        cp.load(durable, state)
        out["disk"].append(time.time() - t)
        disk_state = local_state(model, opt)
        reference = reference or disk_state
        t = time.time()
        result = mgr.load(state)
        out["recovery"].append(time.time() - t)
        out["agree"].append(mgr.tier.timings["agree"])
        out["load"].append(mgr.tier.timings["load"])
        assert (result.source, result.step) == ("memory", args.reps + 1), (result.source, result.step)
        assert same(local_state(model, opt), reference), "the memory load differs from the disk load"
    out["bytes"] = sum(t.numel() * t.element_size() for t in reference.values())
    out["read_limit"] = min(read_limit(mgr.tier.host.step_path(args.reps + 1)) for _ in range(args.rounds))
    dist.destroy_process_group()
    return out


def read_limit(step_dir: str) -> float:
    """Seconds to read a memory step's data files into touched memory with as many threads as
    cores: what a load from memory cannot beat (it also verifies checksums and copies into place)."""
    from concurrent.futures import ThreadPoolExecutor
    data = os.path.join(step_dir, "data")
    files = [os.path.join(data, f) for f in sorted(os.listdir(data))]
    buffers = [torch.ones(os.path.getsize(f), dtype=torch.uint8) for f in files]

    def read(i: int) -> None:
        fd = os.open(files[i], os.O_RDONLY)
        try:
            view, done = memoryview(buffers[i].numpy()), 0
            while done < len(view):
                done += os.preadv(fd, [view[done:]], done)
        finally:
            os.close(fd)
    t = time.time()
    with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
        list(pool.map(read, range(len(files))))
    return time.time() - t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-m", type=float, default=96, help="model parameters, millions (as bench/save_load.py)")
    parser.add_argument("--reps", type=int, default=7, help="async and memory saves, alternating")
    parser.add_argument("--rounds", type=int, default=5, help="disk and memory loads, alternating")
    parser.add_argument("--dir", default=None, help="where durable checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    args.layers = max(1, round(args.params_m * 1e6 / WIDTH ** 2))
    root = tempfile.mkdtemp(prefix="ckpt_bench_tier_", dir=args.dir)
    hosts_dir = tempfile.mkdtemp(prefix="ckpt_bench_hosts_", dir="/dev/shm")
    try:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=first_job, args=(r, 2, port, args, root, hosts_dir)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        with open(os.path.join(root, "first.json")) as f:
            first = json.load(f)
        with open(os.path.join(root, "killed_at")) as f, open(os.path.join(root, "detected_at")) as g:
            detection = float(g.read()) - float(f.read())
        shutil.rmtree(os.path.join(hosts_dir, "b"))  # host b's memory is gone with it
        second = second_job(args, root, hosts_dir, free_port())
        report(args, first, detection, second)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(hosts_dir, ignore_errors=True)


def report(args, first, detection: float, second) -> None:
    med = statistics.median
    stall = {k: med(v) for k, v in first["stalls"].items()}
    done = {k: med(v) for k, v in first["done"].items()}
    disk, recovery = med(second["disk"]), med(second["recovery"])
    agree, load = med(second["agree"]), med(second["load"])
    gb = second["bytes"] / 1e9
    print(f"memory tier: {first['rank_bytes'] / 2**20:.0f} MiB per rank, 2 ranks on 2 simulated hosts; "
          f"medians of {args.reps} saves and {args.rounds} loads")
    print(f"save stall (slowest rank): async {stall['async']:.3f} s, memory {stall['memory']:.3f} s; "
          f"memory / async = {stall['memory'] / stall['async']:.2f} (target <= 1)")
    print(f"until done: async (written to disk) {done['async']:.2f} s, memory (replicated to the other host) "
          f"{done['memory']:.2f} s")
    print(f"recovery after losing host b, 2 -> 1 rank: detection {detection:.3f} s (kill -> the survivor's "
          f"collective raises), agreement {agree:.3f} s, load {load:.3f} s; agreement + load {recovery:.3f} s")
    print(f"cold load from disk {disk:.3f} s; disk / memory recovery = {disk / recovery:.1f}x (target >= 5)")
    print(f"load from memory {gb / load:.2f} GB/s; machine limit (reading the step's files from shared memory "
          f"on every core) {gb / second['read_limit']:.2f} GB/s: ours / limit = {second['read_limit'] / load:.2f}")


if __name__ == "__main__":
    main()
